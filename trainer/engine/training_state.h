// What a checkpoint shard holds (format version 2, trainer/io/shard_file.h): the rank's owned range
// of every parameter ("model/<name>") and of both AdamW moments ("exp_avg/<name>",
// "exp_avg_sq/<name>"), float32, as ShardedEngine lays them out; AdamW's step counter
// ("optimizer.step", rank 0); and the rank's CPU generator state ("rng/cpu/rank-NNNNN"). Because
// every range names its tensor, global shape, box (tensor-parallel block, if any) and offset, a
// checkpoint written under one layout (dp, ZeRO stage, tp) restores under any other. The trainer's
// save and resume, and the checkpoint benchmark, all go through here.
#pragma once

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "trainer/io/shard_file.h"
#include "trainer/engine/sharded_engine.h"

namespace tessera::trainer {

// Writes this rank's part of the training state to `path` (hashing it on the way).
absl::StatusOr<WrittenShard> WriteTrainingState(const std::string& path, ShardedEngine& engine,
                                                int rank,
                                                const std::map<std::string, std::string>& metadata);

// A rank's training state copied to host memory at one moment (pinned memory when it lives on
// CUDA), so that training goes on while it is written: what WriteTrainingState writes, owned.
struct TrainingStateSnapshot {
  std::vector<TensorRange> ranges;  // `data`: contiguous float32 host copies
  int64_t optimizer_step = 0;
  at::Tensor rng;  // the rank's CPU generator state
};

// What a snapshot is taken of, captured on the training thread: the live ranges (views of the
// engine's parameters and moments, not copies), AdamW's step and the RNG state (both copied: the
// next step changes them). The ranges keep their values until the engine's next Step, which is
// all the time a StateCopy has. With device tensors, `ready` is recorded on the current
// stream: the copy waits for the work that wrote them.
struct LiveTrainingState {
  TrainingStateSnapshot state;  // `ranges` hold live views
  std::shared_ptr<void> ready;  // a CUDA event; null for host state
};
LiveTrainingState CaptureTrainingState(ShardedEngine& engine);

// The copy of captured state to host memory (pinned for device tensors), which several threads
// may share. Host ranges are copied with memcpy, each by whichever thread claims it first: the
// save's thread copies them while the training thread runs forward and backward (which read the
// parameters and write gradients only), and the training thread joins in with its intra-op pool
// (Finish) if the copy is not done when it needs to change the state. Device ranges are copied
// by Run alone, on a stream of its own after `ready`, all at once.
class StateCopy {
 public:
  // Destination buffers: those of `reuse` (an earlier snapshot of the same engine, no longer
  // needed) where they match; new ones (pinned for device ranges) are allocated by the first
  // thread that copies, so that pinning memory does not hold up the training thread.
  StateCopy(const LiveTrainingState& live, TrainingStateSnapshot* reuse);
  StateCopy(const StateCopy&) = delete;
  StateCopy& operator=(const StateCopy&) = delete;

  bool on_device() const { return on_device_; }
  // Copies ranges that no thread has claimed until none is left, on this thread only.
  void Run();
  // Copies what is left with this thread and the intra-op pool's (host ranges), then waits until
  // every range is copied.
  void Finish();
  // Waits until every range is copied.
  void WaitDone();
  bool done();
  // The snapshot, once done; an error when a range could not be copied.
  absl::StatusOr<TrainingStateSnapshot> Take();

 private:
  // The buffers reuse did not provide; false (and every unclaimed range ended with the error)
  // when they cannot be allocated.
  bool Allocate();
  void CopyRange(size_t i);
  void CountDone(size_t ranges);

  TrainingStateSnapshot snapshot_;  // ranges' data: the destinations
  std::vector<at::Tensor> sources_;
  std::shared_ptr<void> ready_;
  bool on_device_ = false;
  std::once_flag allocated_;
  std::atomic<size_t> next_{0};
  std::mutex mutex_;
  std::condition_variable done_cv_;
  size_t done_ = 0;
  std::string error_;
};

// Captures the state and copies it to host memory (StateCopy) on the calling thread, complete
// when it returns.
TrainingStateSnapshot SnapshotTrainingState(ShardedEngine& engine,
                                            TrainingStateSnapshot* reuse = nullptr);

// Writes a snapshot as WriteTrainingState writes the live state (the same file, byte for byte).
// Touches no LibTorch state, so it may run on another thread while training goes on.
absl::StatusOr<WrittenShard> WriteTrainingStateSnapshot(
    const std::string& path, const TrainingStateSnapshot& snapshot, int rank,
    const std::map<std::string, std::string>& metadata);

// Restores what `engine` keeps on this rank from a checkpoint written under any layout, and this
// rank's RNG (rank 0's when the checkpoint had fewer ranks). FAILED_PRECONDITION naming the
// tensor when the checkpoint is of another model (a tensor missing, extra, or of another shape).
absl::Status ReadTrainingState(const ShardedCheckpointReader& reader, ShardedEngine& engine,
                               int rank);

}  // namespace tessera::trainer

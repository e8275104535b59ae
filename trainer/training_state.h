// What a checkpoint shard holds (format version 2, trainer/shard_file.h): the rank's owned range
// of every parameter ("model/<name>") and of both AdamW moments ("exp_avg/<name>",
// "exp_avg_sq/<name>"), float32, as ShardedEngine lays them out; AdamW's step counter
// ("optimizer.step", rank 0); and the rank's CPU generator state ("rng/cpu/rank-NNNNN"). Because
// every range names its tensor, global shape, box (tensor-parallel block, if any) and offset, a
// checkpoint written under one layout (dp, ZeRO stage, tp) restores under any other. The trainer's
// save and resume, and the checkpoint benchmark, all go through here.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "trainer/shard_file.h"
#include "trainer/sharded_engine.h"

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
// all the time CopyTrainingState has. With device tensors, `ready` is recorded on the current
// stream: the copy waits for the work that wrote them.
struct LiveTrainingState {
  TrainingStateSnapshot state;  // `ranges` hold live views
  std::shared_ptr<void> ready;  // a CUDA event; null for host state
};
LiveTrainingState CaptureTrainingState(ShardedEngine& engine);

// Copies captured state to host memory (pinned for device tensors), complete when it returns.
// Any thread may call it while the training thread runs forward and backward (which read the
// parameters and write gradients only): host ranges are copied with memcpy (no intra-op thread
// pool on this thread), device ranges on a stream of their own after `ready`. With `reuse` (an
// earlier snapshot of the same engine, no longer needed) its buffers are written over instead of
// allocating new ones: no page faults on fresh memory.
TrainingStateSnapshot CopyTrainingState(const LiveTrainingState& live,
                                        TrainingStateSnapshot* reuse = nullptr);

// CaptureTrainingState and CopyTrainingState in one call on the calling thread.
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

// What a checkpoint shard holds (format version 2, trainer/shard_file.h): the rank's owned range
// of every parameter ("model/<name>") and of both AdamW moments ("exp_avg/<name>",
// "exp_avg_sq/<name>"), float32, as ShardedEngine lays them out; AdamW's step counter
// ("optimizer.step", rank 0); and the rank's CPU generator state ("rng/cpu/rank-NNNNN"). Because
// every range names its tensor, global shape, box (tensor-parallel block, if any) and offset, a
// checkpoint written under one layout (dp, ZeRO stage, tp) restores under any other. The trainer's
// save and resume, and the checkpoint benchmark, all go through here.
#pragma once

#include <map>
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

// Copies this rank's part of the training state (SaveRanges, AdamW's step, the RNG) to host
// memory (pinned for device tensors), complete when it returns. With `reuse` (an earlier
// snapshot of the same engine, no longer needed) its buffers are written over instead of
// allocating new ones: no page faults on fresh memory, so a save blocks training for a copy only.
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

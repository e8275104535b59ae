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

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "trainer/shard_file.h"
#include "trainer/sharded_engine.h"

namespace tessera::trainer {

// Writes this rank's part of the training state to `path` (hashing it on the way).
absl::StatusOr<WrittenShard> WriteTrainingState(const std::string& path, ShardedEngine& engine,
                                                int rank,
                                                const std::map<std::string, std::string>& metadata);

// Restores what `engine` keeps on this rank from a checkpoint written under any layout, and this
// rank's RNG (rank 0's when the checkpoint had fewer ranks). FAILED_PRECONDITION naming the
// tensor when the checkpoint is of another model (a tensor missing, extra, or of another shape).
absl::Status ReadTrainingState(const ShardedCheckpointReader& reader, ShardedEngine& engine,
                               int rank);

}  // namespace tessera::trainer

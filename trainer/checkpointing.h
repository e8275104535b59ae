// A trainer job's checkpoints as its ranks see them: resuming from the newest complete checkpoint
// (rank 0 finds and verifies it, the others follow through the store) under whatever layout wrote
// it, and saving one (every rank writes its shard into the staging directory, rank 0 commits the
// manifest with the digests the ranks computed while writing), plus the safetensors export of the
// full weights (rank 0, from the checkpoint it committed). Every function here is a collective
// over the job's ranks.
#pragma once

#include <optional>
#include <ostream>
#include <string>

#include "absl/status/statusor.h"
#include "tessera/v1/checkpoint.pb.h"
#include "tessera/v1/trainer.pb.h"
#include "trainer/distributed.h"
#include "trainer/sharded_engine.h"

namespace tessera::trainer {

struct CheckpointContext {
  const v1::TrainerTask* task = nullptr;
  int rank = 0;
  int world = 1;
  // The world group; null for a single-process job.
  JoinedGroup* group = nullptr;
  ShardedEngine* engine = nullptr;
  // Progress lines (skipped checkpoints, ...); may be null.
  std::ostream* log = nullptr;
};

struct Resumed {
  std::string path;
  v1::CheckpointManifest manifest;
};

// Restores the newest complete checkpoint under the task's checkpoint directory into the engine
// and the CPU RNG. std::nullopt when there is none (or the job asks not to resume).
absl::StatusOr<std::optional<Resumed>> ResumeLatest(const CheckpointContext& context);

// What rank 0 records in the manifest besides the shards.
struct CheckpointState {
  int64_t step = 0;
  int64_t tokens_seen = 0;
  v1::Layout layout;
  v1::ModelSummary model;
  v1::DataPosition data_position;
};

// Saves the checkpoint of `state.step`. Rank 0 returns the Checkpoint to report (with the
// safetensors path when `export_safetensors`); the other ranks return an empty one. With
// `export_safetensors`, rank 0 alone, once the checkpoint is committed, reads every "model/<name>"
// tensor back from it, one at a time, and writes <checkpoint>/model.safetensors (float32, names
// without "model/", data in the names' order with digit runs compared as numbers, metadata
// format=pt, tessera.job_id, tessera.step, tessera.preset); the other ranks do not wait for it.
absl::StatusOr<v1::Checkpoint> SaveCheckpoint(const CheckpointContext& context,
                                              const CheckpointState& state,
                                              bool export_safetensors);

}  // namespace tessera::trainer

// A trainer job's checkpoints as its ranks see them: resuming from the newest complete checkpoint
// (rank 0 finds it, the others follow through the store; the ranks verify its digests between
// them while they load it) under whatever layout wrote it, and saving one (every rank writes its shard into the staging directory, rank 0 commits the
// manifest with the digests the ranks computed while writing), plus the safetensors export of the
// full weights (rank 0, from the checkpoint it committed). Every function here is a collective
// over the job's ranks.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "tessera/v1/checkpoint.pb.h"
#include "tessera/v1/metrics.pb.h"
#include "tessera/v1/trainer.pb.h"
#include "trainer/parallel/distributed.h"
#include "trainer/engine/sharded_engine.h"
#include "trainer/engine/training_state.h"

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
  // Fault injection (common/trainer_env.h kFaultKillInCheckpointAtStepEnv): the asynchronous
  // save of this step tears its shard and kills the process. 0: off.
  int64_t kill_in_checkpoint_at_step = 0;
  // Tests: runs on an asynchronous save's thread before it copies the state.
  std::function<void()> before_copy = nullptr;
};

struct Resumed {
  std::string path;
  v1::CheckpointManifest manifest;
  // Where the checkpoint was read from (memory: workers' shard caches, memory_restore.h) and how
  // long this rank's restore took.
  v1::CheckpointRestore restore;
};

// Restores the newest complete checkpoint under the task's checkpoint directory into the engine
// and the CPU RNG. std::nullopt when there is none (or the job asks not to resume). Its digests
// are checked while it loads, each rank hashing the shards its layout's twin wrote, so the
// checkpoint is read from disk once; when one does not match, the checkpoint is renamed to
// <dir>.corrupt (QuarantineCheckpoint) and the newest older one that verifies in full is loaded
// instead; DATA_LOSS when there is none (the engine no longer holds its initial state, so the
// attempt must end: its restart starts from step 0). With a shard cache (TrainerTask
// shard_cache_socket), the newest checkpoint is first fetched from the workers' memory and loaded
// from there when every rank got every shard with the manifest's digests (memory_restore.h);
// otherwise from storage as above.
absl::StatusOr<std::optional<Resumed>> ResumeLatest(const CheckpointContext& context);

// What rank 0 records in the manifest besides the shards.
struct CheckpointState {
  int64_t step = 0;
  int64_t tokens_seen = 0;
  v1::Layout layout;
  v1::ModelSummary model;
  v1::DataPosition data_position;
  // Rank 0: the step metrics the checkpoint carries, a serialized v1::StepMetricsLog
  // (trainer/io/step_metrics_log.h: StepMetricsLog::EncodedUpTo), written into the staging
  // directory before the commit; null: none (other ranks; a run without them).
  std::shared_ptr<const std::string> step_metrics;
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

// Saves as SaveCheckpoint does, but training goes on while the shard is written. Start captures
// this rank's state (CaptureTrainingState: views, no copies) and returns; a thread of its own
// copies the state to host memory (pinned on CUDA; StateCopy) while the next step's forward and
// backward run, then writes and hashes the shard, and on rank 0 waits (through the store, not a
// collective) for every rank's digest, commits the manifest and exports. The training thread
// calls AwaitSnapshot before anything changes the engine's state (its Step): the only wait a
// save costs a step is for a copy that has not finished by then. A save interrupted anywhere
// (kill -9 included) leaves only a staging directory, which resume never reads. One save at a
// time: Start first waits for the previous one. Start, AwaitSnapshot and Wait are called from
// the training thread.
class AsyncCheckpointer {
 public:
  explicit AsyncCheckpointer(const CheckpointContext& context);
  // Waits for the save in flight.
  ~AsyncCheckpointer();
  AsyncCheckpointer(const AsyncCheckpointer&) = delete;
  AsyncCheckpointer& operator=(const AsyncCheckpointer&) = delete;

  // Waits for the previous save (returning its error, if any, and starting nothing); then, a
  // collective over the job's ranks: rank 0 prepares the staging directory, every rank captures
  // its state and starts copying and writing it in the background. `on_committed` runs on rank
  // 0's background thread once the checkpoint is committed.
  absl::Status Start(const CheckpointState& state, bool export_safetensors,
                     std::function<void(const v1::Checkpoint&)> on_committed);
  // Returns once the save in flight (if any) holds its copy of the state, so that the engine may
  // change it; the seconds it waited. Host state that is not copied yet is copied here, with the
  // intra-op thread pool.
  double AwaitSnapshot();
  // Waits for the save in flight, if any; its error.
  absl::Status Wait();
  // How long the last Start blocked its caller: the wait for the previous save, the barrier and
  // the capture.
  double last_blocked_seconds() const { return last_blocked_seconds_; }

 private:
  CheckpointContext context_;
  std::thread thread_;
  // The last save's snapshot, whose buffers the next one reuses once that save is done.
  std::shared_ptr<TrainingStateSnapshot> spare_;
  absl::Status status_;  // written by thread_, read after joining it
  double last_blocked_seconds_ = 0;
  // The copy of the save in flight (or the last one), shared by thread_ and AwaitSnapshot.
  std::shared_ptr<StateCopy> copy_;
};

}  // namespace tessera::trainer

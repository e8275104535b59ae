#include "trainer/engine/checkpointing.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <csignal>
#include <filesystem>
#include <chrono>
#include <cstring>
#include <fstream>
#include <future>
#include <map>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "trainer/io/checkpoint.h"
#include "trainer/io/checkpoint_fence.h"
#include "trainer/io/safetensors.h"
#include "trainer/io/shard_file.h"
#include "trainer/io/step_metrics_log.h"
#include "trainer/io/memory_restore.h"
#include "trainer/engine/training_state.h"

namespace tessera::trainer {
namespace {

// TCPStore key through which rank 0 tells the others what to resume from.
constexpr char kResumeKey[] = "tessera/resume_from";

void Log(const CheckpointContext& context, const std::string& line) {
  if (context.log != nullptr) *context.log << "[rank " << context.rank << "] " << line << std::endl;
}

absl::StatusOr<v1::CheckpointManifest> ReadManifest(const std::string& dir) {
  std::ifstream in(absl::StrCat(dir, "/", kManifestFileName), std::ios::binary);
  v1::CheckpointManifest manifest;
  if (!in || !manifest.ParseFromIstream(&in)) {
    return absl::DataLossError(absl::StrCat(dir, "/", kManifestFileName, ": cannot read"));
  }
  return manifest;
}

absl::Status Barrier(const CheckpointContext& context) {
  return context.group != nullptr ? trainer::Barrier(*context.group) : absl::OkStatus();
}

// The prefix of the model's parameters among a checkpoint's tensors.
constexpr char kModelPrefix[] = "model/";

// Orders names as strings, except that runs of digits compare as numbers ("layers.2.mlp" before
// "layers.10.attn"), so an export lists the layers in order, whatever their count.
bool NaturalLess(const std::string& a, const std::string& b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (absl::ascii_isdigit(a[i]) && absl::ascii_isdigit(b[j])) {
      size_t a_end = i, b_end = j;
      while (a_end < a.size() && absl::ascii_isdigit(a[a_end])) ++a_end;
      while (b_end < b.size() && absl::ascii_isdigit(b[b_end])) ++b_end;
      // Without leading zeros, a shorter run is a smaller number.
      size_t a_digits = i, b_digits = j;
      while (a_digits + 1 < a_end && a[a_digits] == '0') ++a_digits;
      while (b_digits + 1 < b_end && b[b_digits] == '0') ++b_digits;
      const std::string_view a_number(a.data() + a_digits, a_end - a_digits);
      const std::string_view b_number(b.data() + b_digits, b_end - b_digits);
      if (a_number.size() != b_number.size()) return a_number.size() < b_number.size();
      if (a_number != b_number) return a_number < b_number;
      if (a_end - i != b_end - j) return a_end - i < b_end - j;  // "01" after "1"
      i = a_end;
      j = b_end;
      continue;
    }
    if (a[i] != b[j]) return a[i] < b[j];
    ++i;
    ++j;
  }
  return a.size() - i < b.size() - j;
}

// Rank 0, after committing `manifest` into `dir`: writes every "model/<name>" tensor of the
// checkpoint, whole and float32, to `file` under <name>, one tensor in memory at a time. The
// data are in NaturalLess order of the names (the header, being JSON, lists them sorted).
absl::Status ExportSafetensors(const CheckpointContext& context, const std::string& dir,
                               const v1::CheckpointManifest& manifest, const std::string& file,
                               const std::string& preset) {
  ASSIGN_OR_RETURN(ShardedCheckpointReader reader, ShardedCheckpointReader::Open(dir, manifest));
  std::vector<std::string> names;
  for (const std::string& name : reader.TensorNames()) {
    if (absl::StartsWith(name, kModelPrefix)) names.push_back(name);
  }
  std::sort(names.begin(), names.end(), NaturalLess);
  std::vector<TensorSpec> tensors;
  for (const std::string& name : names) {
    ASSIGN_OR_RETURN(std::vector<int64_t> shape, reader.GlobalShape(name));
    tensors.push_back({.name = name.substr(std::strlen(kModelPrefix)),
                       .dtype = "F32",
                       .shape = std::move(shape)});
  }
  return WriteSafetensorsStreaming(file, tensors,
                                   {{"format", "pt"},
                                    {"tessera.job_id", context.task->job_id()},
                                    {"tessera.step", std::to_string(manifest.step())},
                                    {"tessera.preset", preset}},
                                   [&](size_t i, void* data) {
                                     int64_t numel = 1;
                                     for (int64_t dim : tensors[i].shape) numel *= dim;
                                     return reader.Read(names[i], tensors[i].shape, "F32", 0, numel,
                                                        data);
                                   });
}

}  // namespace

namespace {

// Rank 0 hands `value` to the other ranks through the store under `key`; they wait for it.
std::string ShareFromRankZero(const CheckpointContext& context, const std::string& key,
                              const std::string& value) {
  if (context.group == nullptr) return value;
  if (context.rank == 0) {
    context.group->store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
    return value;
  }
  std::vector<uint8_t> bytes = context.group->store->get(key);
  return std::string(bytes.begin(), bytes.end());
}

// Every rank's `problem` (empty: none) gathered by rank 0, which hands the first non-empty one
// (by rank) back to all: the ranks agree on whether the checkpoint they loaded verified.
absl::StatusOr<std::string> AgreeOnProblem(const CheckpointContext& context,
                                           const std::string& key, const std::string& problem) {
  if (context.group == nullptr) return problem;
  if (context.rank != 0) {
    context.group->store->set(absl::StrCat(key, "/", context.rank),
                              std::vector<uint8_t>(problem.begin(), problem.end()));
    return ShareFromRankZero(context, key, "");
  }
  std::string first = problem;
  if (context.world > 1) {
    std::vector<std::string> keys;
    for (int r = 1; r < context.world; ++r) keys.push_back(absl::StrCat(key, "/", r));
    const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(
        1000 * (context.task->collective_timeout_seconds() > 0
                    ? context.task->collective_timeout_seconds()
                    : 600)));
    try {
      context.group->store->wait(keys, timeout);
    } catch (const std::exception& e) {
      return absl::DeadlineExceededError(absl::StrCat(
          "resume: waiting for every rank's verification: ", c10::GetExceptionString(e)));
    }
    for (const std::string& k : keys) {
      if (!first.empty()) break;
      std::vector<uint8_t> bytes = context.group->store->get(k);
      first.assign(bytes.begin(), bytes.end());
    }
  }
  return ShareFromRankZero(context, key, first);
}

// This rank's share of a checkpoint's digests: the shards written by ranks r with r % world ==
// rank, which under the layout that wrote them are the ones this rank reads itself, so the
// hashing meets the pages its reads bring in. Returns the first mismatch or read error.
absl::Status VerifyShareOfDigests(const std::string& dir, const v1::CheckpointManifest& manifest,
                                  int rank, int world) {
  for (const v1::CheckpointShard& shard : manifest.shards()) {
    if (shard.rank() % world != rank) continue;
    RETURN_IF_ERROR(VerifyShardDigest(dir, shard));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::optional<Resumed>> ResumeLatest(const CheckpointContext& context) {
  const auto start = std::chrono::steady_clock::now();
  const v1::TrainerTask& task = *context.task;
  const std::string& root = task.checkpoint_directory();
  const bool resume = !task.spec().checkpoint().has_resume() || task.spec().checkpoint().resume();
  if (root.empty() || !resume) return std::nullopt;
  // Round 0 takes the newest checkpoint whose manifest and shard sizes check and verifies its
  // digests while loading it: each rank hashes its share of the shards on a thread beside its
  // reads, so a checkpoint is read from disk once. Only when some digest did not match (the
  // engine then holds a mix of it and the initial state) does round 1 set it aside
  // (QuarantineCheckpoint) and load the newest checkpoint that rank 0 verified in full first.
  std::string quarantined;
  for (int round = 0; round < 2; ++round) {
    const DigestCheck find = round == 0 ? DigestCheck::kNone : DigestCheck::kAll;
    std::string path;
    std::optional<v1::CheckpointManifest> found_manifest;
    if (context.rank == 0) {
      std::vector<std::string> skipped;
      ASSIGN_OR_RETURN(auto found, FindLatestCheckpoint(root, &skipped, find));
      for (const auto& line : skipped) Log(context, absl::StrCat("skipping checkpoint: ", line));
      if (found.has_value()) {
        path = found->path;
        found_manifest = std::move(found->manifest);
      }
    }
    path = ShareFromRankZero(context, absl::StrCat(kResumeKey, "/", round), path);
    if (path.empty()) {
      if (round == 0) return std::nullopt;
      return absl::DataLossError(absl::StrCat(
          "resume: the newest checkpoint failed verification after it was loaded (set aside as ",
          quarantined, ") and no older checkpoint under ", root,
          " verifies; this attempt's state is no longer its initial one, so it stops: a restart "
          "starts from step 0"));
    }
    Resumed resumed;
    resumed.path = path;
    if (found_manifest.has_value()) {
      resumed.manifest = *std::move(found_manifest);
    } else {
      ASSIGN_OR_RETURN(resumed.manifest, ReadManifest(path));
    }
    if (resumed.manifest.format_version() < kCheckpointFormatVersion) {
      return absl::FailedPreconditionError(absl::StrCat(
          path, ": checkpoint format ", resumed.manifest.format_version(),
          " (whole LibTorch archives per rank) was written by an older trainer and cannot be "
          "resumed by this one; start the job with checkpoint.resume: false or another "
          "checkpoint directory"));
    }
    // Memory first (round 0 only: after a mismatch on storage, storage is what is in question).
    std::optional<MemoryCheckpointCopy> memory;
    if (round == 0 && !task.shard_cache_socket().empty()) {
      absl::StatusOr<MemoryCheckpointCopy> fetched =
          FetchCheckpointFromMemory(task, resumed.manifest);
      ASSIGN_OR_RETURN(
          std::string miss,
          AgreeOnProblem(context, absl::StrCat(kResumeKey, "/memory"),
                         fetched.ok() ? ""
                                      : absl::StrCat("rank ", context.rank, ": ",
                                                     fetched.status().message())));
      if (miss.empty()) {
        resumed.restore.set_shards_from_peers(fetched->shards_from_peers);
        memory.emplace(*std::move(fetched));
      } else {
        resumed.restore.set_memory_miss_reason(miss);
        Log(context, absl::StrCat("checkpoint ", path, " not restored from memory: ", miss,
                                  "; reading it from storage"));
      }
    }
    resumed.restore.set_source(memory.has_value() ? v1::RESTORE_SOURCE_MEMORY
                                                  : v1::RESTORE_SOURCE_STORAGE);
    ASSIGN_OR_RETURN(ShardedCheckpointReader reader,
                     memory.has_value()
                         ? ShardedCheckpointReader::OpenShardPaths(path, resumed.manifest,
                                                                   memory->ShardPaths())
                         : ShardedCheckpointReader::Open(path, resumed.manifest));
    const auto load_start = std::chrono::steady_clock::now();
    std::future<absl::Status> digests;
    // The memory copy's digests were checked against the manifest as they arrived.
    if (round == 0 && !memory.has_value()) {
      digests = std::async(std::launch::async, VerifyShareOfDigests, path,
                           std::cref(resumed.manifest), context.rank, context.world);
    }
    const absl::Status applied = ReadTrainingState(reader, *context.engine, context.rank);
    const absl::Status verified = digests.valid() ? digests.get() : absl::OkStatus();
    ASSIGN_OR_RETURN(std::string problem,
                     AgreeOnProblem(context, absl::StrCat(kResumeKey, "/verified/", round),
                                    verified.ok() ? "" : std::string(verified.message())));
    if (problem.empty()) {
      RETURN_IF_ERROR(applied);
      const auto now = std::chrono::steady_clock::now();
      resumed.restore.set_seconds(std::chrono::duration<double>(now - start).count());
      // Where a restore from memory spent its time (docs/performance.md, peer memory).
      const std::string phases =
          memory.has_value()
              ? absl::StrFormat("; fetch %.3f s, of which digests %.3f s over all shards, "
                                "load %.3f s",
                                memory->fetch_seconds, memory->verify_seconds,
                                std::chrono::duration<double>(now - load_start).count())
              : "";
      Log(context,
          absl::StrCat("resumed from ", path, " at step ", resumed.manifest.step(), " (from ",
                       memory.has_value() ? "memory" : "storage", ", ",
                       absl::StrFormat("%.3f", resumed.restore.seconds()), " s",
                       resumed.restore.shards_from_peers() > 0
                           ? absl::StrCat(", ", resumed.restore.shards_from_peers(),
                                          " shard(s) from peers")
                           : "",
                       phases, ")",
                       " (written with dp ", resumed.manifest.layout().data_parallel(), ", tp ",
                       std::max(1, resumed.manifest.layout().tensor_parallel()), ", pp ",
                       std::max(1, resumed.manifest.layout().pipeline_parallel()), ", ZeRO ",
                       resumed.manifest.layout().zero_stage(), ")"));
      return resumed;
    }
    quarantined = path;
    if (context.rank == 0) {
      absl::StatusOr<std::string> moved = QuarantineCheckpoint(path);
      if (moved.ok()) quarantined = *moved;
      Log(context, absl::StrCat("skipping checkpoint: ", path, ": skipped: ", problem, "; ",
                                moved.ok() ? absl::StrCat("set aside as ", *moved)
                                           : absl::StrCat("could not set it aside: ",
                                                          moved.status().message())));
    }
  }
  return absl::InternalError("resume: unreachable");
}

namespace {

// Rank 0 creates the step's staging directory; every rank waits for it (a collective).
absl::Status PrepareSave(const CheckpointContext& context, int64_t step) {
  if (context.rank == 0) {
    // A stale attempt stops here, before it touches a staging directory a newer one may use.
    RETURN_IF_ERROR(CheckCheckpointFence(context.task->checkpoint_directory(),
                                         context.task->job_id(), context.task->attempt()));
    RETURN_IF_ERROR(PrepareStaging(context.task->checkpoint_directory(), step).status());
  }
  return Barrier(context);
}

// A save that failed because a newer attempt took the directory over (its rank 0 removes the
// stale staging directory this one was writing into) reports the fence's refusal, which names
// the cause, rather than the missing file it ran into; any other failure is returned as it is.
absl::Status PreferFenceRefusal(const CheckpointContext& context, absl::Status failed) {
  if (failed.ok()) return failed;
  const v1::TrainerTask& task = *context.task;
  absl::Status fenced =
      CheckCheckpointFence(task.checkpoint_directory(), task.job_id(), task.attempt());
  if (!absl::IsFailedPrecondition(fenced)) return failed;
  return absl::FailedPreconditionError(
      absl::StrCat(fenced.message(), "; the save had failed with: ", failed.message()));
}

// After this rank wrote its shard: the ranks other than 0 hand their digest to rank 0 through the
// store and are done; rank 0 waits for every digest (the shards are then all written), commits
// the manifest with them and exports. Uses the store only, no collective, so it may run on a
// thread of its own while the training loop runs collectives. Rank 0 returns the Checkpoint to
// report, the others an empty one.
absl::StatusOr<v1::Checkpoint> CollectAndCommit(const CheckpointContext& context,
                                                const CheckpointState& state,
                                                const WrittenShard& written,
                                                bool export_safetensors,
                                                std::chrono::steady_clock::time_point start) {
  const v1::TrainerTask& task = *context.task;
  const std::string& root = task.checkpoint_directory();
  const std::string digest_key = absl::StrCat("checkpoint/", state.step, "/xxh3_128/");
  v1::Checkpoint checkpoint;
  if (context.rank != 0) {
    context.group->store->set(
        absl::StrCat(digest_key, context.rank),
        std::vector<uint8_t>(written.xxh3_128.begin(), written.xxh3_128.end()));
  } else {
    std::map<std::string, std::string> known_digests{
        {SliceShardFileName(context.rank), written.xxh3_128}};
    if (state.step_metrics != nullptr) {
      ASSIGN_OR_RETURN(
          v1::CheckpointFile metrics_file,
          WriteEncodedStepMetricsFile(StagingDir(root, state.step), *state.step_metrics));
      known_digests[metrics_file.file()] = metrics_file.xxh3_128();
    }
    if (context.world > 1) {
      std::vector<std::string> keys;
      for (int r = 1; r < context.world; ++r) keys.push_back(absl::StrCat(digest_key, r));
      const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(
          1000 * (task.collective_timeout_seconds() > 0 ? task.collective_timeout_seconds() : 600)));
      try {
        context.group->store->wait(keys, timeout);
      } catch (const std::exception& e) {
        return absl::DeadlineExceededError(
            absl::StrCat("checkpoint step ", state.step,
                         ": waiting for every rank's shard: ", c10::GetExceptionString(e)));
      }
      for (int r = 1; r < context.world; ++r) {
        std::vector<uint8_t> bytes = context.group->store->get(keys[r - 1]);
        known_digests[SliceShardFileName(r)] = std::string(bytes.begin(), bytes.end());
      }
    }
    v1::CheckpointManifest manifest;
    manifest.set_job_id(task.job_id());
    manifest.set_step(state.step);
    *manifest.mutable_layout() = state.layout;
    *manifest.mutable_model() = state.model;
    *manifest.mutable_data_position() = state.data_position;
    manifest.set_tokens_seen(state.tokens_seen);
    std::vector<int64_t> retired;
    ASSIGN_OR_RETURN(manifest, CommitCheckpoint(root, state.step, std::move(manifest),
                                                context.world, task.spec().checkpoint().keep_last(),
                                                known_digests, task.attempt(), &retired));
    checkpoint.mutable_retired_steps()->Add(retired.begin(), retired.end());
    checkpoint.set_job_id(task.job_id());
    checkpoint.set_step(state.step);
    checkpoint.set_path(absl::StrCat(root, "/", CheckpointDirName(state.step)));
    if (export_safetensors) {
      // From the committed checkpoint, which holds every tensor whatever the layout (no rank
      // holds every parameter under pipeline parallelism); the other ranks go on meanwhile.
      const std::string file = absl::StrCat(checkpoint.path(), "/model.safetensors");
      RETURN_IF_ERROR(
          ExportSafetensors(context, checkpoint.path(), manifest, file, state.model.preset()));
      checkpoint.set_safetensors_path(file);
    }
    int64_t size = 0;
    for (const auto& s : manifest.shards()) size += s.size_bytes();
    checkpoint.set_size_bytes(size);
    checkpoint.set_num_shards(manifest.shards_size());
    *checkpoint.mutable_create_time() = manifest.create_time();
  }
  checkpoint.set_write_seconds(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  if (context.rank == 0) Log(context, absl::StrCat("checkpoint ", checkpoint.path()));
  return checkpoint;
}

std::map<std::string, std::string> ShardMetadata(const CheckpointContext& context, int64_t step) {
  return {{"tessera.job_id", context.task->job_id()},
          {"tessera.step", std::to_string(step)},
          {"tessera.rank", std::to_string(context.rank)}};
}

std::string ShardPath(const CheckpointContext& context, int64_t step) {
  return absl::StrCat(StagingDir(context.task->checkpoint_directory(), step), "/",
                      SliceShardFileName(context.rank));
}

// Hands this rank's shard of `step`, just written, to the worker's memory. Called before the rank's
// part of the commit (its digest to rank 0; rank 0's rename), so that by the time anyone learns
// of the checkpoint, every rank's worker holds its shard (the worker keeps the step before it
// too, for a commit that does not happen). A failure costs only the memory copy: logged, never
// the checkpoint's error.
void CacheShard(const CheckpointContext& context, int64_t step, const WrittenShard& written) {
  if (context.task->shard_cache_socket().empty()) return;
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<SealedMemory> bytes = ReadShardForCache(*context.task, ShardPath(context, step));
  absl::Status status = bytes.status();
  if (status.ok()) {
    status = HandShardToCache(*context.task, step, context.rank, SliceShardFileName(context.rank),
                              written.xxh3_128, *bytes);
  }
  if (!status.ok()) {
    Log(context, absl::StrCat("checkpoint step ", step, ": shard not kept in memory: ",
                              status.ToString()));
    return;
  }
  Log(context,
      absl::StrFormat(
          "checkpoint step %d: shard (%d bytes) handed to the worker's memory in %.3f s", step,
          bytes->size(),
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()));
}

}  // namespace

absl::StatusOr<v1::Checkpoint> SaveCheckpoint(const CheckpointContext& context,
                                              const CheckpointState& state,
                                              bool export_safetensors) {
  const auto start = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(PrepareSave(context, state.step));
  // Each rank hashes its shard while writing it and hands the digest to rank 0 through the store,
  // so the commit does not read the shards back.
  absl::StatusOr<WrittenShard> written =
      WriteTrainingState(ShardPath(context, state.step), *context.engine, context.rank,
                         ShardMetadata(context, state.step));
  if (!written.ok()) return PreferFenceRefusal(context, written.status());
  CacheShard(context, state.step, *written);
  absl::StatusOr<v1::Checkpoint> checkpoint =
      CollectAndCommit(context, state, *written, export_safetensors, start);
  if (!checkpoint.ok()) return PreferFenceRefusal(context, checkpoint.status());
  return checkpoint;
}

AsyncCheckpointer::AsyncCheckpointer(const CheckpointContext& context) : context_(context) {}

AsyncCheckpointer::~AsyncCheckpointer() {
  // A save still in flight when training stopped (a failure elsewhere): finished here, and its
  // error, which nobody else will see, logged.
  if (absl::Status status = Wait(); !status.ok()) {
    Log(context_, absl::StrCat("checkpoint not saved: ", status.ToString()));
  }
}

absl::Status AsyncCheckpointer::Wait() {
  if (thread_.joinable()) thread_.join();
  absl::Status status = std::move(status_);
  status_ = absl::OkStatus();
  return status;
}

double AsyncCheckpointer::AwaitSnapshot() {
  if (copy_ == nullptr || copy_->done()) return 0;
  const auto start = std::chrono::steady_clock::now();
  copy_->Finish();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

namespace {

// The calling thread, and threads it starts, take cores that training leaves idle only: on a CPU
// trainer every core runs intra-op threads, and another thread at equal priority stalls each
// parallel region on the thread it preempted.
void RunAtIdlePriority(const CheckpointContext& context) {
  sched_param idle{};
  if (int error = pthread_setschedparam(pthread_self(), SCHED_IDLE, &idle); error != 0) {
    Log(context, absl::StrCat("checkpoint writer keeps its priority: pthread_setschedparam: ",
                              std::strerror(error)));
  }
}

}  // namespace

absl::Status AsyncCheckpointer::Start(const CheckpointState& state, bool export_safetensors,
                                      std::function<void(const v1::Checkpoint&)> on_committed) {
  const auto start = std::chrono::steady_clock::now();
  // The previous save must be done (and have succeeded) before its snapshot buffers are reused
  // and before a second one is in flight.
  RETURN_IF_ERROR(Wait());
  RETURN_IF_ERROR(PrepareSave(context_, state.step));
  // The previous save is done: its snapshot's buffers are written over.
  auto copy = std::make_shared<StateCopy>(CaptureTrainingState(*context_.engine), spare_.get());
  copy_ = copy;
  last_blocked_seconds_ =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  thread_ = std::thread([this, state, export_safetensors, start, copy,
                         on_committed = std::move(on_committed)] {
    // Host state is copied at idle priority too (the training thread finishes the copy if it
    // needs the state first); a device copy is a DMA this thread only waits for.
    if (!copy->on_device()) RunAtIdlePriority(context_);
    if (context_.before_copy) context_.before_copy();
    copy->Run();
    absl::StatusOr<TrainingStateSnapshot> taken = copy->Take();
    if (!taken.ok()) {
      status_ = absl::InternalError(
          absl::StrCat("checkpoint step ", state.step, ": ", taken.status().message()));
      return;
    }
    auto snapshot = std::make_shared<TrainingStateSnapshot>(*std::move(taken));
    spare_ = snapshot;
    if (copy->on_device()) RunAtIdlePriority(context_);
    absl::StatusOr<WrittenShard> written = WriteTrainingStateSnapshot(
        ShardPath(context_, state.step), *snapshot, context_.rank,
        ShardMetadata(context_, state.step));
    if (!written.ok()) {
      status_ = PreferFenceRefusal(context_, written.status());
      return;
    }
    if (context_.kill_in_checkpoint_at_step == state.step) {
      const std::string path = ShardPath(context_, state.step);
      std::error_code ignored;
      std::filesystem::resize_file(path, written->size_bytes / 2, ignored);
      ::raise(SIGKILL);
    }
    CacheShard(context_, state.step, *written);
    absl::StatusOr<v1::Checkpoint> checkpoint;
    try {
      checkpoint = CollectAndCommit(context_, state, *written, export_safetensors, start);
    } catch (const std::exception& e) {
      checkpoint = absl::InternalError(absl::StrCat("checkpoint step ", state.step, ": ",
                                                    c10::GetExceptionString(e)));
    }
    if (!checkpoint.ok()) {
      status_ = PreferFenceRefusal(context_, checkpoint.status());
      return;
    }
    if (context_.rank == 0 && on_committed) on_committed(*checkpoint);
  });
  return absl::OkStatus();
}

}  // namespace tessera::trainer

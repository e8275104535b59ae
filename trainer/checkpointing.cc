#include "trainer/checkpointing.h"

#include <chrono>
#include <fstream>
#include <map>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "trainer/checkpoint.h"
#include "trainer/safetensors.h"
#include "trainer/shard_file.h"
#include "trainer/training_state.h"

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

// Every rank takes part (ZeRO-3 gathers unit by unit); rank 0 writes the file.
absl::Status ExportSafetensors(const CheckpointContext& context, const std::string& file,
                               int64_t step, const std::string& preset) {
  std::vector<at::Tensor> keep;
  std::vector<TensorView> views;
  context.engine->ForEachFullParameter([&](const std::string& name, const at::Tensor& value) {
    if (context.rank != 0) return;
    keep.push_back(value);
    views.push_back({.name = name,
                     .dtype = "F32",
                     .shape = value.sizes().vec(),
                     .data = value.data_ptr(),
                     .nbytes = static_cast<size_t>(value.nbytes())});
  });
  if (context.rank != 0) return absl::OkStatus();
  return WriteSafetensors(file, views,
                          {{"format", "pt"},
                           {"tessera.job_id", context.task->job_id()},
                           {"tessera.step", std::to_string(step)},
                           {"tessera.preset", preset}});
}

}  // namespace

absl::StatusOr<std::optional<Resumed>> ResumeLatest(const CheckpointContext& context) {
  const v1::TrainerTask& task = *context.task;
  const std::string& root = task.checkpoint_directory();
  const bool resume = !task.spec().checkpoint().has_resume() || task.spec().checkpoint().resume();
  if (root.empty() || !resume) return std::nullopt;
  std::string path;
  std::optional<v1::CheckpointManifest> verified;
  if (context.rank == 0) {
    std::vector<std::string> skipped;
    ASSIGN_OR_RETURN(auto found, FindLatestCheckpoint(root, &skipped));
    for (const auto& line : skipped) Log(context, absl::StrCat("skipping checkpoint: ", line));
    if (found.has_value()) {
      path = found->path;
      verified = std::move(found->manifest);
    }
  }
  if (context.group != nullptr) {
    if (context.rank == 0) {
      context.group->store->set(kResumeKey, std::vector<uint8_t>(path.begin(), path.end()));
    } else {
      auto bytes = context.group->store->get(kResumeKey);
      path.assign(bytes.begin(), bytes.end());
    }
  }
  if (path.empty()) return std::nullopt;

  // Rank 0 verified the checkpoint (every shard's sha256) while finding it; the others read the
  // manifest only.
  Resumed resumed;
  resumed.path = path;
  if (verified.has_value()) {
    resumed.manifest = *std::move(verified);
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
  ASSIGN_OR_RETURN(ShardedCheckpointReader reader,
                   ShardedCheckpointReader::Open(path, resumed.manifest));
  RETURN_IF_ERROR(ReadTrainingState(reader, *context.engine, context.rank));
  Log(context, absl::StrCat("resumed from ", path, " at step ", resumed.manifest.step(),
                            " (written with dp ", resumed.manifest.layout().data_parallel(),
                            ", ZeRO ", resumed.manifest.layout().zero_stage(), ")"));
  return resumed;
}

absl::StatusOr<v1::Checkpoint> SaveCheckpoint(const CheckpointContext& context,
                                              const CheckpointState& state,
                                              bool export_safetensors) {
  auto start = std::chrono::steady_clock::now();
  const v1::TrainerTask& task = *context.task;
  const std::string& root = task.checkpoint_directory();
  if (context.rank == 0) RETURN_IF_ERROR(PrepareStaging(root, state.step).status());
  RETURN_IF_ERROR(Barrier(context));

  // Each rank hashes its shard while writing it and hands the digest to rank 0 through the store,
  // so the commit does not read the shards back.
  const std::string shard = SliceShardFileName(context.rank);
  ASSIGN_OR_RETURN(WrittenShard written,
                   WriteTrainingState(absl::StrCat(StagingDir(root, state.step), "/", shard),
                                      *context.engine, context.rank,
                                      {{"tessera.job_id", task.job_id()},
                                       {"tessera.step", std::to_string(state.step)},
                                       {"tessera.rank", std::to_string(context.rank)}}));
  const std::string digest_key = absl::StrCat("checkpoint/", state.step, "/sha256/");
  if (context.group != nullptr && context.rank != 0) {
    context.group->store->set(absl::StrCat(digest_key, context.rank),
                              std::vector<uint8_t>(written.sha256.begin(), written.sha256.end()));
  }
  RETURN_IF_ERROR(Barrier(context));
  v1::Checkpoint checkpoint;
  if (context.rank == 0) {
    std::map<std::string, std::string> known_sha256{{shard, written.sha256}};
    for (int r = 1; r < context.world; ++r) {
      std::vector<uint8_t> bytes = context.group->store->get(absl::StrCat(digest_key, r));
      known_sha256[SliceShardFileName(r)] = std::string(bytes.begin(), bytes.end());
    }
    v1::CheckpointManifest manifest;
    manifest.set_job_id(task.job_id());
    manifest.set_step(state.step);
    *manifest.mutable_layout() = state.layout;
    *manifest.mutable_model() = state.model;
    *manifest.mutable_data_position() = state.data_position;
    manifest.set_tokens_seen(state.tokens_seen);
    ASSIGN_OR_RETURN(manifest,
                     CommitCheckpoint(root, state.step, std::move(manifest), context.world,
                                      task.spec().checkpoint().keep_last(), known_sha256));
    checkpoint.set_job_id(task.job_id());
    checkpoint.set_step(state.step);
    checkpoint.set_path(absl::StrCat(root, "/", CheckpointDirName(state.step)));
    int64_t size = 0;
    for (const auto& s : manifest.shards()) size += s.size_bytes();
    checkpoint.set_size_bytes(size);
    checkpoint.set_num_shards(manifest.shards_size());
    *checkpoint.mutable_create_time() = manifest.create_time();
  }
  if (export_safetensors) {
    // The commit renamed the directory; the others learn its name from the step.
    const std::string file =
        absl::StrCat(root, "/", CheckpointDirName(state.step), "/model.safetensors");
    RETURN_IF_ERROR(ExportSafetensors(context, file, state.step, state.model.preset()));
    if (context.rank == 0) checkpoint.set_safetensors_path(file);
  }
  checkpoint.set_write_seconds(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  if (context.rank == 0) Log(context, absl::StrCat("checkpoint ", checkpoint.path()));
  return checkpoint;
}

}  // namespace tessera::trainer

#include "trainer/checkpointing.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <map>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
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
                            ", tp ", std::max(1, resumed.manifest.layout().tensor_parallel()),
                            ", pp ", std::max(1, resumed.manifest.layout().pipeline_parallel()),
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

}  // namespace tessera::trainer

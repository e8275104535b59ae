// Writes the fuzz targets' seed corpora with the real writers, so the seeds are what Tessera
// produces: make_fuzz_seeds <dir> fills <dir>/<target>/ (tests/fuzz/corpus is the checked-in
// one). Deterministic but for the manifests' create_time. Run it after a format changes, then
// commit the files.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/job_spec_file.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/util/json_util.h"
#include "tessera/v1/trainer.pb.h"
#include "tests/fuzz/fuzz_support.h"
#include "trainer/io/checkpoint.h"
#include "trainer/io/safetensors.h"
#include "trainer/io/shard_file.h"
#include "trainer/data/token_shard.h"

namespace tessera::fuzz {
namespace {

namespace fs = std::filesystem;

void Check(const absl::Status& status) {
  if (!status.ok()) {
    std::fprintf(stderr, "make_fuzz_seeds: %s\n", status.ToString().c_str());
    std::exit(1);
  }
}

std::string ReadText(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

void WriteSeed(const fs::path& dir, const std::string& name, const std::string& bytes) {
  fs::create_directories(dir);
  WriteFileOrDie((dir / name).string(), bytes.data(), bytes.size());
}

// A frame as trainer/report/reporter.cc SocketReporter::Send writes it.
std::string Frame(const v1::TrainerReport& report) {
  std::string frame;
  {
    google::protobuf::io::StringOutputStream stream(&frame);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.WriteVarint32(static_cast<uint32_t>(report.ByteSizeLong()));
    report.SerializeWithCachedSizes(&coded);
  }
  return frame;
}

void JobSpecSeeds(const fs::path& out) {
  const fs::path examples = fs::path(TESSERA_ROOT) / "examples";
  std::map<std::string, std::string> env = {{"TESSERA_DATA_DIR", "/data"}};
  const client::EnvLookup lookup = [&](const std::string& name) -> std::optional<std::string> {
    auto it = env.find(name);
    if (it == env.end()) return std::nullopt;
    return it->second;
  };
  for (const auto& entry : fs::directory_iterator(examples)) {
    if (entry.path().extension() != ".yaml") continue;
    const std::string text = ReadText(entry.path());
    const std::string stem = entry.path().stem().string();
    WriteSeed(out / "job_spec", entry.path().filename().string(), text);
    absl::StatusOr<v1::JobSpec> spec = client::ParseJobSpec(text, lookup);
    Check(spec.status());
    WriteSeed(out / "job_validation", stem + ".pb", spec->SerializeAsString());
    if (stem == "tiny-gpt") {
      std::string json;
      google::protobuf::util::JsonPrintOptions options;
      options.preserve_proto_field_names = true;
      if (!google::protobuf::util::MessageToJsonString(*spec, &json, options).ok()) {
        Check(absl::InternalError("tiny-gpt: MessageToJsonString failed"));
      }
      WriteSeed(out / "job_spec", "tiny-gpt.json", json);
    }
  }
  // The environment expansion forms, and an explicit layout.
  WriteSeed(out / "job_spec", "expansion.yaml",
            "name: ${EMPTY:-expanded}\n"
            "model: {preset: tiny-gpt2}\n"
            "data: {train_shards: [\"${TESSERA_DATA}/t-*.bin\", \"$$HOME\"], seq_len: 64}\n"
            "batch: {global_batch_size: 8, micro_batch_size: 2}\n"
            "parallelism: {layout: {data_parallel: 2, tensor_parallel: 2, zero_stage: 1}}\n"
            "max_steps: 10\n"
            "resources: {gpus: 4}\n"
            "labels: {team: \"ml\", 'quoted': 'true'}\n");
}

void ReportSeeds(const fs::path& out) {
  v1::TrainerReport started;
  started.set_job_id("job-1");
  started.set_attempt(1);
  started.mutable_started()->set_num_parameters(124000000);
  started.mutable_started()->set_device("cpu");
  v1::TrainerReport metrics;
  metrics.set_job_id("job-1");
  metrics.mutable_time()->set_seconds(1700000000);
  metrics.mutable_metrics()->set_step(10);
  metrics.mutable_metrics()->set_loss(3.5);
  metrics.mutable_metrics()->set_tokens_seen(40960);
  v1::TrainerReport heartbeat;
  heartbeat.set_job_id("job-1");
  heartbeat.set_rank(1);
  heartbeat.mutable_heartbeat()->set_step(10);
  heartbeat.mutable_heartbeat()->set_step_seconds(0.25);
  v1::TrainerReport checkpoint;
  checkpoint.set_job_id("job-1");
  checkpoint.mutable_checkpoint()->set_step(100);
  checkpoint.mutable_checkpoint()->set_path("/ckpt/step-00000100");
  checkpoint.mutable_checkpoint()->set_num_shards(2);
  v1::TrainerReport failure;
  failure.set_job_id("job-1");
  failure.set_rank(1);
  failure.mutable_failure()->set_kind(v1::FAILURE_KIND_NAN_LOSS);
  failure.mutable_failure()->set_message("loss is NaN at step 11");
  v1::TrainerReport finished;
  finished.set_job_id("job-1");
  finished.mutable_finished()->set_final_step(200);
  // The first byte picks the reader's block size (report_stream_fuzz.cc).
  WriteSeed(out / "report_stream", "session",
            std::string(1, '\x06') + Frame(started) + Frame(metrics) + Frame(heartbeat) +
                Frame(checkpoint) + Frame(metrics) + Frame(finished));
  WriteSeed(out / "report_stream", "failure",
            std::string(1, '\x3f') + Frame(heartbeat) + Frame(failure));
  WriteSeed(out / "report_stream", "empty-report", std::string(1, '\0') + Frame({}));
}

void TokenShardSeeds(const fs::path& out, const fs::path& scratch) {
  const std::vector<uint32_t> small = {0, 1, 2, 3, 65535, 7, 7, 42};
  const std::vector<uint32_t> wide = {0, 70000, 99999, 5};
  struct Shard {
    const char* name;
    std::vector<uint32_t> tokens;
    uint32_t vocab_size;
  };
  for (const Shard& shard : {Shard{"uint16.bin", small, 65536}, Shard{"uint32.bin", wide, 100000},
                             Shard{"empty.bin", {}, 50257}}) {
    const fs::path path = scratch / shard.name;
    Check(trainer::WriteTokenShard(path.string(), shard.tokens, shard.vocab_size));
    WriteSeed(out / "token_shard", shard.name, ReadText(path));
  }
}

void SafetensorsSeeds(const fs::path& out, const fs::path& scratch) {
  const std::vector<float> w = {1, 2, 3, 4, 5, 6};
  const std::vector<int64_t> steps = {7};
  const std::vector<uint16_t> half = {0x3c00, 0x4000};
  const fs::path plain = scratch / "plain.safetensors";
  Check(trainer::WriteSafetensors(
      plain.string(),
      {{.name = "w", .dtype = "F32", .shape = {2, 3}, .data = w.data(), .nbytes = 24},
       {.name = "step", .dtype = "I64", .shape = {}, .data = steps.data(), .nbytes = 8},
       {.name = "h", .dtype = "BF16", .shape = {2}, .data = half.data(), .nbytes = 4},
       {.name = "none", .dtype = "F16", .shape = {0}, .data = nullptr, .nbytes = 0}},
      {{"format", "pt"}}));
  WriteSeed(out / "safetensors", "plain.safetensors", ReadText(plain));
  Check(WriteFixtureShards(scratch.string()));
  for (int rank = 0; rank < kFixtureWorldSize; ++rank) {
    const std::string name = trainer::SliceShardFileName(rank);
    WriteSeed(out / "safetensors", name, ReadText(scratch / name));
  }
}

void ManifestSeeds(const fs::path& out, const fs::path& scratch) {
  const std::string root = (scratch / "checkpoints").string();
  absl::StatusOr<std::string> staging = trainer::PrepareStaging(root, 100);
  Check(staging.status());
  Check(WriteFixtureShards(*staging));
  v1::CheckpointManifest manifest;
  manifest.set_job_id("job-1");
  absl::StatusOr<v1::CheckpointManifest> committed =
      trainer::CommitCheckpoint(root, 100, manifest, kFixtureWorldSize, /*keep_last=*/0);
  Check(committed.status());
  WriteSeed(out / "checkpoint_manifest", "committed.pb", committed->SerializeAsString());
  // Rank 1's shard left out: verifies, but no shard holds half of each tensor.
  v1::CheckpointManifest partial = *committed;
  partial.mutable_shards()->DeleteSubrange(1, 1);
  WriteSeed(out / "checkpoint_manifest", "one-rank.pb", partial.SerializeAsString());
}

}  // namespace
}  // namespace tessera::fuzz

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <corpus dir, e.g. tests/fuzz/corpus>\n", argv[0]);
    return 2;
  }
  const std::filesystem::path out = argv[1];
  const std::filesystem::path scratch = tessera::fuzz::MakeScratchDir("tessera-fuzz-seeds");
  tessera::fuzz::JobSpecSeeds(out);
  tessera::fuzz::ReportSeeds(out);
  tessera::fuzz::TokenShardSeeds(out, scratch);
  tessera::fuzz::SafetensorsSeeds(out, scratch);
  tessera::fuzz::ManifestSeeds(out, scratch);
  return 0;
}

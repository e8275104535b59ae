// Fuzz target: the checkpoint manifest reader (trainer/io/checkpoint.h VerifyCheckpoint) and what a
// resuming trainer does with the manifest it returns (trainer/io/shard_file.h ShardedCheckpointReader,
// CheckManifestSlices). Inputs are manifest.pb files of a checkpoint directory whose shard files
// are fixed (WriteFixtureShards); the seeds list them with their true sizes and SHA-256, so the
// fuzzer starts from manifests that verify. Ranks other than 0 read the manifest without
// verifying the shards, so every manifest that parses is read from as well.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "tests/fuzz/fuzz_support.h"
#include "tests/fuzz/protobuf_logs.h"
#include "trainer/io/checkpoint.h"

namespace {

const std::string& CheckpointDir() {
  static const std::string* dir = [] {
    auto* dir = new std::string(tessera::fuzz::MakeScratchDir("tessera-fuzz-checkpoint"));
    if (absl::Status status = tessera::fuzz::WriteFixtureShards(*dir); !status.ok()) {
      std::fprintf(stderr, "%s\n", status.ToString().c_str());
      std::abort();
    }
    return dir;
  }();
  return *dir;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  tessera::fuzz::SilenceProtobufLogs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& dir = CheckpointDir();
  tessera::fuzz::WriteFileOrDie(dir + "/" + tessera::trainer::kManifestFileName, data, size);
  absl::StatusOr<tessera::v1::CheckpointManifest> verified =
      tessera::trainer::VerifyCheckpoint(dir);
  tessera::v1::CheckpointManifest manifest;
  if (verified.ok()) {
    manifest = *std::move(verified);
  } else if (!manifest.ParseFromArray(data, static_cast<int>(size))) {
    return 0;
  }
  tessera::fuzz::ReadCheckpointTensors(dir, manifest);
  return 0;
}

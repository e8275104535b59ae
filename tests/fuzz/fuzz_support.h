// Helpers of the fuzz targets whose readers take a path rather than bytes: an in-memory file
// rewritten for each input, a scratch directory, the checkpoint the manifest target's inputs
// describe (shared with make_fuzz_seeds, so the seeds' SHA-256 digests match it), and reads of a
// checkpoint's tensors as a resuming trainer does them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "tessera/v1/checkpoint.pb.h"

namespace tessera::fuzz {

// A memfd reached through /proc/self/fd/<n>: no disk I/O, nothing left behind. Not thread-safe.
class MemoryFile {
 public:
  MemoryFile();
  ~MemoryFile();
  MemoryFile(const MemoryFile&) = delete;
  MemoryFile& operator=(const MemoryFile&) = delete;

  // Replaces the file's contents with `size` bytes at `data`; returns path().
  const std::string& Write(const uint8_t* data, size_t size);
  // "/proc/self/fd/<n>", i.e. file name() in directory dir().
  const std::string& path() const { return path_; }
  std::string dir() const { return "/proc/self/fd"; }
  std::string name() const;

 private:
  int fd_;
  std::string path_;
};

// A new empty directory under $TMPDIR (else /dev/shm, else /tmp), removed with its files at exit.
// Aborts when it cannot be made: a fuzz target without its scratch space has nothing to test.
std::string MakeScratchDir(const char* prefix);

// Writes `size` bytes at `data` to `path`, replacing it; aborts on failure.
void WriteFileOrDie(const std::string& path, const void* data, size_t size);

// The shard files of the checkpoint that the checkpoint_manifest target's inputs describe: two
// ranks' format version 2 shards (rank-00000.safetensors, rank-00001.safetensors) of a tensor
// "model/w" F32 [4, 6], split into column boxes, and "model/b" F32 [6], split into ranges.
// Deterministic: the same bytes on every call.
absl::Status WriteFixtureShards(const std::string& dir);

// The world size of that checkpoint.
inline constexpr int kFixtureWorldSize = 2;

// What a resuming trainer does with a checkpoint (trainer/engine/checkpointing.cc): opens a
// ShardedCheckpointReader on `manifest` and reads every tensor, whole and as a box of its rows
// but the first, then checks the slices as CheckpointManifest commits do (CheckManifestSlices).
// Skips tensors of more than 1 MiB and checkpoints whose slices cover more than a few million
// elements in all: a hostile manifest may describe any size, and the reads cost time per element
// asked for. Aborts when a read succeeds yet leaves bytes of its output unwritten.
void ReadCheckpointTensors(const std::string& dir, const v1::CheckpointManifest& manifest);

}  // namespace tessera::fuzz

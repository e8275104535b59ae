#include "tests/fuzz/fuzz_support.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/fuzz/contract.h"
#include "trainer/io/checkpoint.h"
#include "trainer/io/safetensors.h"
#include "trainer/io/shard_file.h"
#include "trainer/io/tensor_box.h"

namespace tessera::fuzz {
namespace {

[[noreturn]] void Die(const std::string& what) {
  std::perror(what.c_str());
  std::abort();
}

std::vector<std::string>& ScratchDirs() {
  static auto* dirs = new std::vector<std::string>();
  return *dirs;
}

// Bounds of ReadCheckpointTensors' work.
constexpr int64_t kMaxTensorBytes = 1 << 20;
constexpr int64_t kMaxSliceElements = 1 << 22;

// Reads the same elements into a buffer of zeros and one of 0xff bytes: an OK read writes every
// byte, so both must then agree.
void ReadTwice(const trainer::ShardedCheckpointReader& reader, const std::string& name,
               const std::vector<int64_t>& shape, const std::string& dtype,
               const std::vector<int64_t>& box_offset, const std::vector<int64_t>& box_shape,
               int64_t numel) {
  const size_t bytes = static_cast<size_t>(numel) * trainer::SafetensorsDtypeSize(dtype);
  std::vector<unsigned char> zeros(bytes, 0x00), ones(bytes, 0xff);
  const absl::Status first =
      reader.Read(name, shape, dtype, box_offset, box_shape, 0, numel, zeros.data());
  const absl::Status second =
      reader.Read(name, shape, dtype, box_offset, box_shape, 0, numel, ones.data());
  if (first.ok() != second.ok()) ContractBroken(absl::StrCat(name, ": a second read differs"));
  if (first.ok() && zeros != ones) {
    ContractBroken(absl::StrCat(name, ": Read returned OK but left bytes of its output unwritten"));
  }
}

void RemoveScratchDirs() {
  for (const std::string& dir : ScratchDirs()) {
    std::error_code error;
    std::filesystem::remove_all(dir, error);
  }
}

}  // namespace

MemoryFile::MemoryFile() : fd_(memfd_create("tessera-fuzz", MFD_CLOEXEC)) {
  if (fd_ < 0) Die("memfd_create");
  path_ = absl::StrCat(dir(), "/", name());
}

MemoryFile::~MemoryFile() { close(fd_); }

std::string MemoryFile::name() const { return std::to_string(fd_); }

const std::string& MemoryFile::Write(const uint8_t* data, size_t size) {
  if (ftruncate(fd_, 0) != 0) Die("ftruncate");
  size_t written = 0;
  while (written < size) {
    const ssize_t n = pwrite(fd_, data + written, size - written, static_cast<off_t>(written));
    if (n <= 0) Die("pwrite");
    written += static_cast<size_t>(n);
  }
  return path_;
}

std::string MakeScratchDir(const char* prefix) {
  // Memory-backed when possible: on ext4, rewriting a file through O_TRUNC flushes it on close,
  // which would cost more than the reader under test.
  const char* tmp = std::getenv("TMPDIR");
  std::error_code error;
  const std::string parent = tmp != nullptr && *tmp != '\0'                     ? tmp
                             : std::filesystem::is_directory("/dev/shm", error) ? "/dev/shm"
                                                                                : "/tmp";
  std::string pattern = absl::StrCat(parent, "/", prefix, "-XXXXXX");
  if (mkdtemp(pattern.data()) == nullptr) Die(absl::StrCat("mkdtemp ", pattern));
  static std::once_flag registered;
  std::call_once(registered, [] { std::atexit(RemoveScratchDirs); });
  ScratchDirs().push_back(pattern);
  return pattern;
}

void WriteFileOrDie(const std::string& path, const void* data, size_t size) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) Die(absl::StrCat("open ", path));
  const char* bytes = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = write(fd, bytes, size);
    if (n <= 0) Die(absl::StrCat("write ", path));
    bytes += n;
    size -= static_cast<size_t>(n);
  }
  close(fd);
}

absl::Status WriteFixtureShards(const std::string& dir) {
  // model/w [4, 6]: rank r holds columns [3r, 3r + 3) (a row-parallel tensor-parallel weight);
  // model/b [6]: rank r holds elements [3r, 3r + 3) (ZeRO's flat ranges).
  for (int rank = 0; rank < kFixtureWorldSize; ++rank) {
    std::vector<float> w(12), b(3);
    for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(100 * rank + i);
    for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>(-100 * rank - i);
    std::vector<trainer::SliceToWrite> slices = {
        {.name = "model/w",
         .dtype = "F32",
         .global_shape = {4, 6},
         .offset = 0,
         .numel = 12,
         .data = w.data(),
         .box_offset = {0, 3 * rank},
         .box_shape = {4, 3}},
        {.name = "model/b",
         .dtype = "F32",
         .global_shape = {6},
         .offset = 3 * rank,
         .numel = 3,
         .data = b.data()},
    };
    absl::StatusOr<trainer::WrittenShard> written =
        trainer::WriteShardFile(absl::StrCat(dir, "/", trainer::SliceShardFileName(rank)), slices,
                                {{"tessera.rank", std::to_string(rank)}});
    if (!written.ok()) return written.status();
  }
  return absl::OkStatus();
}

void ReadCheckpointTensors(const std::string& dir, const v1::CheckpointManifest& manifest) {
  int64_t elements = 0;
  for (const v1::CheckpointShard& shard : manifest.shards()) {
    for (const v1::TensorSlice& slice : shard.slices()) {
      const std::optional<int64_t> count = trainer::ElementCount(
          std::vector<int64_t>(slice.global_shape().begin(), slice.global_shape().end()));
      if (!count.has_value()) continue;  // the reader refuses such a slice
      if (*count > kMaxSliceElements - elements) return;
      elements += *count;
    }
  }
  absl::StatusOr<trainer::ShardedCheckpointReader> reader =
      trainer::ShardedCheckpointReader::Open(dir, manifest);
  if (!reader.ok()) return;
  for (const std::string& name : reader->TensorNames()) {
    const absl::StatusOr<std::vector<int64_t>> shape = reader->GlobalShape(name);
    const absl::StatusOr<std::string> dtype = reader->Dtype(name);
    if (!shape.ok() || !dtype.ok()) ContractBroken(absl::StrCat(name, ": listed, yet not found"));
    const int64_t numel = *trainer::ElementCount(*shape);
    if (numel > kMaxTensorBytes / static_cast<int64_t>(trainer::SafetensorsDtypeSize(*dtype))) {
      continue;
    }
    ReadTwice(*reader, name, *shape, *dtype, {}, {}, numel);
    // The box of every row but the first, as a tensor-parallel rank asks for its part.
    if (!shape->empty() && (*shape)[0] >= 2) {
      std::vector<int64_t> box_offset(shape->size(), 0);
      std::vector<int64_t> box_shape = *shape;
      box_offset[0] = 1;
      box_shape[0] -= 1;
      ReadTwice(*reader, name, *shape, *dtype, box_offset, box_shape,
                *trainer::ElementCount(box_shape));
    }
  }
  const absl::Status slices = trainer::CheckManifestSlices(manifest);
  if (!slices.ok() && !absl::IsFailedPrecondition(slices)) {
    ContractBroken(absl::StrCat("CheckManifestSlices: ", slices.ToString()));
  }
}

}  // namespace tessera::fuzz

// Fuzz target: the safetensors header reader (trainer/io/safetensors.h) and, on the same bytes, the
// checkpoint shard file reader built on it (trainer/io/shard_file.h); a valid shard file is then read
// through a ShardedCheckpointReader as a one-shard checkpoint. Inputs are whole files, written
// to an in-memory file first (the readers take a path).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/fuzz/contract.h"
#include "tests/fuzz/fuzz_support.h"
#include "trainer/io/safetensors.h"
#include "trainer/io/shard_file.h"
#include "trainer/io/tensor_box.h"

namespace {

using tessera::fuzz::ContractBroken;

// What ReadSafetensorsHeader promises of a header it accepts, checked against the file's bytes.
void CheckHeader(const tessera::trainer::SafetensorsFile& file, const uint8_t* data, size_t size) {
  uint64_t header_size = 0;
  std::memcpy(&header_size, data, sizeof(header_size));  // little-endian, as the format
  if (file.data_offset != 8 + header_size || file.data_offset > size) {
    ContractBroken(absl::StrCat("data_offset ", file.data_offset, " for a header of ", header_size,
                                " bytes in a file of ", size));
  }
  const uint64_t data_size = size - file.data_offset;
  uint64_t covered = 0;
  for (const auto& [name, entry] : file.tensors) {
    const size_t element_size = tessera::trainer::SafetensorsDtypeSize(entry.dtype);
    const std::optional<int64_t> count = tessera::trainer::ElementCount(entry.shape);
    if (element_size == 0 || !count.has_value() || entry.begin > entry.end ||
        entry.end > data_size ||
        entry.end - entry.begin != static_cast<uint64_t>(*count) * element_size) {
      ContractBroken(absl::StrCat("tensor ", name, ": accepted with dtype ", entry.dtype,
                                  " and bytes [", entry.begin, ", ", entry.end, ") of ",
                                  data_size));
    }
    covered += entry.end - entry.begin;
  }
  if (covered != data_size) ContractBroken("tensors do not cover the data section");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static auto* file = new tessera::fuzz::MemoryFile();
  const std::string& path = file->Write(data, size);
  const absl::StatusOr<tessera::trainer::SafetensorsFile> header =
      tessera::trainer::ReadSafetensorsHeader(path);
  if (header.ok()) CheckHeader(*header, data, size);

  absl::StatusOr<std::vector<tessera::v1::TensorSlice>> slices =
      tessera::trainer::ReadShardSlices(path);
  if (!slices.ok()) return 0;
  if (!header.ok()) ContractBroken("ReadShardSlices accepted what ReadSafetensorsHeader refused");
  tessera::v1::CheckpointManifest manifest;
  manifest.set_format_version(2);
  tessera::v1::CheckpointShard& shard = *manifest.add_shards();
  shard.set_file(file->name());
  shard.mutable_slices()->Add(slices->begin(), slices->end());
  tessera::fuzz::ReadCheckpointTensors(file->dir(), manifest);
  return 0;
}

#include "trainer/shard_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/errno_status.h"
#include "common/scoped_fd.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "trainer/checkpoint.h"
#include "trainer/safetensors.h"

namespace tessera::trainer {
namespace {

using Json = nlohmann::json;
using shard_file_internal::TensorIndex;

constexpr char kSafetensorsMetadataKey[] = "__metadata__";
constexpr size_t kHeaderAlignment = 8;
// Largest single pread: Linux transfers at most 0x7ffff000 bytes per call.
constexpr size_t kMaxPreadBytes = size_t{1} << 30;

// Elements of a tensor of `shape` (1 for a 0-dim tensor); nullopt when a
// dimension is negative or the count overflows int64.
std::optional<int64_t> ElementCount(const std::vector<int64_t>& shape) {
  int64_t count = 1;
  for (int64_t dim : shape) {
    if (dim < 0) return std::nullopt;
    if (dim != 0 && count > std::numeric_limits<int64_t>::max() / dim) return std::nullopt;
    count *= dim;
  }
  return count;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

std::vector<int64_t> ShapeOf(const v1::TensorSlice& slice) {
  return {slice.global_shape().begin(), slice.global_shape().end()};
}

// Why a slice is malformed, or empty when it is not.
std::string SliceProblem(const std::string& name, const std::string& dtype,
                         const std::vector<int64_t>& global_shape, int64_t offset, int64_t numel) {
  if (name.empty() || name == kSafetensorsMetadataKey) return "reserved or empty name";
  if (SafetensorsDtypeSize(dtype) == 0) return absl::StrCat("unknown dtype \"", dtype, "\"");
  std::optional<int64_t> total = ElementCount(global_shape);
  if (!total.has_value() || *total > std::numeric_limits<int64_t>::max() /
                                         static_cast<int64_t>(SafetensorsDtypeSize(dtype))) {
    return absl::StrCat("invalid global shape ", ShapeString(global_shape));
  }
  if (offset < 0 || numel < 0 || offset > *total || numel > *total - offset) {
    return absl::StrCat("elements [", offset, ", ", offset, " + ", numel,
                        ") are out of the bounds of its global shape ", ShapeString(global_shape));
  }
  return "";
}

std::string SliceProblem(const v1::TensorSlice& slice) {
  return SliceProblem(slice.name(), slice.dtype(), ShapeOf(slice), slice.offset(), slice.numel());
}

bool SameSlice(const v1::TensorSlice& a, const v1::TensorSlice& b) {
  return a.name() == b.name() && a.dtype() == b.dtype() && a.offset() == b.offset() &&
         a.numel() == b.numel() && ShapeOf(a) == ShapeOf(b);
}

// A shard file's header: its slices sorted by name, and where each one's data
// starts in the file.
struct ShardHeader {
  std::vector<v1::TensorSlice> slices;
  std::map<std::string, uint64_t> data_begin;
};

absl::StatusOr<ShardHeader> ReadShardHeader(const std::string& path) {
  ASSIGN_OR_RETURN(SafetensorsFile file, ReadSafetensorsHeader(path));
  auto table_text = file.metadata.find(kSlicesMetadataKey);
  if (table_text == file.metadata.end()) {
    return absl::DataLossError(absl::StrCat(path, ": no \"", kSlicesMetadataKey,
                                            "\" in __metadata__ (not a checkpoint shard file)"));
  }
  const Json table = Json::parse(table_text->second, nullptr, /*allow_exceptions=*/false);
  if (table.is_discarded() || !table.is_object()) {
    return absl::DataLossError(
        absl::StrCat(path, ": __metadata__ \"", kSlicesMetadataKey, "\" is not a JSON object"));
  }
  ShardHeader header;
  for (const auto& [name, entry] : file.tensors) {
    const std::string what = absl::StrCat(path, ": tensor \"", name, "\"");
    if (entry.shape.size() != 1) {
      return absl::DataLossError(absl::StrCat(what, " is not 1-D"));
    }
    auto info = table.find(name);
    if (info == table.end() || !info->is_object()) {
      return absl::DataLossError(
          absl::StrCat(what, " has no entry in \"", kSlicesMetadataKey, "\""));
    }
    auto shape = info->find("shape");
    auto offset = info->find("offset");
    if (shape == info->end() || !shape->is_array() || offset == info->end() ||
        !offset->is_number_integer()) {
      return absl::DataLossError(
          absl::StrCat(what, ": its slice entry has no \"shape\" array and integer \"offset\""));
    }
    v1::TensorSlice slice;
    slice.set_name(name);
    slice.set_dtype(entry.dtype);
    for (const Json& dim : *shape) {
      if (!dim.is_number_integer()) {
        return absl::DataLossError(absl::StrCat(what, ": its global shape is not integers"));
      }
      slice.add_global_shape(dim.get<int64_t>());
    }
    slice.set_offset(offset->get<int64_t>());
    slice.set_numel(entry.shape[0]);
    if (std::string problem = SliceProblem(slice); !problem.empty()) {
      return absl::DataLossError(absl::StrCat(what, ": ", problem));
    }
    header.data_begin[name] = file.data_offset + entry.begin;
    header.slices.push_back(std::move(slice));
  }
  for (const auto& [name, info] : table.items()) {
    if (file.tensors.count(name) == 0) {
      return absl::DataLossError(absl::StrCat(path, ": \"", kSlicesMetadataKey,
                                              "\" lists tensor \"", name, "\", the file has none"));
    }
  }
  return header;
}

// Indexes the slices of `manifest`'s shards by tensor; errors have `code` and start with `what`.
absl::StatusOr<std::map<std::string, TensorIndex>> IndexSlices(
    const v1::CheckpointManifest& manifest, absl::StatusCode code, const std::string& what) {
  std::map<std::string, TensorIndex> tensors;
  for (int i = 0; i < manifest.shards_size(); ++i) {
    const v1::CheckpointShard& shard = manifest.shards(i);
    for (const v1::TensorSlice& slice : shard.slices()) {
      if (std::string problem = SliceProblem(slice); !problem.empty()) {
        return absl::Status(code, absl::StrCat(what, ": ", shard.file(), ": tensor \"",
                                               slice.name(), "\": ", problem));
      }
      auto [it, inserted] = tensors.try_emplace(slice.name());
      TensorIndex& tensor = it->second;
      if (inserted) {
        tensor.dtype = slice.dtype();
        tensor.global_shape = ShapeOf(slice);
        tensor.numel = *ElementCount(tensor.global_shape);
      } else if (tensor.dtype != slice.dtype() || tensor.global_shape != ShapeOf(slice)) {
        return absl::Status(
            code,
            absl::StrCat(what, ": tensor ", slice.name(), " is ", slice.dtype(), " ",
                         ShapeString(ShapeOf(slice)), " in ", shard.file(), " but ", tensor.dtype,
                         " ", ShapeString(tensor.global_shape), " in another shard"));
      }
      if (slice.numel() > 0) {
        tensor.pieces.push_back({slice.offset(), slice.numel(), static_cast<size_t>(i)});
      }
    }
  }
  for (auto& [name, tensor] : tensors) {
    std::sort(tensor.pieces.begin(), tensor.pieces.end(),
              [](const TensorIndex::Piece& a, const TensorIndex::Piece& b) {
                return a.offset != b.offset ? a.offset < b.offset : a.numel > b.numel;
              });
  }
  return tensors;
}

// pread of exactly `size` bytes at `offset`; DATA_LOSS when the file ends first.
absl::Status PreadExactly(int fd, char* out, size_t size, uint64_t offset,
                          const std::string& path) {
  while (size > 0) {
    const ssize_t n = ::pread(fd, out, std::min(size, kMaxPreadBytes), static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, absl::StrCat(path, ": read"));
    }
    if (n == 0) {
      return absl::DataLossError(absl::StrCat(path, ": truncated: ends at byte ", offset));
    }
    out += n;
    size -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<WrittenShard> WriteShardFile(const std::string& path,
                                            const std::vector<SliceToWrite>& slices,
                                            const std::map<std::string, std::string>& metadata) {
  if (metadata.count(kSlicesMetadataKey) > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": metadata key \"", kSlicesMetadataKey, "\" is reserved"));
  }
  std::set<std::string> names;
  for (const SliceToWrite& slice : slices) {
    const std::string what = absl::StrCat(path, ": tensor \"", slice.name, "\"");
    std::string problem =
        SliceProblem(slice.name, slice.dtype, slice.global_shape, slice.offset, slice.numel);
    if (problem.empty() && !names.insert(slice.name).second) problem = "name repeats";
    if (problem.empty() && slice.numel > 0 && slice.data == nullptr) problem = "null data";
    if (!problem.empty()) return absl::InvalidArgumentError(absl::StrCat(what, ": ", problem));
  }
  // Widest dtype first (stable): with the data section 8-byte aligned, each
  // slice then starts aligned to its element size.
  std::vector<const SliceToWrite*> order;
  for (const SliceToWrite& slice : slices) order.push_back(&slice);
  std::stable_sort(order.begin(), order.end(), [](const SliceToWrite* a, const SliceToWrite* b) {
    return SafetensorsDtypeSize(a->dtype) > SafetensorsDtypeSize(b->dtype);
  });
  Json table = Json::object();
  Json header = Json::object();
  uint64_t data_size = 0;
  for (const SliceToWrite* slice : order) {
    const uint64_t bytes = static_cast<uint64_t>(slice->numel) * SafetensorsDtypeSize(slice->dtype);
    header[slice->name] = {{"dtype", slice->dtype},
                           {"shape", Json::array({slice->numel})},
                           {"data_offsets", Json::array({data_size, data_size + bytes})}};
    table[slice->name] = {{"shape", slice->global_shape}, {"offset", slice->offset}};
    data_size += bytes;
  }
  Json header_metadata(metadata);
  header_metadata[kSlicesMetadataKey] = table.dump();
  header[kSafetensorsMetadataKey] = std::move(header_metadata);
  std::string header_text = header.dump();
  header_text.append((kHeaderAlignment - header_text.size() % kHeaderAlignment) % kHeaderAlignment,
                     ' ');

  char length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<char>((header_text.size() >> (8 * i)) & 0xff);
  // A short write stops the producer; WriteHashedFile then returns the error.
  auto produce = [&](const ByteSink& sink) {
    if (sink(length, sizeof(length)) != sizeof(length)) return;
    if (sink(header_text.data(), header_text.size()) != header_text.size()) return;
    for (const SliceToWrite* slice : order) {
      const size_t bytes = static_cast<size_t>(slice->numel) * SafetensorsDtypeSize(slice->dtype);
      if (bytes > 0 && sink(slice->data, bytes) != bytes) return;
    }
  };
  ASSIGN_OR_RETURN(std::string sha256, WriteHashedFile(path, produce));
  WrittenShard written;
  written.sha256 = std::move(sha256);
  written.size_bytes = static_cast<int64_t>(sizeof(length) + header_text.size() + data_size);
  for (const SliceToWrite& slice : slices) {
    v1::TensorSlice& out = written.slices.emplace_back();
    out.set_name(slice.name);
    out.set_dtype(slice.dtype);
    out.mutable_global_shape()->Add(slice.global_shape.begin(), slice.global_shape.end());
    out.set_offset(slice.offset);
    out.set_numel(slice.numel);
  }
  return written;
}

absl::StatusOr<std::vector<v1::TensorSlice>> ReadShardSlices(const std::string& path) {
  ASSIGN_OR_RETURN(ShardHeader header, ReadShardHeader(path));
  return std::move(header.slices);
}

absl::Status CheckManifestSlices(const v1::CheckpointManifest& manifest) {
  ASSIGN_OR_RETURN(auto tensors,
                   IndexSlices(manifest, absl::StatusCode::kFailedPrecondition, "checkpoint"));
  for (const auto& [name, tensor] : tensors) {
    int64_t covered = 0;
    int64_t hole_end = tensor.numel;
    for (const TensorIndex::Piece& piece : tensor.pieces) {
      if (piece.offset > covered) {
        hole_end = piece.offset;
        break;
      }
      covered = std::max(covered, piece.offset + piece.numel);
    }
    if (covered < tensor.numel) {
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoint tensor ", name, " ", ShapeString(tensor.global_shape),
                       ": no shard holds its elements [", covered, ", ", hole_end, ")"));
    }
  }
  return absl::OkStatus();
}

// A shard file; its header is read, and the file kept open, on first use.
struct ShardedCheckpointReader::Shard {
  std::string path;
  // The slices the manifest says the file holds.
  std::vector<v1::TensorSlice> manifest_slices;

  absl::Mutex mu;
  bool loaded ABSL_GUARDED_BY(mu) = false;
  absl::Status load_status ABSL_GUARDED_BY(mu);
  // Set once by Load, then read-only.
  std::optional<ScopedFd> fd;
  std::map<std::string, uint64_t> data_begin;

  // Reads the header on the first call; afterwards `fd` and `data_begin` are valid when OK.
  absl::Status Load() {
    absl::MutexLock lock(&mu);
    if (loaded) return load_status;
    loaded = true;
    load_status = LoadLocked();
    return load_status;
  }

 private:
  absl::Status LoadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    absl::StatusOr<ShardHeader> header = ReadShardHeader(path);
    if (!header.ok()) {
      if (absl::IsNotFound(header.status())) {
        return absl::DataLossError(absl::StrCat(path, ": missing (listed in the manifest)"));
      }
      return header.status();
    }
    std::vector<v1::TensorSlice> expected = manifest_slices;
    std::sort(
        expected.begin(), expected.end(),
        [](const v1::TensorSlice& a, const v1::TensorSlice& b) { return a.name() < b.name(); });
    const bool same =
        expected.size() == header->slices.size() &&
        std::equal(expected.begin(), expected.end(), header->slices.begin(), SameSlice);
    if (!same) {
      return absl::DataLossError(
          absl::StrCat(path, ": the slices in its header are not those the manifest lists"));
    }
    const int raw_fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (raw_fd < 0) return ErrnoToStatus(errno, path);
    fd.emplace(raw_fd);
    data_begin = std::move(header->data_begin);
    return absl::OkStatus();
  }
};

ShardedCheckpointReader::ShardedCheckpointReader(ShardedCheckpointReader&&) = default;
ShardedCheckpointReader& ShardedCheckpointReader::operator=(ShardedCheckpointReader&&) = default;
ShardedCheckpointReader::~ShardedCheckpointReader() = default;

absl::StatusOr<ShardedCheckpointReader> ShardedCheckpointReader::Open(
    const std::string& dir, const v1::CheckpointManifest& manifest) {
  const std::string manifest_path = absl::StrCat(dir, "/", kManifestFileName);
  if (manifest.format_version() != 2) {
    return absl::FailedPreconditionError(absl::StrCat(manifest_path, ": format_version ",
                                                      manifest.format_version(),
                                                      " holds no tensor slices (version 2 does)"));
  }
  ShardedCheckpointReader reader;
  reader.dir_ = dir;
  ASSIGN_OR_RETURN(reader.tensors_,
                   IndexSlices(manifest, absl::StatusCode::kDataLoss, manifest_path));
  for (const v1::CheckpointShard& shard : manifest.shards()) {
    const std::string& name = shard.file();
    if (name.empty() || name == "." || name == ".." || absl::StrContains(name, '/')) {
      return absl::DataLossError(
          absl::StrCat(manifest_path, ": shard file name \"", name, "\" is not a plain file name"));
    }
    auto& state = reader.shards_.emplace_back(std::make_unique<Shard>());
    state->path = absl::StrCat(dir, "/", name);
    state->manifest_slices.assign(shard.slices().begin(), shard.slices().end());
  }
  return reader;
}

bool ShardedCheckpointReader::Has(const std::string& name) const {
  return tensors_.count(name) > 0;
}

std::vector<std::string> ShardedCheckpointReader::TensorNames() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const auto& [name, tensor] : tensors_) names.push_back(name);
  return names;
}

absl::StatusOr<const ShardedCheckpointReader::Tensor*> ShardedCheckpointReader::Find(
    const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat("checkpoint ", dir_, " has no tensor ", name));
  }
  return &it->second;
}

absl::StatusOr<std::vector<int64_t>> ShardedCheckpointReader::GlobalShape(
    const std::string& name) const {
  ASSIGN_OR_RETURN(const Tensor* tensor, Find(name));
  return tensor->global_shape;
}

absl::StatusOr<std::string> ShardedCheckpointReader::Dtype(const std::string& name) const {
  ASSIGN_OR_RETURN(const Tensor* tensor, Find(name));
  return tensor->dtype;
}

absl::Status ShardedCheckpointReader::Read(const std::string& name,
                                           const std::vector<int64_t>& expected_global_shape,
                                           const std::string& dtype, int64_t offset, int64_t numel,
                                           void* out) const {
  ASSIGN_OR_RETURN(const Tensor* tensor, Find(name));
  if (tensor->global_shape != expected_global_shape) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint tensor ", name, " has shape ", ShapeString(tensor->global_shape),
                     ", this model's is ", ShapeString(expected_global_shape),
                     ": the checkpoint is from another model"));
  }
  if (tensor->dtype != dtype) {
    return absl::FailedPreconditionError(absl::StrCat("checkpoint tensor ", name, " has dtype ",
                                                      tensor->dtype, ", the reader asked for ",
                                                      dtype));
  }
  if (offset < 0 || numel < 0 || offset > tensor->numel || numel > tensor->numel - offset) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint tensor ", name, ": elements [",
                                                   offset, ", ", offset, " + ", numel,
                                                   ") are out of its ", tensor->numel));
  }
  if (numel > 0 && out == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint tensor ", name, ": null output"));
  }
  const size_t element_size = SafetensorsDtypeSize(dtype);
  const int64_t end = offset + numel;
  char* const bytes = static_cast<char*>(out);
  int64_t cursor = offset;
  int64_t hole_end = end;
  for (const TensorIndex::Piece& piece : tensor->pieces) {
    if (cursor >= end) break;
    if (piece.offset > cursor) {
      hole_end = std::min(piece.offset, end);
      break;
    }
    const int64_t piece_end = piece.offset + piece.numel;
    if (piece_end <= cursor) continue;
    Shard& shard = *shards_[piece.shard];
    RETURN_IF_ERROR(shard.Load());
    auto begin = shard.data_begin.find(name);
    if (begin == shard.data_begin.end()) {
      return absl::DataLossError(absl::StrCat(shard.path, ": no tensor ", name));
    }
    const int64_t count = std::min(piece_end, end) - cursor;
    RETURN_IF_ERROR(PreadExactly(shard.fd->get(), bytes + (cursor - offset) * element_size,
                                 static_cast<size_t>(count) * element_size,
                                 begin->second + (cursor - piece.offset) * element_size,
                                 shard.path));
    cursor += count;
  }
  if (cursor < end) {
    return absl::DataLossError(absl::StrCat("checkpoint ", dir_, ": no shard holds elements [",
                                            cursor, ", ", hole_end, ") of tensor ", name,
                                            " (reading [", offset, ", ", end, "))"));
  }
  return absl::OkStatus();
}

}  // namespace tessera::trainer

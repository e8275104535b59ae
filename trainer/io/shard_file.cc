#include "trainer/io/shard_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/errno_status.h"
#include "common/scoped_fd.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "trainer/io/checkpoint.h"
#include "trainer/io/safetensors.h"
#include "trainer/io/tensor_box.h"

namespace tessera::trainer {
namespace {

using Json = nlohmann::json;
using shard_file_internal::TensorIndex;

constexpr char kSafetensorsMetadataKey[] = "__metadata__";
constexpr size_t kHeaderAlignment = 8;
// Largest single pread: Linux transfers at most 0x7ffff000 bytes per call.
constexpr size_t kMaxPreadBytes = size_t{1} << 30;

std::vector<int64_t> ShapeOf(const v1::TensorSlice& slice) {
  return {slice.global_shape().begin(), slice.global_shape().end()};
}
std::vector<int64_t> BoxOffsetOf(const v1::TensorSlice& slice) {
  return {slice.box_offset().begin(), slice.box_offset().end()};
}
std::vector<int64_t> BoxShapeOf(const v1::TensorSlice& slice) {
  return {slice.box_shape().begin(), slice.box_shape().end()};
}

// Why a slice is malformed, or empty when it is not.
std::string SliceProblem(const std::string& name, const std::string& dtype,
                         const std::vector<int64_t>& global_shape,
                         const std::vector<int64_t>& box_offset,
                         const std::vector<int64_t>& box_shape, int64_t offset, int64_t numel) {
  if (name.empty() || name == kSafetensorsMetadataKey) return "reserved or empty name";
  if (SafetensorsDtypeSize(dtype) == 0) return absl::StrCat("unknown dtype \"", dtype, "\"");
  std::optional<int64_t> total = ElementCount(global_shape);
  if (!total.has_value() || *total > std::numeric_limits<int64_t>::max() /
                                         static_cast<int64_t>(SafetensorsDtypeSize(dtype))) {
    return absl::StrCat("invalid global shape ", ShapeString(global_shape));
  }
  if (std::string problem = BoxProblem(global_shape, box_offset, box_shape); !problem.empty()) {
    return problem;
  }
  const bool whole = box_shape.empty();
  const int64_t elements = whole ? *total : *ElementCount(box_shape);
  if (offset < 0 || numel < 0 || offset > elements || numel > elements - offset) {
    return absl::StrCat("elements [", offset, ", ", offset, " + ", numel,
                        ") are out of the bounds of ",
                        whole ? absl::StrCat("its global shape ", ShapeString(global_shape))
                              : absl::StrCat("its box of shape ", ShapeString(box_shape)));
  }
  return "";
}

std::string SliceProblem(const v1::TensorSlice& slice) {
  return SliceProblem(slice.name(), slice.dtype(), ShapeOf(slice), BoxOffsetOf(slice),
                      BoxShapeOf(slice), slice.offset(), slice.numel());
}

bool SameSlice(const v1::TensorSlice& a, const v1::TensorSlice& b) {
  return a.name() == b.name() && a.dtype() == b.dtype() && a.offset() == b.offset() &&
         a.numel() == b.numel() && ShapeOf(a) == ShapeOf(b) && BoxOffsetOf(a) == BoxOffsetOf(b) &&
         BoxShapeOf(a) == BoxShapeOf(b);
}

// The order of ReadShardSlices: by name, box, then range.
bool SliceLess(const v1::TensorSlice& a, const v1::TensorSlice& b) {
  auto key = [](const v1::TensorSlice& slice) {
    return std::make_tuple(std::cref(slice.name()), BoxOffsetOf(slice), BoxShapeOf(slice),
                           slice.offset(), slice.numel());
  };
  return key(a) < key(b);
}

// Positions 0..n-1 of `slices`, in SliceLess order of the slices.
std::vector<size_t> SortedOrder(const std::vector<v1::TensorSlice>& slices) {
  std::vector<size_t> order(slices.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return SliceLess(slices[a], slices[b]); });
  return order;
}

// A shard file's header: its slices in SliceLess order, and where each one's data starts in the
// file (data_begin[i] for slices[i]).
struct ShardHeader {
  std::vector<v1::TensorSlice> slices;
  std::vector<uint64_t> data_begin;
};

// The integers of JSON array `value` into `out`; false when it is not an array of integers.
bool ParseIntegers(const Json& value, std::vector<int64_t>& out) {
  if (!value.is_array()) return false;
  for (const Json& item : value) {
    if (!item.is_number_integer()) return false;
    out.push_back(item.get<int64_t>());
  }
  return true;
}

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
  std::vector<v1::TensorSlice> slices;
  std::vector<uint64_t> data_begin;
  for (const auto& [key, entry] : file.tensors) {
    const std::string what = absl::StrCat(path, ": tensor \"", key, "\"");
    if (entry.shape.size() != 1) {
      return absl::DataLossError(absl::StrCat(what, " is not 1-D"));
    }
    auto info = table.find(key);
    if (info == table.end() || !info->is_object()) {
      return absl::DataLossError(
          absl::StrCat(what, " has no entry in \"", kSlicesMetadataKey, "\""));
    }
    auto shape = info->find("shape");
    auto offset = info->find("offset");
    if (shape == info->end() || offset == info->end() || !offset->is_number_integer()) {
      return absl::DataLossError(
          absl::StrCat(what, ": its slice entry has no \"shape\" array and integer \"offset\""));
    }
    std::vector<int64_t> global_shape, box_offset, box_shape;
    if (!ParseIntegers(*shape, global_shape)) {
      return absl::DataLossError(absl::StrCat(what, ": its global shape is not integers"));
    }
    for (auto [field, out] : {std::pair{"box_offset", &box_offset}, {"box_shape", &box_shape}}) {
      auto value = info->find(field);
      if (value != info->end() && !ParseIntegers(*value, *out)) {
        return absl::DataLossError(absl::StrCat(what, ": its \"", field, "\" is not integers"));
      }
    }
    std::string name = key;
    if (auto real = info->find("name"); real != info->end()) {
      if (!real->is_string()) {
        return absl::DataLossError(absl::StrCat(what, ": its \"name\" is not a string"));
      }
      name = real->get<std::string>();
    }
    v1::TensorSlice& slice = slices.emplace_back();
    slice.set_name(std::move(name));
    slice.set_dtype(entry.dtype);
    slice.mutable_global_shape()->Add(global_shape.begin(), global_shape.end());
    slice.mutable_box_offset()->Add(box_offset.begin(), box_offset.end());
    slice.mutable_box_shape()->Add(box_shape.begin(), box_shape.end());
    slice.set_offset(offset->get<int64_t>());
    slice.set_numel(entry.shape[0]);
    if (std::string problem = SliceProblem(slice); !problem.empty()) {
      return absl::DataLossError(absl::StrCat(what, ": ", problem));
    }
    data_begin.push_back(file.data_offset + entry.begin);
  }
  for (const auto& [key, info] : table.items()) {
    if (file.tensors.count(key) == 0) {
      return absl::DataLossError(absl::StrCat(path, ": \"", kSlicesMetadataKey,
                                              "\" lists tensor \"", key, "\", the file has none"));
    }
  }
  ShardHeader header;
  for (size_t i : SortedOrder(slices)) {
    header.slices.push_back(std::move(slices[i]));
    header.data_begin.push_back(data_begin[i]);
  }
  return header;
}

// Indexes the slices of `manifest`'s shards by tensor; errors have `code` and start with `what`.
absl::StatusOr<std::map<std::string, TensorIndex>> IndexSlices(
    const v1::CheckpointManifest& manifest, absl::StatusCode code, const std::string& what) {
  std::map<std::string, TensorIndex> tensors;
  for (int i = 0; i < manifest.shards_size(); ++i) {
    const v1::CheckpointShard& shard = manifest.shards(i);
    for (int j = 0; j < shard.slices_size(); ++j) {
      const v1::TensorSlice& slice = shard.slices(j);
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
        TensorBox box = MakeBox(tensor.global_shape, BoxOffsetOf(slice), BoxShapeOf(slice));
        tensor.pieces.push_back({.box_offset = std::move(box.offset),
                                 .box_shape = std::move(box.shape),
                                 .offset = slice.offset(),
                                 .numel = slice.numel(),
                                 .shard = static_cast<size_t>(i),
                                 .slice = static_cast<size_t>(j)});
      }
    }
  }
  return tensors;
}

TensorBox BoxOf(const TensorIndex::Piece& piece) { return {piece.box_offset, piece.box_shape}; }

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
  // The first slice of each tensor, which is stored under the tensor's name.
  std::map<std::string, const SliceToWrite*> first_slice;
  for (const SliceToWrite& slice : slices) {
    const std::string what = absl::StrCat(path, ": tensor \"", slice.name, "\"");
    std::string problem =
        SliceProblem(slice.name, slice.dtype, slice.global_shape, slice.box_offset, slice.box_shape,
                     slice.offset, slice.numel);
    if (problem.empty()) {
      auto [first, inserted] = first_slice.try_emplace(slice.name, &slice);
      if (!inserted && (first->second->dtype != slice.dtype ||
                        first->second->global_shape != slice.global_shape)) {
        problem = absl::StrCat("its slices disagree: ", first->second->dtype, " ",
                               ShapeString(first->second->global_shape), " and ", slice.dtype, " ",
                               ShapeString(slice.global_shape));
      }
    }
    if (problem.empty() && slice.numel > 0 && slice.data == nullptr) problem = "null data";
    if (!problem.empty()) return absl::InvalidArgumentError(absl::StrCat(what, ": ", problem));
  }
  // Safetensors keys: the tensor's name for its first slice, "<name>#<k>" for the others (k
  // counting up from 1, skipping keys that another tensor of the file is named).
  std::set<std::string> used_keys;
  for (const auto& [name, slice] : first_slice) used_keys.insert(name);
  std::map<std::string, int> suffix;
  std::vector<std::string> keys(slices.size());
  for (size_t i = 0; i < slices.size(); ++i) {
    const std::string& name = slices[i].name;
    if (first_slice.at(name) == &slices[i]) {
      keys[i] = name;
      continue;
    }
    int& k = suffix[name];
    do {
      keys[i] = absl::StrCat(name, "#", ++k);
    } while (!used_keys.insert(keys[i]).second);
  }
  // Widest dtype first (stable): with the data section 8-byte aligned, each
  // slice then starts aligned to its element size.
  std::vector<size_t> order(slices.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return SafetensorsDtypeSize(slices[a].dtype) > SafetensorsDtypeSize(slices[b].dtype);
  });
  Json table = Json::object();
  Json header = Json::object();
  uint64_t data_size = 0;
  for (size_t i : order) {
    const SliceToWrite& slice = slices[i];
    const uint64_t bytes = static_cast<uint64_t>(slice.numel) * SafetensorsDtypeSize(slice.dtype);
    header[keys[i]] = {{"dtype", slice.dtype},
                       {"shape", Json::array({slice.numel})},
                       {"data_offsets", Json::array({data_size, data_size + bytes})}};
    Json entry = {{"shape", slice.global_shape}, {"offset", slice.offset}};
    if (keys[i] != slice.name) entry["name"] = slice.name;
    if (!slice.box_shape.empty()) {
      entry["box_offset"] = slice.box_offset;
      entry["box_shape"] = slice.box_shape;
    }
    table[keys[i]] = std::move(entry);
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
    for (size_t i : order) {
      const size_t bytes =
          static_cast<size_t>(slices[i].numel) * SafetensorsDtypeSize(slices[i].dtype);
      if (bytes > 0 && sink(slices[i].data, bytes) != bytes) return;
    }
  };
  ASSIGN_OR_RETURN(std::string digest, WriteHashedFile(path, produce));
  WrittenShard written;
  written.xxh3_128 = std::move(digest);
  written.size_bytes = static_cast<int64_t>(sizeof(length) + header_text.size() + data_size);
  for (const SliceToWrite& slice : slices) {
    v1::TensorSlice& out = written.slices.emplace_back();
    out.set_name(slice.name);
    out.set_dtype(slice.dtype);
    out.mutable_global_shape()->Add(slice.global_shape.begin(), slice.global_shape.end());
    out.mutable_box_offset()->Add(slice.box_offset.begin(), slice.box_offset.end());
    out.mutable_box_shape()->Add(slice.box_shape.begin(), slice.box_shape.end());
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
  // Elements [begin, end) of a tensor's flattening, held by a slice of shard `shard`.
  struct Interval {
    int64_t begin;
    int64_t end;
    size_t shard;
  };
  std::vector<Interval> intervals;
  for (const auto& [name, tensor] : tensors) {
    intervals.clear();
    for (const TensorIndex::Piece& piece : tensor.pieces) {
      ForEachRangeRun(tensor.global_shape, BoxOf(piece), piece.offset, piece.offset + piece.numel,
                      [&](int64_t global_index, int64_t, int64_t length) {
                        if (!intervals.empty() && intervals.back().shard == piece.shard &&
                            intervals.back().end == global_index) {
                          intervals.back().end += length;
                        } else {
                          intervals.push_back({global_index, global_index + length, piece.shard});
                        }
                      });
    }
    std::sort(intervals.begin(), intervals.end(), [](const Interval& a, const Interval& b) {
      return a.begin != b.begin ? a.begin < b.begin : a.end > b.end;
    });
    const std::string what =
        absl::StrCat("checkpoint tensor ", name, " ", ShapeString(tensor.global_shape), ": ");
    // Captures the shape, not the structured binding: Clang before 16 cannot capture those.
    auto at = [&shape = tensor.global_shape](int64_t index) {
      return absl::StrCat(" (flat indices; the first at ", ShapeString(CoordinatesOf(shape, index)),
                          ")");
    };
    int64_t covered = 0;
    size_t covered_by = 0;
    for (const Interval& interval : intervals) {
      if (interval.begin > covered) {
        return absl::FailedPreconditionError(absl::StrCat(what, "no shard holds its elements [",
                                                          covered, ", ", interval.begin, ")",
                                                          at(covered)));
      }
      if (interval.begin < covered) {
        return absl::FailedPreconditionError(absl::StrCat(
            what, "its elements [", interval.begin, ", ", std::min(interval.end, covered),
            ") are held by more than one slice (in ", manifest.shards(covered_by).file(), " and ",
            manifest.shards(interval.shard).file(), ")", at(interval.begin)));
      }
      covered = interval.end;
      covered_by = interval.shard;
    }
    if (covered < tensor.numel) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, "no shard holds its elements [", covered, ", ", tensor.numel, ")", at(covered)));
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
  // Where the data of manifest_slices[i] starts in the file.
  std::vector<uint64_t> data_begin;

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
    // Both in SliceLess order: the manifest's k-th slice in that order is the header's k-th.
    const std::vector<size_t> expected = SortedOrder(manifest_slices);
    bool same = expected.size() == header->slices.size();
    for (size_t k = 0; same && k < expected.size(); ++k) {
      same = SameSlice(manifest_slices[expected[k]], header->slices[k]);
    }
    if (!same) {
      return absl::DataLossError(
          absl::StrCat(path, ": the slices in its header are not those the manifest lists"));
    }
    const int raw_fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (raw_fd < 0) return ErrnoToStatus(errno, path);
    fd.emplace(raw_fd);
    data_begin.assign(expected.size(), 0);
    for (size_t k = 0; k < expected.size(); ++k) data_begin[expected[k]] = header->data_begin[k];
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

absl::StatusOr<ShardedCheckpointReader> ShardedCheckpointReader::OpenShardPaths(
    const std::string& dir, const v1::CheckpointManifest& manifest,
    const std::vector<std::string>& shard_paths) {
  if (static_cast<int>(shard_paths.size()) != manifest.shards_size()) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint ", dir, ": ", shard_paths.size(),
                                                   " shard paths for the manifest's ",
                                                   manifest.shards_size(), " shards"));
  }
  ASSIGN_OR_RETURN(ShardedCheckpointReader reader, Open(dir, manifest));
  for (size_t i = 0; i < shard_paths.size(); ++i) reader.shards_[i]->path = shard_paths[i];
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
  return Read(name, expected_global_shape, dtype, {}, {}, offset, numel, out);
}

absl::Status ShardedCheckpointReader::Read(const std::string& name,
                                           const std::vector<int64_t>& expected_global_shape,
                                           const std::string& dtype,
                                           const std::vector<int64_t>& box_offset,
                                           const std::vector<int64_t>& box_shape, int64_t offset,
                                           int64_t numel, void* out) const {
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
  if (std::string problem = BoxProblem(tensor->global_shape, box_offset, box_shape);
      !problem.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint tensor ", name, ": ", problem));
  }
  const TensorBox request = MakeBox(tensor->global_shape, box_offset, box_shape);
  const bool whole = box_shape.empty();
  // " of its box offset [0, 16] shape [96, 16]", or nothing for the whole tensor.
  const std::string of_box = whole ? ""
                                   : absl::StrCat(" of its box offset ", ShapeString(box_offset),
                                                  " shape ", ShapeString(box_shape));
  const int64_t elements = *ElementCount(request.shape);
  if (offset < 0 || numel < 0 || offset > elements || numel > elements - offset) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint tensor ", name, ": elements [", offset, ", ", offset, " + ", numel,
                     ") are out of the ", elements, " elements", of_box));
  }
  if (numel > 0 && out == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint tensor ", name, ": null output"));
  }
  if (numel == 0) return absl::OkStatus();
  const size_t element_size = SafetensorsDtypeSize(dtype);
  const int64_t end = offset + numel;
  char* const bytes = static_cast<char*>(out);
  const TensorBox wanted = RowsHolding(request, offset, end);

  // Elements [begin, end) of the output that were copied, and the copy not yet issued: runs
  // contiguous in both the file and the output are read with one pread.
  std::vector<std::pair<int64_t, int64_t>> copied;
  struct Copy {
    int64_t to = 0;      // element index in the output
    uint64_t from = 0;   // byte offset in the file
    int64_t length = 0;  // elements
  };
  for (const TensorIndex::Piece& piece : tensor->pieces) {
    const TensorBox stored = BoxOf(piece);
    const int64_t stored_end = piece.offset + piece.numel;
    std::optional<TensorBox> common = Intersect(wanted, stored);
    if (common.has_value())
      common = Intersect(*common, RowsHolding(stored, piece.offset, stored_end));
    if (!common.has_value()) continue;
    Shard& shard = *shards_[piece.shard];
    RETURN_IF_ERROR(shard.Load());
    const uint64_t data_begin = shard.data_begin[piece.slice];
    absl::Status status;
    Copy pending;
    auto issue = [&] {
      if (pending.length == 0) return;
      status = PreadExactly(shard.fd->get(), bytes + pending.to * element_size,
                            static_cast<size_t>(pending.length) * element_size, pending.from,
                            shard.path);
      copied.emplace_back(pending.to, pending.to + pending.length);
      pending.length = 0;
    };
    // A run of `common` is contiguous in the tensor, so in the flattening of both boxes too.
    ForEachRun(
        tensor->global_shape, *common, [&](const std::vector<int64_t>& first, int64_t length) {
          const int64_t in_request = FlatIndexIn(request, first);
          const int64_t in_stored = FlatIndexIn(stored, first);
          const int64_t from =
              std::max({int64_t{0}, offset - in_request, piece.offset - in_stored});
          const int64_t to = std::min({length, end - in_request, stored_end - in_stored});
          if (from >= to) return true;
          const Copy copy{.to = in_request + from - offset,
                          .from = data_begin + (in_stored + from - piece.offset) * element_size,
                          .length = to - from};
          if (pending.length > 0 && pending.to + pending.length == copy.to &&
              pending.from + pending.length * element_size == copy.from) {
            pending.length += copy.length;
            return true;
          }
          issue();
          pending = copy;
          return status.ok();
        });
    if (status.ok()) issue();
    RETURN_IF_ERROR(status);
  }

  std::sort(copied.begin(), copied.end());
  int64_t cursor = 0;
  int64_t hole_end = numel;
  for (const auto& [begin, copied_end] : copied) {
    if (begin > cursor) {
      hole_end = begin;
      break;
    }
    cursor = std::max(cursor, copied_end);
  }
  if (cursor < numel) {
    std::vector<int64_t> first = CoordinatesOf(request.shape, offset + cursor);
    for (size_t d = 0; d < first.size(); ++d) first[d] += request.offset[d];
    return absl::DataLossError(
        absl::StrCat("checkpoint ", dir_, ": no shard holds elements [", offset + cursor, ", ",
                     offset + hole_end, ")", of_box, " of tensor ", name, " (reading [", offset,
                     ", ", end, "); the first missing one is at ", ShapeString(first), ")"));
  }
  return absl::OkStatus();
}

}  // namespace tessera::trainer

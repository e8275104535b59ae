#include "trainer/io/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/errno_status.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace tessera::trainer {
namespace {

using Json = nlohmann::json;

constexpr char kMetadataKey[] = "__metadata__";
constexpr size_t kHeaderAlignment = 8;
// Hugging Face's readers refuse headers above 100 MB; so do we, before allocating.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// Number of elements of `shape`; nullopt when a dimension is negative or the
// count overflows.
std::optional<uint64_t> ElementCount(const std::vector<int64_t>& shape) {
  uint64_t count = 1;
  for (int64_t dim : shape) {
    if (dim < 0) return std::nullopt;
    if (dim != 0 && count > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(dim)) {
      return std::nullopt;
    }
    count *= static_cast<uint64_t>(dim);
  }
  return count;
}

// Byte size of a tensor of `dtype` and `shape`; nullopt when unknown or overflowing.
std::optional<uint64_t> TensorBytes(const std::string& dtype, const std::vector<int64_t>& shape) {
  const size_t element_size = SafetensorsDtypeSize(dtype);
  std::optional<uint64_t> count = ElementCount(shape);
  if (element_size == 0 || !count.has_value()) return std::nullopt;
  if (*count > std::numeric_limits<uint64_t>::max() / element_size) return std::nullopt;
  return *count * element_size;
}

void EncodeLittleEndian64(uint64_t value, char out[8]) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((value >> (8 * i)) & 0xff);
}

uint64_t DecodeLittleEndian64(const unsigned char in[8]) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | in[i];
  return value;
}

absl::Status WriteAll(int fd, const void* data, size_t size, const std::string& path) {
  const char* bytes = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::write(fd, bytes, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, absl::StrCat(path, ": write"));
    }
    bytes += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status ReadExactly(int fd, void* data, size_t size, const std::string& path) {
  char* bytes = static_cast<char*>(data);
  while (size > 0) {
    ssize_t n = ::read(fd, bytes, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, absl::StrCat(path, ": read"));
    }
    if (n == 0) return absl::DataLossError(absl::StrCat(path, ": truncated header"));
    bytes += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// Parses one tensor entry of the header into `entry`; false with `why` set when malformed.
bool ParseEntry(const Json& value, SafetensorsEntry& entry, std::string& why) {
  if (!value.is_object()) {
    why = "is not an object";
    return false;
  }
  auto dtype = value.find("dtype");
  auto shape = value.find("shape");
  auto offsets = value.find("data_offsets");
  if (dtype == value.end() || !dtype->is_string()) {
    why = "has no string \"dtype\"";
    return false;
  }
  entry.dtype = dtype->get<std::string>();
  if (SafetensorsDtypeSize(entry.dtype) == 0) {
    why = absl::StrCat("has unknown dtype \"", entry.dtype, "\"");
    return false;
  }
  if (shape == value.end() || !shape->is_array()) {
    why = "has no \"shape\" array";
    return false;
  }
  for (const Json& dim : *shape) {
    if (!dim.is_number_unsigned() ||
        dim.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      why = "has a \"shape\" entry that is not a non-negative integer";
      return false;
    }
    entry.shape.push_back(static_cast<int64_t>(dim.get<uint64_t>()));
  }
  if (offsets == value.end() || !offsets->is_array() || offsets->size() != 2 ||
      !(*offsets)[0].is_number_unsigned() || !(*offsets)[1].is_number_unsigned()) {
    why = "has no \"data_offsets\" pair of non-negative integers";
    return false;
  }
  entry.begin = (*offsets)[0].get<uint64_t>();
  entry.end = (*offsets)[1].get<uint64_t>();
  if (entry.end < entry.begin) {
    why = absl::StrCat("has data_offsets [", entry.begin, ", ", entry.end,
                       "] ending before they begin");
    return false;
  }
  std::optional<uint64_t> bytes = TensorBytes(entry.dtype, entry.shape);
  if (!bytes.has_value() || *bytes != entry.end - entry.begin) {
    why = absl::StrCat("has data_offsets [", entry.begin, ", ", entry.end,
                       "] that do not match its dtype and shape");
    return false;
  }
  return true;
}

}  // namespace

size_t SafetensorsDtypeSize(const std::string& dtype) {
  static const auto* const kSizes = new std::map<std::string, size_t, std::less<>>{
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1}, {"F8_E5M2", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
      {"U32", 4},  {"F32", 4}, {"I64", 8}, {"U64", 8},     {"F64", 8}};
  auto it = kSizes->find(dtype);
  return it == kSizes->end() ? 0 : it->second;
}

namespace {

// What a writer lays out: the padded header text, and the tensors' indices in data order.
struct Layout {
  std::string header_text;
  std::vector<size_t> order;
};

// Validates `tensors` (names, dtypes, shapes; errors name `path` and the tensor) and lays out
// the file: data ordered by element size, widest first (stable, as Hugging Face's writer does),
// so that with the data section 8-byte aligned every tensor starts aligned to its element size
// and readers can map it without copying.
absl::StatusOr<Layout> LayOut(const std::string& path, const std::vector<TensorSpec>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  Json header = Json::object();
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  std::set<std::string> names;
  std::vector<uint64_t> sizes;
  for (const TensorSpec& tensor : tensors) {
    const std::string what = absl::StrCat(path, ": tensor \"", tensor.name, "\"");
    if (tensor.name.empty() || tensor.name == kMetadataKey) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": reserved or empty name"));
    }
    if (!names.insert(tensor.name).second) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": name repeats"));
    }
    if (SafetensorsDtypeSize(tensor.dtype) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": unknown dtype \"", tensor.dtype, "\""));
    }
    std::optional<uint64_t> bytes = TensorBytes(tensor.dtype, tensor.shape);
    if (!bytes.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": invalid shape"));
    }
    sizes.push_back(*bytes);
  }
  Layout layout;
  for (size_t i = 0; i < tensors.size(); ++i) layout.order.push_back(i);
  std::stable_sort(layout.order.begin(), layout.order.end(), [&](size_t a, size_t b) {
    return SafetensorsDtypeSize(tensors[a].dtype) > SafetensorsDtypeSize(tensors[b].dtype);
  });
  uint64_t offset = 0;
  for (size_t i : layout.order) {
    header[tensors[i].name] = {{"dtype", tensors[i].dtype},
                               {"shape", tensors[i].shape},
                               {"data_offsets", {offset, offset + sizes[i]}}};
    offset += sizes[i];
  }
  layout.header_text = header.dump();
  // Pad so that the data section starts 8-byte aligned (8 + header length).
  layout.header_text.append(
      (kHeaderAlignment - layout.header_text.size() % kHeaderAlignment) % kHeaderAlignment, ' ');
  return layout;
}

// Writes the length, the header and, through `write_data(fd, tmp_path)`, the data to
// `path`.tmp, fsyncs it and renames it to `path`; removes it on failure.
absl::Status WriteAtomically(
    const std::string& path, const std::string& header_text,
    const std::function<absl::Status(int, const std::string&)>& write_data) {
  const std::string tmp_path = path + ".tmp";
  int fd = ::open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoToStatus(errno, tmp_path);
  char length[8];
  EncodeLittleEndian64(header_text.size(), length);
  absl::Status status = WriteAll(fd, length, sizeof(length), tmp_path);
  if (status.ok()) status = WriteAll(fd, header_text.data(), header_text.size(), tmp_path);
  if (status.ok()) status = write_data(fd, tmp_path);
  if (status.ok() && ::fsync(fd) != 0) {
    status = ErrnoToStatus(errno, absl::StrCat(tmp_path, ": fsync"));
  }
  if (::close(fd) != 0 && status.ok()) {
    status = ErrnoToStatus(errno, absl::StrCat(tmp_path, ": close"));
  }
  if (status.ok() && ::rename(tmp_path.c_str(), path.c_str()) != 0) {
    status = ErrnoToStatus(errno, absl::StrCat("rename ", tmp_path, " to ", path));
  }
  if (!status.ok()) ::unlink(tmp_path.c_str());
  return status;
}

}  // namespace

absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorView>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  std::vector<TensorSpec> specs;
  for (const TensorView& tensor : tensors)
    specs.push_back({tensor.name, tensor.dtype, tensor.shape});
  ASSIGN_OR_RETURN(Layout layout, LayOut(path, specs, metadata));
  for (const TensorView& tensor : tensors) {
    const std::string what = absl::StrCat(path, ": tensor \"", tensor.name, "\"");
    const uint64_t bytes = *TensorBytes(tensor.dtype, tensor.shape);
    if (bytes != tensor.nbytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": nbytes ", tensor.nbytes, " but shape and ", tensor.dtype, " need ", bytes));
    }
    if (tensor.nbytes > 0 && tensor.data == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": null data"));
    }
  }
  return WriteAtomically(path, layout.header_text, [&](int fd, const std::string& tmp_path) {
    for (size_t i : layout.order) {
      RETURN_IF_ERROR(WriteAll(fd, tensors[i].data, tensors[i].nbytes, tmp_path));
    }
    return absl::OkStatus();
  });
}

absl::Status WriteSafetensorsStreaming(
    const std::string& path, const std::vector<TensorSpec>& tensors,
    const std::map<std::string, std::string>& metadata,
    const std::function<absl::Status(size_t index, void* data)>& fill) {
  ASSIGN_OR_RETURN(Layout layout, LayOut(path, tensors, metadata));
  size_t largest = 0;
  for (const TensorSpec& tensor : tensors) {
    largest = std::max<size_t>(largest, *TensorBytes(tensor.dtype, tensor.shape));
  }
  std::unique_ptr<char[]> buffer(new char[std::max<size_t>(largest, 1)]);
  return WriteAtomically(path, layout.header_text, [&](int fd, const std::string& tmp_path) {
    for (size_t i : layout.order) {
      RETURN_IF_ERROR(fill(i, buffer.get()));
      const size_t bytes = *TensorBytes(tensors[i].dtype, tensors[i].shape);
      RETURN_IF_ERROR(WriteAll(fd, buffer.get(), bytes, tmp_path));
    }
    return absl::OkStatus();
  });
}

absl::StatusOr<SafetensorsFile> ReadSafetensorsHeader(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoToStatus(errno, path);
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};
  const off_t file_size = ::lseek(fd, 0, SEEK_END);
  if (file_size < 0 || ::lseek(fd, 0, SEEK_SET) != 0) {
    return ErrnoToStatus(errno, absl::StrCat(path, ": seek"));
  }
  if (file_size < 8) {
    return absl::DataLossError(
        absl::StrCat(path, ": ", file_size, " bytes, too short for a header"));
  }
  unsigned char length_bytes[8];
  RETURN_IF_ERROR(ReadExactly(fd, length_bytes, sizeof(length_bytes), path));
  const uint64_t header_size = DecodeLittleEndian64(length_bytes);
  if (header_size > kMaxHeaderBytes || header_size > static_cast<uint64_t>(file_size) - 8) {
    return absl::DataLossError(absl::StrCat(path, ": header length ", header_size,
                                            " does not fit the file of ", file_size, " bytes"));
  }
  std::string header_text(header_size, '\0');
  RETURN_IF_ERROR(ReadExactly(fd, header_text.data(), header_text.size(), path));

  Json header = Json::parse(header_text, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) {
    return absl::DataLossError(absl::StrCat(path, ": header is not a JSON object"));
  }
  SafetensorsFile file;
  file.data_offset = 8 + header_size;
  const uint64_t data_size = static_cast<uint64_t>(file_size) - file.data_offset;
  for (const auto& [key, value] : header.items()) {
    if (key == kMetadataKey) {
      if (!value.is_object()) {
        return absl::DataLossError(absl::StrCat(path, ": __metadata__ is not an object"));
      }
      for (const auto& [meta_key, meta_value] : value.items()) {
        if (!meta_value.is_string()) {
          return absl::DataLossError(
              absl::StrCat(path, ": __metadata__ \"", meta_key, "\" is not a string"));
        }
        file.metadata[meta_key] = meta_value.get<std::string>();
      }
      continue;
    }
    SafetensorsEntry entry;
    std::string why;
    if (!ParseEntry(value, entry, why)) {
      return absl::DataLossError(absl::StrCat(path, ": tensor \"", key, "\" ", why));
    }
    file.tensors.emplace(key, std::move(entry));
  }

  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& [name, entry] : file.tensors) ranges.emplace_back(entry.begin, entry.end);
  std::sort(ranges.begin(), ranges.end());
  uint64_t expected_begin = 0;
  for (const auto& [begin, end] : ranges) {
    if (begin != expected_begin) {
      return absl::DataLossError(absl::StrCat(path, ": tensor data is not contiguous at byte ",
                                              expected_begin, " of the data section"));
    }
    expected_begin = end;
  }
  if (expected_begin != data_size) {
    return absl::DataLossError(absl::StrCat(path, ": tensors cover ", expected_begin,
                                            " bytes, the data section holds ", data_size));
  }
  return file;
}

}  // namespace tessera::trainer

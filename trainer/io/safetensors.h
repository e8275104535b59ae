// Export of model weights in the Hugging Face safetensors format, which
// inference stacks (transformers, vLLM, candle) load without Python pickles:
// an 8-byte little-endian header length N, N bytes of JSON
//   {"__metadata__": {"k": "v"}, "<name>": {"dtype": "F32", "shape": [2, 3],
//    "data_offsets": [begin, end]}, ...}
// padded with spaces to a multiple of 8 bytes, then the raw little-endian
// tensor bytes, offsets relative to the start of that data section. Plain
// bytes in and out: the caller hands contiguous CPU tensor memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tessera::trainer {

// One tensor to write: `nbytes` bytes of contiguous little-endian data at `data`.
struct TensorView {
  std::string name;
  // Safetensors dtype: "F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8",
  // "U64", "U32", "U16", "U8", "BOOL", "F8_E4M3", "F8_E5M2".
  std::string dtype;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  size_t nbytes = 0;
};

// A tensor to write whose bytes are produced while writing (WriteSafetensorsStreaming).
struct TensorSpec {
  std::string name;
  // As TensorView::dtype.
  std::string dtype;
  std::vector<int64_t> shape;
};

// Bytes per element of a safetensors dtype; 0 for one this file does not know.
size_t SafetensorsDtypeSize(const std::string& dtype);

// Writes `tensors` and `metadata` to `path` (data ordered by element size,
// widest first, then as given, so each tensor is aligned to its element), by way
// of `path`.tmp renamed into place, so a reader never sees a partial file.
// INVALID_ARGUMENT naming the tensor when its dtype is unknown, its shape has
// a negative dimension, nbytes != product(shape) * dtype size, its name is
// empty or "__metadata__", or a name repeats.
absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorView>& tensors,
                              const std::map<std::string, std::string>& metadata);

// As WriteSafetensors, for tensors too large to hold at once: the file's layout is that
// WriteSafetensors gives tensors of these names, dtypes and shapes, and each tensor's bytes are
// asked for when the writer reaches it: `fill(i, data)` writes the product(shape) * dtype size
// bytes of tensors[i] to `data`, a buffer the size of the largest tensor, reused for every one,
// so memory stays at one tensor. `fill` is called once per tensor, in data order (widest dtype
// first, then as given). When it returns an error, writing stops, `path` is left as it was and
// the error is returned. The same INVALID_ARGUMENT errors as WriteSafetensors, before any call.
absl::Status WriteSafetensorsStreaming(
    const std::string& path, const std::vector<TensorSpec>& tensors,
    const std::map<std::string, std::string>& metadata,
    const std::function<absl::Status(size_t index, void* data)>& fill);

// A tensor as the header describes it; [begin, end) is relative to data_offset.
struct SafetensorsEntry {
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;
};

struct SafetensorsFile {
  std::map<std::string, std::string> metadata;
  std::map<std::string, SafetensorsEntry> tensors;
  // Offset in the file of the data section: 8 + header length.
  uint64_t data_offset = 0;
};

// Reads and validates the header of the safetensors file at `path`: JSON
// well-formed, dtypes known, each tensor's byte range matching its shape, the
// ranges in bounds and together covering the data section without gaps or
// overlaps. NOT_FOUND when the file is missing; DATA_LOSS naming the file
// otherwise.
absl::StatusOr<SafetensorsFile> ReadSafetensorsHeader(const std::string& path);

}  // namespace tessera::trainer

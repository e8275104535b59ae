// Shard files of checkpoint format version 2, which reshard: each rank writes
// one safetensors file holding, for each tensor it owns part of, one slice, a
// contiguous range of the tensor's row-major flattened elements. The slice is
// stored as a 1-D safetensors tensor named after the whole tensor; the
// header's __metadata__ key "tessera.slices" maps each name to the global
// shape and element offset, {"w": {"shape": [96, 32], "offset": 1024}}, so a
// file is still a valid safetensors file. A resuming rank, whatever its data
// parallel degree or ZeRO stage, asks ShardedCheckpointReader for any element
// range of a tensor and gets it assembled from every shard file holding part
// of it. Plain C++ on raw bytes: no LibTorch, so benchmarks and tests use it
// without torch.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tessera/v1/checkpoint.pb.h"

namespace tessera::trainer {

// The __metadata__ key of the slice table; reserved, callers' metadata may not use it.
inline constexpr char kSlicesMetadataKey[] = "tessera.slices";

// One slice to write: elements [offset, offset + numel) of a tensor of
// `global_shape` (empty for a 0-dim tensor), numel * element size contiguous
// little-endian bytes at `data`. Every member has a default initializer, so
// designated initializers may omit any without -Wmissing-field-initializers.
struct SliceToWrite {
  std::string name = {};
  // Safetensors dtype, e.g. "F32", "BF16" (see SafetensorsDtypeSize).
  std::string dtype = {};
  std::vector<int64_t> global_shape = {};
  int64_t offset = 0;
  int64_t numel = 0;
  const void* data = nullptr;
};

struct WrittenShard {
  // Lower-case hex SHA-256 of the file, computed while writing.
  std::string sha256;
  int64_t size_bytes = 0;
  // The slices as the file's header lists them, in the order given.
  std::vector<v1::TensorSlice> slices;
};

// Creates (or truncates) `path` and writes `slices` and `metadata` to it
// through WriteHashedFile, so the SHA-256 needs no read-back (hand it to
// CommitCheckpoint's known_sha256). Data is ordered widest dtype first, so each
// slice is aligned to its element size. No fsync: CommitCheckpoint syncs.
// INVALID_ARGUMENT naming the tensor when its name is empty, "__metadata__" or
// repeats, its dtype is unknown, a dimension, offset or numel is negative,
// offset + numel exceeds the elements of global_shape, or data is null with
// numel > 0; INVALID_ARGUMENT when `metadata` uses kSlicesMetadataKey. I/O
// errors name `path`.
absl::StatusOr<WrittenShard> WriteShardFile(const std::string& path,
                                            const std::vector<SliceToWrite>& slices,
                                            const std::map<std::string, std::string>& metadata);

// The slices of the shard file at `path`, sorted by name, reading only its
// header. NOT_FOUND when the file is missing; DATA_LOSS naming the file when
// the header is not a valid shard file header (not safetensors, a tensor that
// is not 1-D or has no entry in the slice table, a slice out of its tensor's
// bounds, ...).
absl::StatusOr<std::vector<v1::TensorSlice>> ReadShardSlices(const std::string& path);

// OK when, for every tensor named in `manifest`'s shards, the slices agree on
// dtype and global shape and together hold every element. FAILED_PRECONDITION
// naming the tensor (and the first elements no slice holds) otherwise, or
// naming the shard when a slice is malformed. CommitCheckpoint checks this, so
// a rank that failed to write its part is caught when saving, not on resume.
absl::Status CheckManifestSlices(const v1::CheckpointManifest& manifest);

namespace shard_file_internal {

// Where a checkpoint holds a tensor's elements: each piece is elements
// [offset, offset + numel) in the manifest's shard number `shard`.
struct TensorIndex {
  struct Piece {
    int64_t offset;
    int64_t numel;
    size_t shard;
  };
  std::string dtype;
  std::vector<int64_t> global_shape;
  int64_t numel = 0;
  // Sorted by offset.
  std::vector<Piece> pieces;
};

}  // namespace shard_file_internal

// Reads tensors, whole or any element range, from a committed checkpoint of
// format version 2, whatever layout wrote it. The manifest's slice lists say
// which files hold which elements; a file's header is read the first time one
// of its slices is needed, and its data with pread straight into the caller's
// buffer. Thread-safe: Read may be called from several threads at once.
class ShardedCheckpointReader {
 public:
  // `dir` is the checkpoint directory and `manifest` its manifest (as
  // VerifyCheckpoint or FindLatestCheckpoint return it). FAILED_PRECONDITION
  // when the manifest is not of format version 2; DATA_LOSS naming the
  // manifest when its slices are malformed or disagree on a tensor's dtype or
  // shape. Opens no shard file.
  static absl::StatusOr<ShardedCheckpointReader> Open(const std::string& dir,
                                                      const v1::CheckpointManifest& manifest);

  ShardedCheckpointReader(ShardedCheckpointReader&&);
  ShardedCheckpointReader& operator=(ShardedCheckpointReader&&);
  ~ShardedCheckpointReader();

  bool Has(const std::string& name) const;
  // Names of every tensor in the checkpoint, sorted.
  std::vector<std::string> TensorNames() const;
  // NOT_FOUND "checkpoint <dir> has no tensor <name>" for an unknown name.
  absl::StatusOr<std::vector<int64_t>> GlobalShape(const std::string& name) const;
  absl::StatusOr<std::string> Dtype(const std::string& name) const;

  // Fills `out` (numel * element size bytes) with elements [offset, offset +
  // numel) of tensor `name`, assembled from every shard holding part of them.
  // NOT_FOUND for an unknown name; FAILED_PRECONDITION naming the tensor when
  // its global shape is not `expected_global_shape` or its dtype not `dtype`
  // (the checkpoint is from another model); INVALID_ARGUMENT when the range is
  // out of the tensor's bounds; DATA_LOSS naming the tensor and the elements
  // when no shard holds some of them, or naming the file when it is
  // truncated, unreadable or disagrees with the manifest.
  absl::Status Read(const std::string& name, const std::vector<int64_t>& expected_global_shape,
                    const std::string& dtype, int64_t offset, int64_t numel, void* out) const;

 private:
  struct Shard;
  using Tensor = shard_file_internal::TensorIndex;

  ShardedCheckpointReader() = default;
  absl::StatusOr<const Tensor*> Find(const std::string& name) const;

  std::string dir_;
  std::vector<std::unique_ptr<Shard>> shards_;
  std::map<std::string, Tensor> tensors_;
};

}  // namespace tessera::trainer

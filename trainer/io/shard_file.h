// Shard files of checkpoint format version 2, which reshard: each rank writes
// one safetensors file holding, for each tensor it owns part of, one or more
// slices. A slice is a box of the tensor (box_offset[d], box_shape[d] per
// dimension; both empty for the whole tensor) and a contiguous range
// [offset, offset + numel) of that box's row-major flattened elements: data
// parallelism and ZeRO cut ranges of the whole tensor, tensor parallelism cuts
// boxes (a row-parallel [out, in] weight on tp ranks: rank r holds rows
// [0, out) x columns [r * in / tp, (r + 1) * in / tp)), and ZeRO may cut a
// rank's box further into ranges.
//
// Each slice is stored as a 1-D safetensors tensor; the header's __metadata__
// key "tessera.slices" maps each safetensors tensor key to its slice:
//   {"w": {"shape": [96, 32], "offset": 1024},
//    "u": {"shape": [96, 32], "offset": 0, "box_offset": [0, 16], "box_shape": [96, 16]},
//    "u#1": {"name": "u", "shape": [96, 32], "offset": 0, "box_offset": [0, 0],
//            "box_shape": [8, 16]}}
// "box_offset"/"box_shape" appear only for a box (absent: the whole tensor, as
// in files written before boxes existed). A file's first slice of a tensor is
// stored under the tensor's name, so a file with one slice per tensor reads
// as it always did; the second and later slices of that tensor in the same
// file are stored under "<name>#<k>" (k = 1, 2, ..., skipping keys that are
// another tensor's name in the file), and their entry's "name" gives the
// tensor. Readers take the tensor name from "name" when present, else from
// the key; they never parse keys. The file is still a valid safetensors file.
//
// A resuming rank, whatever its data-parallel degree, ZeRO stage or tensor-
// parallel layout, asks ShardedCheckpointReader for any range of any box of a
// tensor and gets it assembled from every shard file holding part of it. Plain
// C++ on raw bytes: no LibTorch, so benchmarks and tests use it without torch.
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

// One slice to write: elements [offset, offset + numel) of the row-major
// flattening of the box (`box_offset`, `box_shape`) of a tensor of
// `global_shape` (empty for a 0-dim tensor), numel * element size contiguous
// little-endian bytes at `data`. Both box vectors empty: the whole tensor.
// Every member has a default initializer, so designated initializers may omit
// any without -Wmissing-field-initializers.
struct SliceToWrite {
  std::string name = {};
  // Safetensors dtype, e.g. "F32", "BF16" (see SafetensorsDtypeSize).
  std::string dtype = {};
  std::vector<int64_t> global_shape = {};
  int64_t offset = 0;
  int64_t numel = 0;
  const void* data = nullptr;
  // Empty, or global_shape's rank each, the box inside the tensor.
  std::vector<int64_t> box_offset = {};
  std::vector<int64_t> box_shape = {};
};

struct WrittenShard {
  // Lower-case hex XXH3-128 of the file, computed while writing.
  std::string xxh3_128;
  int64_t size_bytes = 0;
  // The slices as the file's header lists them, in the order given.
  std::vector<v1::TensorSlice> slices;
};

// Creates (or truncates) `path` and writes `slices` and `metadata` to it
// through WriteHashedFile, so the digest needs no read-back (hand it to
// CommitCheckpoint's known_digests). Data is ordered widest dtype first, so each
// slice is aligned to its element size. No fsync: CommitCheckpoint syncs.
// Several slices may name the same tensor (see the key scheme above); they
// must agree on its dtype and global shape. INVALID_ARGUMENT naming the tensor
// when its name is empty or "__metadata__", its dtype is unknown, a dimension,
// offset or numel is negative, the box does not have global_shape's rank (one
// of box_offset and box_shape empty included) or leaves the tensor's bounds,
// offset + numel exceeds the elements of the box (of global_shape when there
// is none), data is null with numel > 0, or two slices of it disagree on
// dtype or global shape; INVALID_ARGUMENT when `metadata` uses
// kSlicesMetadataKey. Whether slices overlap is CheckManifestSlices' concern.
// I/O errors name `path`.
absl::StatusOr<WrittenShard> WriteShardFile(const std::string& path,
                                            const std::vector<SliceToWrite>& slices,
                                            const std::map<std::string, std::string>& metadata);

// The slices of the shard file at `path`, sorted by name, then box offset,
// box shape, offset and numel, reading only its header. NOT_FOUND when the
// file is missing; DATA_LOSS naming the file when the header is not a valid
// shard file header (not safetensors, a tensor that is not 1-D or has no entry
// in the slice table, a malformed box, a slice out of its box's or tensor's
// bounds, ...).
absl::StatusOr<std::vector<v1::TensorSlice>> ReadShardSlices(const std::string& path);

// OK when, for every tensor named in `manifest`'s shards, the slices agree on
// dtype and global shape and together hold every element exactly once.
// FAILED_PRECONDITION otherwise, naming the tensor and the first elements
// (global row-major flat index and coordinates) that no slice holds or that
// two slices hold, or naming the shard when a slice is malformed.
// CommitCheckpoint checks this, so a rank that failed to write its part, or
// two replicas that both wrote theirs, are caught when saving, not on resume.
// Costs O(R log R) for R runs (a slice's elements contiguous in the tensor's
// flattening: one per slice without a box, up to one per row of its box with
// one), never per element.
absl::Status CheckManifestSlices(const v1::CheckpointManifest& manifest);

namespace shard_file_internal {

// Where a checkpoint holds a tensor's elements: each piece is elements
// [offset, offset + numel) of the box (box_offset, box_shape) held by slice
// number `slice` of the manifest's shard number `shard`.
struct TensorIndex {
  struct Piece {
    // Always global_shape's rank: an empty box in the manifest is stored as
    // the whole tensor.
    std::vector<int64_t> box_offset;
    std::vector<int64_t> box_shape;
    int64_t offset = 0;
    int64_t numel = 0;
    size_t shard = 0;
    size_t slice = 0;
  };
  std::string dtype;
  std::vector<int64_t> global_shape;
  int64_t numel = 0;
  // Non-empty pieces, in manifest order.
  std::vector<Piece> pieces;
};

}  // namespace shard_file_internal

// Reads tensors, whole or any range of any box, from a committed checkpoint of
// format version 2, whatever layout wrote it. The manifest's slice lists say
// which files hold which elements; a file's header is read the first time one
// of its slices is needed, and its data with pread straight into the caller's
// buffer, one pread per run of elements contiguous both in the file and in
// the output (a whole stored slice when the layouts agree), never element by
// element. Thread-safe: Read may be called from several threads at once.
class ShardedCheckpointReader {
 public:
  // `dir` is the checkpoint directory and `manifest` its manifest (as
  // VerifyCheckpoint or FindLatestCheckpoint return it). FAILED_PRECONDITION
  // when the manifest is not of format version 2; DATA_LOSS naming the
  // manifest when its slices are malformed or disagree on a tensor's dtype or
  // shape. Opens no shard file.
  static absl::StatusOr<ShardedCheckpointReader> Open(const std::string& dir,
                                                      const v1::CheckpointManifest& manifest);
  // As Open, but shard i of the manifest is read from `shard_paths[i]` instead of
  // dir/<its file> (a restore from memory: /proc/self/fd/<fd> of the memory file holding it,
  // trainer/io/memory_restore.h); `dir` then only names the checkpoint in messages.
  // INVALID_ARGUMENT when there is not one path per shard.
  static absl::StatusOr<ShardedCheckpointReader> OpenShardPaths(
      const std::string& dir, const v1::CheckpointManifest& manifest,
      const std::vector<std::string>& shard_paths);

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
  // The whole-tensor box of the overload below.
  absl::Status Read(const std::string& name, const std::vector<int64_t>& expected_global_shape,
                    const std::string& dtype, int64_t offset, int64_t numel, void* out) const;

  // Fills `out` (numel * element size bytes) with elements [offset, offset +
  // numel) of the row-major flattening of the box of tensor `name` at
  // `box_offset` of `box_shape` (both empty: the whole tensor), assembled
  // from whichever stored slices, boxes or plain ranges, hold them. Errors as
  // above; INVALID_ARGUMENT also when the box does not have the tensor's rank
  // or leaves its bounds, or the range leaves the box.
  absl::Status Read(const std::string& name, const std::vector<int64_t>& expected_global_shape,
                    const std::string& dtype, const std::vector<int64_t>& box_offset,
                    const std::vector<int64_t>& box_shape, int64_t offset, int64_t numel,
                    void* out) const;

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

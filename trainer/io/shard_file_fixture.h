// What the shard-file tests share: a "model" of whole tensors with distinct bytes, its uneven
// split into ranges over ranks, saving it as one shard file per rank and committing the
// checkpoint, and reading ranges back. Included by shard_file_test.cc and shard_file_box_test.cc.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "trainer/io/checkpoint.h"
#include "trainer/io/safetensors.h"
#include "trainer/io/shard_file.h"

namespace tessera::trainer::shard_file_testing {

// A whole tensor of the "model" and its bytes, distinct for every element.
struct FullTensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::string bytes;

  int64_t numel() const {
    int64_t count = 1;
    for (int64_t dim : shape) count *= dim;
    return count;
  }
  size_t element_size() const { return SafetensorsDtypeSize(dtype); }
};

inline FullTensor MakeTensor(std::string name, std::string dtype, std::vector<int64_t> shape,
                             int seed) {
  FullTensor tensor{std::move(name), std::move(dtype), std::move(shape), ""};
  const size_t size = static_cast<size_t>(tensor.numel()) * tensor.element_size();
  for (size_t i = 0; i < size; ++i) {
    tensor.bytes.push_back(static_cast<char>((i * 131 + seed * 29 + i / 251) & 0xff));
  }
  return tensor;
}

// Several dtypes and shapes, a 0-dim tensor and an odd-sized one included.
inline std::vector<FullTensor> Model() {
  return {MakeTensor("layers.0.attn.qkv.weight", "F32", {96, 32}, 1),
          MakeTensor("layers.0.norm.weight", "BF16", {33}, 2),
          MakeTensor("step_counter", "I64", {}, 3), MakeTensor("embed.weight", "F16", {7, 13}, 4),
          MakeTensor("mask", "U8", {5, 3, 1}, 5)};
}

// Elements [begin[r], begin[r + 1]) of each tensor go to rank r. Boundaries
// are uneven and differ per tensor; a rank may get none of a tensor.
inline std::vector<int64_t> Boundaries(int64_t numel, int ranks, int tensor_index) {
  std::vector<int64_t> begin(ranks + 1, 0);
  begin[ranks] = numel;
  for (int r = 1; r < ranks; ++r) {
    // Weighted: rank r gets roughly r + 1 + tensor_index % 3 parts, rank 1 nothing sometimes.
    int64_t weight_before = 0, weight_all = 0;
    for (int q = 0; q < ranks; ++q) {
      const int64_t weight = (q == 1 && tensor_index % 2 == 0) ? 0 : q + 1 + tensor_index % 3;
      weight_all += weight;
      if (q < r) weight_before += weight;
    }
    begin[r] = numel * weight_before / weight_all;
  }
  return begin;
}

// Plays `ranks` ranks each writing its shard file of `model`, then rank 0 committing step `step`.
inline absl::StatusOr<v1::CheckpointManifest> SaveSharded(const std::string& root, int64_t step,
                                                          const std::vector<FullTensor>& model,
                                                          int ranks) {
  absl::StatusOr<std::string> staging = PrepareStaging(root, step);
  if (!staging.ok()) return staging.status();
  std::map<std::string, std::string> known_digests;
  for (int rank = 0; rank < ranks; ++rank) {
    std::vector<SliceToWrite> slices;
    for (size_t t = 0; t < model.size(); ++t) {
      const FullTensor& tensor = model[t];
      const std::vector<int64_t> begin = Boundaries(tensor.numel(), ranks, static_cast<int>(t));
      const int64_t numel = begin[rank + 1] - begin[rank];
      // A rank holding none of a tensor may list an empty slice of it or leave it out.
      if (numel == 0 && t % 4 == 0) continue;
      slices.push_back({tensor.name, tensor.dtype, tensor.shape, begin[rank], numel,
                        tensor.bytes.data() + begin[rank] * tensor.element_size()});
    }
    const std::string file = SliceShardFileName(rank);
    absl::StatusOr<WrittenShard> written = WriteShardFile(
        *staging + "/" + file, slices, {{"job_id", "job-1"}, {"rank", absl::StrCat(rank)}});
    if (!written.ok()) return written.status();
    known_digests[file] = written->xxh3_128;
  }
  v1::CheckpointManifest manifest;
  manifest.set_job_id("job-1");
  return CommitCheckpoint(root, step, manifest, ranks, /*keep_last=*/0, known_digests);
}

inline std::string ReadRange(const ShardedCheckpointReader& reader, const FullTensor& tensor,
                             int64_t offset, int64_t numel) {
  std::string out(static_cast<size_t>(numel) * tensor.element_size(), '\0');
  absl::Status status =
      reader.Read(tensor.name, tensor.shape, tensor.dtype, offset, numel, out.data());
  EXPECT_THAT(status, ::tessera::testing::IsOk())
      << tensor.name << " [" << offset << ", +" << numel << ")";
  return out;
}

inline std::string Expected(const FullTensor& tensor, int64_t offset, int64_t numel) {
  return tensor.bytes.substr(offset * tensor.element_size(), numel * tensor.element_size());
}

}  // namespace tessera::trainer::shard_file_testing

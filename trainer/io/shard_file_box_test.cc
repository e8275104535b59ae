// Shard files of boxes: slices of a block of a tensor (tensor parallelism), possibly cut into
// ranges over dp. What the manifest and headers record, reads of any box (concurrent ones too)
// against an element-by-element reference, the manifest check's gaps and overlaps, the refusals
// naming the tensor or file, and range-sliced checkpoints read through the box API.
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/util/temp_dir.h"
#include "trainer/io/checkpoint.h"
#include "trainer/io/safetensors.h"
#include "trainer/io/shard_file.h"
#include "trainer/io/shard_file_fixture.h"

namespace tessera::trainer {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::IsOkAndHolds;
using ::tessera::testing::ScopedTempDir;
using ::tessera::testing::StatusIs;
using ::tessera::trainer::shard_file_testing::Expected;
using ::tessera::trainer::shard_file_testing::FullTensor;
using ::tessera::trainer::shard_file_testing::Model;
using ::tessera::trainer::shard_file_testing::ReadRange;
using ::tessera::trainer::shard_file_testing::SaveSharded;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::SizeIs;

// A float32 tensor whose element at flat index i is i, so that values name their position.
FullTensor Iota(std::string name, std::vector<int64_t> shape) {
  FullTensor tensor{std::move(name), "F32", std::move(shape), ""};
  for (int64_t i = 0; i < tensor.numel(); ++i) {
    const float value = static_cast<float>(i);
    tensor.bytes.append(reinterpret_cast<const char*>(&value), sizeof(value));
  }
  return tensor;
}

std::vector<float> Floats(const std::string& bytes) {
  std::vector<float> values(bytes.size() / sizeof(float));
  std::memcpy(values.data(), bytes.data(), values.size() * sizeof(float));
  return values;
}

std::vector<float> Range(int64_t begin, int64_t end) {
  std::vector<float> values;
  for (int64_t i = begin; i < end; ++i) values.push_back(static_cast<float>(i));
  return values;
}

// Elements [offset, offset + numel) of the row-major flattening of a box of `tensor` (the whole
// tensor when both box vectors are empty), gathered element by element: the reference the
// reader's run-by-run copies are checked against.
std::string BoxBytes(const FullTensor& tensor, std::vector<int64_t> box_offset,
                     std::vector<int64_t> box_shape, int64_t offset, int64_t numel) {
  if (box_shape.empty()) {
    box_offset.assign(tensor.shape.size(), 0);
    box_shape = tensor.shape;
  }
  std::string out;
  for (int64_t i = offset; i < offset + numel; ++i) {
    std::vector<int64_t> in_box(box_shape.size());
    int64_t rest = i;
    for (size_t d = box_shape.size(); d-- > 0;) {
      in_box[d] = rest % box_shape[d];
      rest /= box_shape[d];
    }
    int64_t flat = 0;
    for (size_t d = 0; d < box_shape.size(); ++d) {
      flat = flat * tensor.shape[d] + box_offset[d] + in_box[d];
    }
    out += tensor.bytes.substr(flat * tensor.element_size(), tensor.element_size());
  }
  return out;
}

// One slice of a layout: rank `rank` holds elements [offset, offset + numel) of a box of tensor
// `tensor` (an index into the model), or of the whole tensor when the box is empty.
struct BoxSlice {
  int rank;
  size_t tensor;
  std::vector<int64_t> box_offset;
  std::vector<int64_t> box_shape;
  int64_t offset;
  int64_t numel;
};

// Plays `ranks` ranks writing `layout` of `model` (each rank its slices, in the order listed),
// then rank 0 committing step `step`.
absl::StatusOr<v1::CheckpointManifest> SaveBoxes(const std::string& root, int64_t step,
                                                 const std::vector<FullTensor>& model,
                                                 const std::vector<BoxSlice>& layout, int ranks) {
  absl::StatusOr<std::string> staging = PrepareStaging(root, step);
  if (!staging.ok()) return staging.status();
  std::map<std::string, std::string> known_digests;
  for (int rank = 0; rank < ranks; ++rank) {
    std::vector<std::string> data;  // reserved: SliceToWrite points into it
    data.reserve(layout.size());
    std::vector<SliceToWrite> slices;
    for (const BoxSlice& slice : layout) {
      if (slice.rank != rank) continue;
      const FullTensor& tensor = model[slice.tensor];
      data.push_back(
          BoxBytes(tensor, slice.box_offset, slice.box_shape, slice.offset, slice.numel));
      slices.push_back({.name = tensor.name,
                        .dtype = tensor.dtype,
                        .global_shape = tensor.shape,
                        .offset = slice.offset,
                        .numel = slice.numel,
                        .data = data.back().data(),
                        .box_offset = slice.box_offset,
                        .box_shape = slice.box_shape});
    }
    const std::string file = SliceShardFileName(rank);
    absl::StatusOr<WrittenShard> written = WriteShardFile(*staging + "/" + file, slices, {});
    if (!written.ok()) return written.status();
    known_digests[file] = written->xxh3_128;
  }
  v1::CheckpointManifest manifest;
  manifest.set_job_id("job-1");
  return CommitCheckpoint(root, step, manifest, ranks, /*keep_last=*/0, known_digests);
}

// Reads elements [offset, offset + numel) of a box of `tensor` through the box API.
absl::StatusOr<std::string> ReadBox(const ShardedCheckpointReader& reader, const FullTensor& tensor,
                                    const std::vector<int64_t>& box_offset,
                                    const std::vector<int64_t>& box_shape, int64_t offset,
                                    int64_t numel) {
  std::string out(static_cast<size_t>(numel) * tensor.element_size(), '\0');
  absl::Status status = reader.Read(tensor.name, tensor.shape, tensor.dtype, box_offset, box_shape,
                                    offset, numel, out.data());
  if (!status.ok()) return status;
  return out;
}

// Every box of a tensor of `shape`, as (offset, shape) pairs.
std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> EveryBox(
    const std::vector<int64_t>& shape) {
  std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> boxes = {{{}, {}}};
  for (int64_t dim : shape) {
    std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> longer;
    for (const auto& [offset, extent] : boxes) {
      for (int64_t begin = 0; begin < dim; ++begin) {
        for (int64_t end = begin + 1; end <= dim; ++end) {
          auto box = std::make_pair(offset, extent);
          box.first.push_back(begin);
          box.second.push_back(end - begin);
          longer.push_back(std::move(box));
        }
      }
    }
    boxes = std::move(longer);
  }
  return boxes;
}

// Checks reads of every box of `tensor`, whole and in a few ranges, against BoxBytes.
void ExpectEveryBoxReads(const ShardedCheckpointReader& reader, const FullTensor& tensor) {
  for (const auto& [offset, shape] : EveryBox(tensor.shape)) {
    int64_t n = 1;
    for (int64_t dim : shape) n *= dim;
    const std::vector<std::pair<int64_t, int64_t>> ranges = {
        {0, n}, {1, n - 1}, {n / 2, n}, {n - 1, n}};
    for (const auto& [begin, end] : ranges) {
      if (begin > end) continue;
      ASSERT_THAT(ReadBox(reader, tensor, offset, shape, begin, end - begin),
                  IsOkAndHolds(BoxBytes(tensor, offset, shape, begin, end - begin)))
          << tensor.name << " box " << ::testing::PrintToString(offset) << " "
          << ::testing::PrintToString(shape) << " [" << begin << ", " << end << ")";
    }
  }
}

class ShardFileBoxTest : public ::testing::Test {
 protected:
  // tp = 2 x dp = 2: tp rank t holds a column block of w (columns [0, 4) and [4, 10), uneven)
  // and a dim-1 block of x; its two dp ranks (2t, 2t + 1) split that box into ranges. Rank 3
  // lists an empty range of x.
  void SetUp() override {
    absl::StatusOr<v1::CheckpointManifest> manifest =
        SaveBoxes(tmp_.path(), 7, model_, layout_, /*ranks=*/4);
    ASSERT_THAT(manifest, IsOk());
    manifest_ = *manifest;
    dir_ = tmp_.path() + "/" + CheckpointDirName(7);
  }

  ScopedTempDir tmp_{"shard_file_test"};
  const std::vector<FullTensor> model_ = {Iota("w", {6, 10}), Iota("x", {4, 3, 5})};
  const FullTensor& w_ = model_[0];
  const FullTensor& x_ = model_[1];
  const std::vector<BoxSlice> layout_ = {
      {0, 0, {0, 0}, {6, 4}, 0, 11},       {1, 0, {0, 0}, {6, 4}, 11, 13},
      {2, 0, {0, 4}, {6, 6}, 0, 17},       {3, 0, {0, 4}, {6, 6}, 17, 19},
      {0, 1, {0, 0, 0}, {4, 1, 5}, 0, 7},  {1, 1, {0, 0, 0}, {4, 1, 5}, 7, 13},
      {2, 1, {0, 1, 0}, {4, 2, 5}, 0, 40}, {3, 1, {0, 1, 0}, {4, 2, 5}, 40, 0}};
  v1::CheckpointManifest manifest_;
  std::string dir_;
};

TEST_F(ShardFileBoxTest, ManifestAndHeaderRecordTheBoxes) {
  const v1::TensorSlice* stored = nullptr;
  for (const v1::TensorSlice& slice : manifest_.shards(2).slices()) {
    if (slice.name() == "w") stored = &slice;
  }
  ASSERT_NE(stored, nullptr);
  EXPECT_THAT(stored->global_shape(), ::testing::ElementsAre(6, 10));
  EXPECT_THAT(stored->box_offset(), ::testing::ElementsAre(0, 4));
  EXPECT_THAT(stored->box_shape(), ::testing::ElementsAre(6, 6));
  EXPECT_EQ(stored->offset(), 0);
  EXPECT_EQ(stored->numel(), 17);
  absl::StatusOr<SafetensorsFile> header = ReadSafetensorsHeader(dir_ + "/rank-00002.safetensors");
  ASSERT_THAT(header, IsOk());
  const nlohmann::json table = nlohmann::json::parse(header->metadata.at(kSlicesMetadataKey));
  EXPECT_EQ(
      table.at("w"),
      nlohmann::json::parse(R"({"shape":[6,10],"offset":0,"box_offset":[0,4],"box_shape":[6,6]})"));
  EXPECT_THAT(header->tensors.at("w").shape, ::testing::ElementsAre(17));
}

TEST_F(ShardFileBoxTest, ReadsWholeTensorsStoredBoxesAndAnyBox) {
  absl::StatusOr<ShardedCheckpointReader> reader = ShardedCheckpointReader::Open(dir_, manifest_);
  ASSERT_THAT(reader, IsOk());
  // Whole, through the range API.
  EXPECT_EQ(Floats(ReadRange(*reader, w_, 0, 60)), Range(0, 60));
  EXPECT_EQ(Floats(ReadRange(*reader, x_, 0, 60)), Range(0, 60));
  EXPECT_EQ(Floats(ReadRange(*reader, w_, 13, 20)), Range(13, 33));
  // Rank 2's box, held by ranks 2 and 3: rows r, columns 4..9.
  absl::StatusOr<std::string> box = ReadBox(*reader, w_, {0, 4}, {6, 6}, 0, 36);
  ASSERT_THAT(box, IsOk());
  std::vector<float> expected;
  for (int r = 0; r < 6; ++r) {
    for (int c = 4; c < 10; ++c) expected.push_back(10 * r + c);
  }
  EXPECT_EQ(Floats(*box), expected);
  // A box across both stored boxes, and a range of it across rows: elements 3..7 of rows 1..2 x
  // columns 2..6 are (1, 5), (1, 6), (2, 2), (2, 3), (2, 4).
  box = ReadBox(*reader, w_, {1, 2}, {2, 5}, 3, 5);
  ASSERT_THAT(box, IsOk());
  EXPECT_EQ(Floats(*box), (std::vector<float>{15, 16, 22, 23, 24}));
  // x[1:3, 0:3, 2:4], across both of its boxes: (i, j, k) holds 15i + 5j + k.
  box = ReadBox(*reader, x_, {1, 0, 2}, {2, 3, 2}, 0, 12);
  ASSERT_THAT(box, IsOk());
  EXPECT_EQ(Floats(*box), (std::vector<float>{17, 18, 22, 23, 27, 28, 32, 33, 37, 38, 42, 43}));
  // Every box, whole and in ranges.
  ExpectEveryBoxReads(*reader, w_);
  ExpectEveryBoxReads(*reader, x_);
}

TEST_F(ShardFileBoxTest, ConcurrentBoxReads) {
  absl::StatusOr<ShardedCheckpointReader> reader = ShardedCheckpointReader::Open(dir_, manifest_);
  ASSERT_THAT(reader, IsOk());
  // A new layout, tp = 3 over w's columns: what each new rank reads on its own thread.
  std::vector<absl::StatusOr<std::string>> got(3, std::string());
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      got[r] = ReadBox(*reader, w_, {0, r * 10 / 3}, {6, (r + 1) * 10 / 3 - r * 10 / 3}, 0,
                       6 * ((r + 1) * 10 / 3 - r * 10 / 3));
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int r = 0; r < 3; ++r) {
    const int64_t columns = (r + 1) * 10 / 3 - r * 10 / 3;
    EXPECT_THAT(got[r], IsOkAndHolds(BoxBytes(w_, {0, r * 10 / 3}, {6, columns}, 0, 6 * columns)))
        << "rank " << r;
  }
}

TEST_F(ShardFileBoxTest, BadBoxRequestsAndMissingElements) {
  absl::StatusOr<ShardedCheckpointReader> reader = ShardedCheckpointReader::Open(dir_, manifest_);
  ASSERT_THAT(reader, IsOk());
  EXPECT_THAT(ReadBox(*reader, w_, {0}, {6}, 0, 6),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("checkpoint tensor w"), HasSubstr("rank"))));
  EXPECT_THAT(ReadBox(*reader, w_, {0, 6}, {6, 5}, 0, 30),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("checkpoint tensor w"), HasSubstr("out of the bounds"))));
  EXPECT_THAT(ReadBox(*reader, w_, {0, 0}, {2, 2}, 2, 3),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("checkpoint tensor w"), HasSubstr("out of the 4"))));
  // A manifest that lost rank 1's range [11, 24) of box columns [0, 4).
  v1::CheckpointManifest holed = manifest_;
  auto* slices = holed.mutable_shards(1)->mutable_slices();
  slices->erase(std::remove_if(slices->begin(), slices->end(),
                               [](const v1::TensorSlice& slice) { return slice.name() == "w"; }),
                slices->end());
  absl::StatusOr<ShardedCheckpointReader> holed_reader = ShardedCheckpointReader::Open(dir_, holed);
  ASSERT_THAT(holed_reader, IsOk());
  // Box-flat element 11 of that box is (2, 3).
  EXPECT_THAT(ReadBox(*holed_reader, w_, {0, 0}, {6, 4}, 0, 24),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr("no shard holds elements [11, 24) of its box offset "
                                       "[0, 0] shape [6, 4] of tensor w"),
                             HasSubstr("at [2, 3]"))));
  EXPECT_THAT(
      CheckManifestSlices(holed),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               AllOf(HasSubstr("tensor w [6, 10]"),
                     HasSubstr("no shard holds its elements [23, 24)"), HasSubstr("at [2, 3]"))));
}

TEST(ShardFileTest, SeveralSlicesOfOneTensorInOneFile) {
  ScopedTempDir tmp("shard_file_test");
  // A fused qkv weight on tp = 2: each rank holds its rows of q, k and v, three boxes in one file.
  // Rank 0 also holds a tensor actually named "qkv#1", which the extra slices' keys must avoid.
  const std::vector<FullTensor> model = {Iota("qkv", {12, 4}), Iota("qkv#1", {3})};
  std::vector<BoxSlice> layout;
  for (int rank = 0; rank < 2; ++rank) {
    for (int block = 0; block < 3; ++block) {
      layout.push_back({rank, 0, {4 * block + 2 * rank, 0}, {2, 4}, 0, 8});
    }
  }
  layout.push_back({0, 1, {}, {}, 0, 3});
  absl::StatusOr<v1::CheckpointManifest> manifest =
      SaveBoxes(tmp.path(), 1, model, layout, /*ranks=*/2);
  ASSERT_THAT(manifest, IsOk());
  const std::string dir = tmp.path() + "/" + CheckpointDirName(1);

  // The header: the first slice under the name, the others under "qkv#2", "qkv#3" naming it.
  absl::StatusOr<SafetensorsFile> header = ReadSafetensorsHeader(dir + "/rank-00000.safetensors");
  ASSERT_THAT(header, IsOk());
  std::vector<std::string> keys;
  for (const auto& [key, entry] : header->tensors) keys.push_back(key);
  EXPECT_THAT(keys, ::testing::ElementsAre("qkv", "qkv#1", "qkv#2", "qkv#3"));
  const nlohmann::json table = nlohmann::json::parse(header->metadata.at(kSlicesMetadataKey));
  EXPECT_EQ(
      table.at("qkv"),
      nlohmann::json::parse(R"({"shape":[12,4],"offset":0,"box_offset":[0,0],"box_shape":[2,4]})"));
  EXPECT_EQ(
      table.at("qkv#2"),
      nlohmann::json::parse(
          R"({"name":"qkv","shape":[12,4],"offset":0,"box_offset":[4,0],"box_shape":[2,4]})"));
  EXPECT_EQ(table.at("qkv#3").at("box_offset"), nlohmann::json::parse("[8,0]"));
  EXPECT_EQ(table.at("qkv#1"), nlohmann::json::parse(R"({"shape":[3],"offset":0})"));
  // Read back, the slices carry the tensor's name; the manifest lists the same.
  absl::StatusOr<std::vector<v1::TensorSlice>> slices =
      ReadShardSlices(dir + "/rank-00000.safetensors");
  ASSERT_THAT(slices, IsOk());
  ASSERT_THAT(*slices, SizeIs(4));
  for (int block = 0; block < 3; ++block) {
    EXPECT_EQ((*slices)[block].name(), "qkv");
    EXPECT_THAT((*slices)[block].box_offset(), ::testing::ElementsAre(4 * block, 0));
  }
  EXPECT_EQ((*slices)[3].name(), "qkv#1");
  EXPECT_THAT((*slices)[3].box_shape(), ::testing::IsEmpty());
  ASSERT_EQ(manifest->shards(0).slices_size(), 4);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(manifest->shards(0).slices(i).SerializeAsString(), (*slices)[i].SerializeAsString());
  }

  absl::StatusOr<ShardedCheckpointReader> reader = ShardedCheckpointReader::Open(dir, *manifest);
  ASSERT_THAT(reader, IsOk());
  EXPECT_EQ(reader->TensorNames(), (std::vector<std::string>{"qkv", "qkv#1"}));
  EXPECT_EQ(Floats(ReadRange(*reader, model[0], 0, 48)), Range(0, 48));
  EXPECT_EQ(Floats(ReadRange(*reader, model[1], 0, 3)), Range(0, 3));
  // Rows 3..8, columns 1..2: four stored boxes in two files.
  absl::StatusOr<std::string> box = ReadBox(*reader, model[0], {3, 1}, {6, 2}, 0, 12);
  ASSERT_THAT(box, IsOk());
  EXPECT_EQ(Floats(*box), (std::vector<float>{13, 14, 17, 18, 21, 22, 25, 26, 29, 30, 33, 34}));
  ExpectEveryBoxReads(*reader, model[0]);
}

v1::TensorSlice Slice(const std::string& name, std::vector<int64_t> shape,
                      std::vector<int64_t> box_offset, std::vector<int64_t> box_shape,
                      int64_t offset, int64_t numel) {
  v1::TensorSlice slice;
  slice.set_name(name);
  slice.set_dtype("F32");
  slice.mutable_global_shape()->Add(shape.begin(), shape.end());
  slice.mutable_box_offset()->Add(box_offset.begin(), box_offset.end());
  slice.mutable_box_shape()->Add(box_shape.begin(), box_shape.end());
  slice.set_offset(offset);
  slice.set_numel(numel);
  return slice;
}

v1::CheckpointManifest ManifestOf(const std::vector<std::vector<v1::TensorSlice>>& shards) {
  v1::CheckpointManifest manifest;
  manifest.set_format_version(2);
  for (size_t rank = 0; rank < shards.size(); ++rank) {
    v1::CheckpointShard* shard = manifest.add_shards();
    shard->set_rank(static_cast<int>(rank));
    shard->set_file(SliceShardFileName(static_cast<int>(rank)));
    for (const v1::TensorSlice& slice : shards[rank]) *shard->add_slices() = slice;
  }
  return manifest;
}

TEST(ShardFileTest, CheckManifestSlicesFindsGapsAndOverlapsOfBoxes) {
  // w [4, 6]: columns [0, 3) in shard 0; columns [3, 6) split into ranges by shards 1 and 2.
  const std::vector<int64_t> shape = {4, 6};
  auto left = Slice("w", shape, {0, 0}, {4, 3}, 0, 12);
  EXPECT_THAT(CheckManifestSlices(ManifestOf({{left},
                                              {Slice("w", shape, {0, 3}, {4, 3}, 0, 5)},
                                              {Slice("w", shape, {0, 3}, {4, 3}, 5, 7)}})),
              IsOk());
  // The right box's last element, (3, 5), is missing.
  EXPECT_THAT(
      CheckManifestSlices(ManifestOf({{left},
                                      {Slice("w", shape, {0, 3}, {4, 3}, 0, 5)},
                                      {Slice("w", shape, {0, 3}, {4, 3}, 5, 6)}})),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               AllOf(HasSubstr("checkpoint tensor w [4, 6]"),
                     HasSubstr("no shard holds its elements [23, 24)"), HasSubstr("at [3, 5]"))));
  // Element 4 of the right box, (1, 4), is missing.
  EXPECT_THAT(
      CheckManifestSlices(ManifestOf({{left},
                                      {Slice("w", shape, {0, 3}, {4, 3}, 0, 4)},
                                      {Slice("w", shape, {0, 3}, {4, 3}, 5, 7)}})),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               AllOf(HasSubstr("no shard holds its elements [10, 11)"), HasSubstr("at [1, 4]"))));
  // Column 3 held by both boxes: the first duplicate is (0, 3).
  EXPECT_THAT(CheckManifestSlices(ManifestOf({{Slice("w", shape, {0, 0}, {4, 4}, 0, 16)},
                                              {Slice("w", shape, {0, 3}, {4, 3}, 0, 12)}})),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("checkpoint tensor w [4, 6]"),
                             HasSubstr("its elements [3, 4) are held by more than one slice (in "
                                       "rank-00000.safetensors and rank-00001.safetensors)"),
                             HasSubstr("at [0, 3]"))));
  // A plain range of the whole tensor and a one-element box inside it, in one file.
  EXPECT_THAT(CheckManifestSlices(ManifestOf(
                  {{Slice("w", shape, {}, {}, 0, 24), Slice("w", shape, {2, 2}, {1, 1}, 0, 1)}})),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("its elements [14, 15) are held by more than one slice"),
                             HasSubstr("at [2, 2]"))));
  // Plain ranges overlapping, as two dp replicas that both wrote theirs would.
  EXPECT_THAT(CheckManifestSlices(ManifestOf(
                  {{Slice("w", shape, {}, {}, 0, 24)}, {Slice("w", shape, {}, {}, 0, 24)}})),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("its elements [0, 24) are held by more than one slice")));
  // A malformed box names the shard.
  EXPECT_THAT(CheckManifestSlices(ManifestOf({{Slice("w", shape, {0, 4}, {4, 3}, 0, 12)}})),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("rank-00000.safetensors"), HasSubstr("out of the bounds"))));
}

TEST(ShardFileTest, WriteRejectsInvalidBoxesNamingTheTensor) {
  ScopedTempDir tmp("shard_file_test");
  const std::string path = tmp.path() + "/rank-00000.safetensors";
  const std::vector<float> data(24);
  auto write = [&](std::vector<int64_t> box_offset, std::vector<int64_t> box_shape, int64_t offset,
                   int64_t numel) {
    return WriteShardFile(path,
                          {{.name = "w",
                            .dtype = "F32",
                            .global_shape = {4, 6},
                            .offset = offset,
                            .numel = numel,
                            .data = data.data(),
                            .box_offset = std::move(box_offset),
                            .box_shape = std::move(box_shape)}},
                          {})
        .status();
  };
  EXPECT_THAT(write({0, 3}, {4, 3}, 0, 12), IsOk());
  EXPECT_THAT(write({0}, {4}, 0, 4),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("\"w\""),
                             HasSubstr("does not have the rank of its global shape [4, 6]"))));
  EXPECT_THAT(write({0, 3}, {}, 0, 4),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("\"w\""), HasSubstr("does not have the rank"))));
  EXPECT_THAT(write({0, 4}, {4, 3}, 0, 12),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("\"w\""), HasSubstr("box offset [0, 4] shape [4, 3] is out "
                                                           "of the bounds"))));
  EXPECT_THAT(write({-1, 0}, {2, 2}, 0, 4),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"w\"")));
  EXPECT_THAT(write({0, 0}, {2, 3}, 2, 5),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("\"w\""), HasSubstr("elements [2, 2 + 5) are out of the "
                                                           "bounds of its box of shape [2, 3]"))));
}

TEST(ShardFileTest, ReadShardSlicesRefusesABadBoxNamingTheFile) {
  ScopedTempDir tmp("shard_file_test");
  const std::string path = tmp.path() + "/rank-00000.safetensors";
  const std::vector<float> data(8);
  ASSERT_THAT(WriteSafetensors(path, {{"w", "F32", {8}, data.data(), 32}},
                               {{kSlicesMetadataKey,
                                 R"({"w": {"shape": [4, 4], "offset": 0, "box_offset": [0, 3],
                                           "box_shape": [4, 2]}})"}}),
              IsOk());
  EXPECT_THAT(ReadShardSlices(path),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr(path), HasSubstr("out of the bounds"))));
  ASSERT_THAT(WriteSafetensors(path, {{"w", "F32", {8}, data.data(), 32}},
                               {{kSlicesMetadataKey,
                                 R"({"w": {"shape": [4, 4], "offset": 0, "box_offset": [0, "x"],
                                           "box_shape": [4, 2]}})"}}),
              IsOk());
  EXPECT_THAT(ReadShardSlices(path),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr(path), HasSubstr("\"box_offset\" is not integers"))));
}

TEST(ShardFileTest, RangeSlicedCheckpointsReadThroughTheBoxApi) {
  ScopedTempDir tmp("shard_file_test");
  const std::vector<FullTensor> model = Model();
  absl::StatusOr<v1::CheckpointManifest> committed = SaveSharded(tmp.path(), 2, model, 3);
  ASSERT_THAT(committed, IsOk());
  for (const v1::CheckpointShard& shard : committed->shards()) {
    for (const v1::TensorSlice& slice : shard.slices()) {
      EXPECT_THAT(slice.box_offset(), ::testing::IsEmpty()) << slice.name();
    }
  }
  absl::StatusOr<ShardedCheckpointReader> reader =
      ShardedCheckpointReader::Open(tmp.path() + "/" + CheckpointDirName(2), *committed);
  ASSERT_THAT(reader, IsOk());
  const FullTensor& qkv = model[0];
  // A tp rank's column block [96, 8] at column 16, and the half of it a ZeRO rank would read.
  EXPECT_THAT(ReadBox(*reader, qkv, {0, 16}, {96, 8}, 0, 768),
              IsOkAndHolds(BoxBytes(qkv, {0, 16}, {96, 8}, 0, 768)));
  EXPECT_THAT(ReadBox(*reader, qkv, {0, 16}, {96, 8}, 384, 384),
              IsOkAndHolds(BoxBytes(qkv, {0, 16}, {96, 8}, 384, 384)));
  EXPECT_THAT(ReadBox(*reader, qkv, {40, 3}, {17, 29}, 5, 400),
              IsOkAndHolds(BoxBytes(qkv, {40, 3}, {17, 29}, 5, 400)));
  // The whole-tensor box given explicitly reads as the range API does.
  EXPECT_THAT(ReadBox(*reader, qkv, {0, 0}, {96, 32}, 100, 2000),
              IsOkAndHolds(Expected(qkv, 100, 2000)));
  // Every box of the small tensors: F16, U8 3-D, BF16 1-D.
  ExpectEveryBoxReads(*reader, model[3]);
  ExpectEveryBoxReads(*reader, model[4]);
  ExpectEveryBoxReads(*reader, model[1]);
  // A 0-dim tensor has one box, the whole of it.
  EXPECT_THAT(ReadBox(*reader, model[2], {}, {}, 0, 1), IsOkAndHolds(model[2].bytes));
}

}  // namespace
}  // namespace tessera::trainer

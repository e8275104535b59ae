// Shard files of whole-tensor ranges (ZeRO's flat shards): the round trip through any number of
// ranks, what a committed manifest records, the writer's refusals, and the sharded reader's
// errors, each naming the tensor, range or file at fault. The boxes of tensor parallelism are in
// shard_file_box_test.cc.
#include "trainer/io/shard_file.h"

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/read_file.h"
#include "common/sealed_memory.h"
#include "common/status_matchers.h"
#include "common/xxh3.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/temp_dir.h"
#include "trainer/io/checkpoint.h"
#include "trainer/io/safetensors.h"
#include "trainer/io/shard_file_fixture.h"

namespace tessera::trainer {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::IsOkAndHolds;
using ::tessera::testing::ScopedTempDir;
using ::tessera::testing::StatusIs;
using ::tessera::trainer::shard_file_testing::Boundaries;
using ::tessera::trainer::shard_file_testing::Expected;
using ::tessera::trainer::shard_file_testing::FullTensor;
using ::tessera::trainer::shard_file_testing::MakeTensor;
using ::tessera::trainer::shard_file_testing::Model;
using ::tessera::trainer::shard_file_testing::ReadRange;
using ::tessera::trainer::shard_file_testing::SaveSharded;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::SizeIs;

class ShardFileRoundTripTest : public ::testing::TestWithParam<int> {};

TEST_P(ShardFileRoundTripTest, ReadsEveryTensorWholeAndInRanges) {
  const int ranks = GetParam();
  ScopedTempDir tmp("shard_file_test");
  const std::vector<FullTensor> model = Model();
  absl::StatusOr<v1::CheckpointManifest> committed = SaveSharded(tmp.path(), 10, model, ranks);
  ASSERT_THAT(committed, IsOk());
  EXPECT_EQ(committed->format_version(), 2);
  ASSERT_EQ(committed->shards_size(), ranks);

  // Resume as a job would: find, verify, open.
  absl::StatusOr<std::optional<FoundCheckpoint>> found = FindLatestCheckpoint(tmp.path(), nullptr);
  ASSERT_THAT(found, IsOk());
  ASSERT_TRUE(found->has_value());
  EXPECT_EQ((*found)->manifest.format_version(), 2);
  absl::StatusOr<ShardedCheckpointReader> reader =
      ShardedCheckpointReader::Open((*found)->path, (*found)->manifest);
  ASSERT_THAT(reader, IsOk());

  std::vector<std::string> names;
  for (const FullTensor& tensor : model) names.push_back(tensor.name);
  std::sort(names.begin(), names.end());
  EXPECT_EQ(reader->TensorNames(), names);
  for (const FullTensor& tensor : model) {
    SCOPED_TRACE(tensor.name);
    EXPECT_TRUE(reader->Has(tensor.name));
    EXPECT_THAT(reader->GlobalShape(tensor.name), IsOkAndHolds(tensor.shape));
    EXPECT_THAT(reader->Dtype(tensor.name), IsOkAndHolds(tensor.dtype));
    const int64_t n = tensor.numel();
    EXPECT_EQ(ReadRange(*reader, tensor, 0, n), tensor.bytes);
    // Every sub-range of small tensors; a spread of ranges of large ones,
    // crossing the writers' boundaries, as another layout would ask.
    const int64_t stride = n <= 40 ? 1 : 97;
    for (int64_t begin = 0; begin < n; begin += stride) {
      for (int64_t end = begin; end <= n; end += (n <= 40 ? 1 : 211)) {
        ASSERT_EQ(ReadRange(*reader, tensor, begin, end - begin),
                  Expected(tensor, begin, end - begin))
            << "[" << begin << ", " << end << ")";
      }
    }
    // Resharding to dp=3: what each new rank reads, on its own thread, equals the original bytes.
    const std::vector<int64_t> resume = Boundaries(n, 3, 1);
    std::vector<std::string> got(3);
    std::vector<std::thread> threads;
    for (int r = 0; r < 3; ++r) {
      threads.emplace_back(
          [&, r] { got[r] = ReadRange(*reader, tensor, resume[r], resume[r + 1] - resume[r]); });
    }
    for (std::thread& thread : threads) thread.join();
    for (int r = 0; r < 3; ++r) {
      EXPECT_EQ(got[r], Expected(tensor, resume[r], resume[r + 1] - resume[r])) << "rank " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, ShardFileRoundTripTest, ::testing::Values(1, 2, 3, 4));

TEST(ShardFileTest, CommitFillsSlicesFromHeaders) {
  ScopedTempDir tmp("shard_file_test");
  const std::vector<FullTensor> model = Model();
  absl::StatusOr<v1::CheckpointManifest> manifest = SaveSharded(tmp.path(), 3, model, 2);
  ASSERT_THAT(manifest, IsOk());
  EXPECT_EQ(manifest->format_version(), kCheckpointFormatVersion);
  const std::string dir = tmp.path() + "/" + CheckpointDirName(3);
  for (const v1::CheckpointShard& shard : manifest->shards()) {
    EXPECT_EQ(shard.file(), SliceShardFileName(shard.rank()));
    // The manifest lists what the header holds, and the SHA-256 from writing is the file's.
    absl::StatusOr<std::vector<v1::TensorSlice>> slices = ReadShardSlices(dir + "/" + shard.file());
    ASSERT_THAT(slices, IsOk());
    ASSERT_EQ(static_cast<int>(slices->size()), shard.slices_size());
    for (size_t i = 0; i < slices->size(); ++i) {
      EXPECT_EQ((*slices)[i].SerializeAsString(), shard.slices(i).SerializeAsString());
    }
    EXPECT_THAT(Xxh3File(dir + "/" + shard.file()), IsOkAndHolds(shard.xxh3_128()));
  }
  // Rank 1 holds elements [13, 33) of the norm weight (Boundaries(33, 2, 1): weights 2 and 3)
  // and none of qkv (tensor 0: rank 1's weight is 0), which it leaves out.
  const v1::TensorSlice* norm = nullptr;
  for (const v1::TensorSlice& slice : manifest->shards(1).slices()) {
    EXPECT_NE(slice.name(), "layers.0.attn.qkv.weight");
    if (slice.name() == "layers.0.norm.weight") norm = &slice;
  }
  ASSERT_NE(norm, nullptr);
  EXPECT_EQ(norm->dtype(), "BF16");
  EXPECT_THAT(norm->global_shape(), ::testing::ElementsAre(33));
  EXPECT_EQ(norm->offset(), 13);
  EXPECT_EQ(norm->numel(), 20);
  // The file is a plain safetensors file: its metadata are there for any reader.
  absl::StatusOr<SafetensorsFile> header = ReadSafetensorsHeader(dir + "/rank-00001.safetensors");
  ASSERT_THAT(header, IsOk());
  EXPECT_EQ(header->metadata.at("rank"), "1");
  EXPECT_EQ(header->metadata.at("job_id"), "job-1");
  EXPECT_THAT(header->tensors.at("layers.0.norm.weight").shape, ::testing::ElementsAre(20));
}

TEST(ShardFileTest, WrittenSizeAndHashMatchTheFile) {
  ScopedTempDir tmp("shard_file_test");
  const FullTensor tensor = MakeTensor("w", "F32", {10, 10}, 7);
  const std::string path = tmp.path() + "/rank-00000.safetensors";
  absl::StatusOr<WrittenShard> written =
      WriteShardFile(path, {{"w", "F32", {10, 10}, 30, 50, tensor.bytes.data() + 30 * 4}}, {});
  ASSERT_THAT(written, IsOk());
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  EXPECT_EQ(static_cast<int64_t>(in.tellg()), written->size_bytes);
  EXPECT_THAT(Xxh3File(path), IsOkAndHolds(written->xxh3_128));
  ASSERT_EQ(written->slices.size(), 1u);
  EXPECT_EQ(written->slices[0].offset(), 30);
  EXPECT_EQ(written->slices[0].numel(), 50);
}

TEST(ShardFileTest, WriteRejectsInvalidSlicesNamingTheTensor) {
  ScopedTempDir tmp("shard_file_test");
  const std::string path = tmp.path() + "/rank-00000.safetensors";
  const std::vector<float> data(16);
  auto write = [&](std::vector<SliceToWrite> slices) {
    return WriteShardFile(path, slices, {}).status();
  };
  EXPECT_THAT(write({{"w", "F32", {4, 4}, 10, 7, data.data()}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("\"w\""), HasSubstr("out of the bounds"))));
  EXPECT_THAT(write({{"w", "F31", {4}, 0, 4, data.data()}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown dtype \"F31\"")));
  EXPECT_THAT(write({{"w", "F32", {4}, 0, 2, data.data()}, {"w", "F32", {5}, 2, 2, data.data()}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"w\": its slices disagree: F32 [4] and F32 [5]")));
  EXPECT_THAT(write({{"w", "F32", {4}, 0, 2, data.data()}, {"w", "I32", {4}, 2, 2, data.data()}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"w\": its slices disagree: F32 [4] and I32 [4]")));
  EXPECT_THAT(write({{"w", "F32", {4}, -1, 2, data.data()}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"w\"")));
  EXPECT_THAT(write({{"w", "F32", {4}, 0, 2, nullptr}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"w\": null data")));
  EXPECT_THAT(WriteShardFile(path, {}, {{kSlicesMetadataKey, "x"}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("reserved")));
}

class ShardedReaderErrorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<v1::CheckpointManifest> manifest = SaveSharded(tmp_.path(), 5, model_, 3);
    ASSERT_THAT(manifest, IsOk());
    manifest_ = *manifest;
    dir_ = tmp_.path() + "/" + CheckpointDirName(5);
  }

  ScopedTempDir tmp_{"shard_file_test"};
  std::vector<FullTensor> model_ = Model();
  v1::CheckpointManifest manifest_;
  std::string dir_;
};

// A restore from memory: the shards are sealed memory files (as the worker's shard cache hands
// them over), read through their /proc/self/fd paths, with the checkpoint directory only named.
TEST_F(ShardedReaderErrorsTest, ReadsShardsFromTheirOwnPaths) {
  std::vector<SealedMemory> memory;
  std::vector<std::string> paths;
  for (const v1::CheckpointShard& shard : manifest_.shards()) {
    absl::StatusOr<std::string> bytes = ReadWholeFile(dir_ + "/" + shard.file());
    ASSERT_THAT(bytes, IsOk());
    absl::StatusOr<SealedMemory> sealed = SealedMemory::Copy("shard", *bytes);
    ASSERT_THAT(sealed, IsOk());
    paths.push_back(sealed->ProcPath());
    memory.push_back(*std::move(sealed));
  }
  // The files on storage are gone: every byte must come from memory.
  std::filesystem::remove_all(dir_);
  absl::StatusOr<ShardedCheckpointReader> reader =
      ShardedCheckpointReader::OpenShardPaths(dir_, manifest_, paths);
  ASSERT_THAT(reader, IsOk());
  for (const FullTensor& tensor : model_) {
    EXPECT_EQ(ReadRange(*reader, tensor, 0, tensor.numel()), tensor.bytes) << tensor.name;
  }
  paths.pop_back();
  EXPECT_THAT(ShardedCheckpointReader::OpenShardPaths(dir_, manifest_, paths),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2 shard paths")));
}

TEST_F(ShardedReaderErrorsTest, ShapeMismatchNamesTheTensor) {
  absl::StatusOr<ShardedCheckpointReader> reader = ShardedCheckpointReader::Open(dir_, manifest_);
  ASSERT_THAT(reader, IsOk());
  std::vector<float> out(48 * 32);
  EXPECT_THAT(
      reader->Read("layers.0.attn.qkv.weight", {48, 32}, "F32", 0, 48 * 32, out.data()),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               HasSubstr("checkpoint tensor layers.0.attn.qkv.weight has shape [96, 32], "
                         "this model's is [48, 32]: the checkpoint is from another model")));
  EXPECT_THAT(reader->Read("layers.0.attn.qkv.weight", {96, 32}, "BF16", 0, 10, out.data()),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("layers.0.attn.qkv.weight"), HasSubstr("dtype F32"))));
  EXPECT_THAT(reader->Read("layers.0.attn.qkv.weight", {96, 32}, "F32", 3000, 100, out.data()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layers.0.attn.qkv.weight")));
}

TEST_F(ShardedReaderErrorsTest, MissingTensorIsNotFoundNamingIt) {
  absl::StatusOr<ShardedCheckpointReader> reader = ShardedCheckpointReader::Open(dir_, manifest_);
  ASSERT_THAT(reader, IsOk());
  EXPECT_FALSE(reader->Has("layers.1.mlp.weight"));
  const std::string message =
      absl::StrCat("checkpoint ", dir_, " has no tensor layers.1.mlp.weight");
  EXPECT_THAT(reader->GlobalShape("layers.1.mlp.weight"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr(message)));
  float out[4];
  EXPECT_THAT(reader->Read("layers.1.mlp.weight", {4}, "F32", 0, 4, out),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr(message)));
}

TEST_F(ShardedReaderErrorsTest, HoleInCoverageIsDataLossNamingTheRange) {
  // A manifest that lost rank 1's slice of the norm weight (tensor 1), elements [7, 18).
  const FullTensor& norm = model_[1];
  const std::vector<int64_t> begin = Boundaries(norm.numel(), 3, 1);
  ASSERT_EQ(begin[1], 7);
  ASSERT_EQ(begin[2], 18);
  v1::CheckpointManifest holed = manifest_;
  auto* slices = holed.mutable_shards(1)->mutable_slices();
  const int before = slices->size();
  slices->erase(
      std::remove_if(slices->begin(), slices->end(),
                     [&](const v1::TensorSlice& slice) { return slice.name() == norm.name; }),
      slices->end());
  ASSERT_EQ(slices->size(), before - 1);
  absl::StatusOr<ShardedCheckpointReader> reader = ShardedCheckpointReader::Open(dir_, holed);
  ASSERT_THAT(reader, IsOk());
  std::string out(norm.bytes.size(), '\0');
  EXPECT_THAT(reader->Read(norm.name, norm.shape, norm.dtype, 0, norm.numel(), out.data()),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr(norm.name),
                             HasSubstr(absl::StrCat("[", begin[1], ", ", begin[2], ")")))));
  // Ranges that avoid the hole still read.
  EXPECT_EQ(ReadRange(*reader, norm, 0, begin[1]), Expected(norm, 0, begin[1]));
  EXPECT_EQ(ReadRange(*reader, norm, begin[2], norm.numel() - begin[2]),
            Expected(norm, begin[2], norm.numel() - begin[2]));
  // And CommitCheckpoint refuses to write such a checkpoint in the first place.
  EXPECT_THAT(CheckManifestSlices(holed),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr(norm.name), HasSubstr("[7, 18)"))));
  EXPECT_THAT(CheckManifestSlices(manifest_), IsOk());
  // Rank 1's file still holds the slice the manifest lost: reading from it is refused.
  const FullTensor& embed = model_[3];
  EXPECT_THAT(reader->Read(embed.name, embed.shape, embed.dtype, 0, embed.numel(), out.data()),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr(SliceShardFileName(1)), HasSubstr("manifest"))));
}

TEST_F(ShardedReaderErrorsTest, CorruptedHeaderIsDataLossNamingTheFile) {
  const std::string path = dir_ + "/" + SliceShardFileName(2);
  {
    std::fstream file(path, std::ios::binary | std::ios::in | std::ios::out);
    file.seekp(9);  // Inside the JSON header.
    file.write("\x01\x02", 2);
  }
  EXPECT_THAT(ReadShardSlices(path), StatusIs(absl::StatusCode::kDataLoss, HasSubstr(path)));
  absl::StatusOr<ShardedCheckpointReader> reader = ShardedCheckpointReader::Open(dir_, manifest_);
  ASSERT_THAT(reader, IsOk());  // Opens no file.
  const FullTensor& qkv = model_[0];
  std::string out(qkv.bytes.size(), '\0');
  EXPECT_THAT(reader->Read(qkv.name, qkv.shape, qkv.dtype, 0, qkv.numel(), out.data()),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr(path)));
  // The manifest's hash catches it too: the checkpoint is skipped when resuming.
  std::vector<std::string> skipped;
  absl::StatusOr<std::optional<FoundCheckpoint>> found =
      FindLatestCheckpoint(tmp_.path(), &skipped);
  ASSERT_THAT(found, IsOk());
  EXPECT_FALSE(found->has_value());
  ASSERT_THAT(skipped, SizeIs(1));
  EXPECT_THAT(skipped[0], HasSubstr(SliceShardFileName(2)));
}

TEST_F(ShardedReaderErrorsTest, CommitRejectsAMalformedShardHeader) {
  const std::string staging = *PrepareStaging(tmp_.path(), 6);
  const std::string bad = staging + "/" + SliceShardFileName(0);
  std::ofstream(bad, std::ios::binary) << std::string("\x04\0\0\0\0\0\0\0{}  ", 12);
  ASSERT_THAT(WriteSafetensors(staging + "/" + SliceShardFileName(1), {}, {}), IsOk());
  EXPECT_THAT(CommitCheckpoint(tmp_.path(), 6, v1::CheckpointManifest(), 2, 0),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr(bad)));
}

TEST_F(ShardedReaderErrorsTest, OpenRefusesLibTorchCheckpoints) {
  v1::CheckpointManifest old = manifest_;
  old.set_format_version(1);
  EXPECT_THAT(ShardedCheckpointReader::Open(dir_, old),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("format_version 1")));
}

TEST_F(ShardedReaderErrorsTest, OpenRefusesSlicesThatDisagreeOnShape) {
  v1::CheckpointManifest bad = manifest_;
  for (v1::TensorSlice& slice : *bad.mutable_shards(2)->mutable_slices()) {
    if (slice.name() == "embed.weight") slice.set_global_shape(0, 8);
  }
  EXPECT_THAT(ShardedCheckpointReader::Open(dir_, bad),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("embed.weight")));
}

}  // namespace
}  // namespace tessera::trainer

#include "trainer/data/token_shard.h"

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/temp_dir.h"

namespace tessera::trainer {
namespace {

namespace fs = std::filesystem;
using ::tessera::testing::IsOk;
using ::tessera::testing::StatusIs;
using ::tessera::testing::TestDir;
using ::testing::HasSubstr;

// A fresh directory for the running test.
std::vector<uint32_t> Ramp(size_t n, uint32_t vocab_size, uint32_t stride) {
  std::vector<uint32_t> tokens(n);
  for (size_t i = 0; i < n; ++i) tokens[i] = static_cast<uint32_t>((i * stride) % vocab_size);
  return tokens;
}

void ExpectRoundTrip(uint32_t vocab_size, uint32_t expected_token_bytes) {
  const std::string path = TestDir() + "/shard.bin";
  const std::vector<uint32_t> tokens = Ramp(5000, vocab_size, 7919);
  ASSERT_THAT(WriteTokenShard(path, tokens, vocab_size), IsOk());
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  EXPECT_EQ(fs::file_size(path), 64 + tokens.size() * expected_token_bytes);

  absl::StatusOr<TokenShard> shard = TokenShard::Open(path);
  ASSERT_THAT(shard, IsOk());
  EXPECT_EQ(shard->path(), path);
  EXPECT_EQ(shard->size(), tokens.size());
  EXPECT_EQ(shard->vocab_size(), vocab_size);
  EXPECT_EQ(shard->token_bytes(), expected_token_bytes);
  for (size_t i = 0; i < tokens.size(); ++i) ASSERT_EQ(shard->token(i), tokens[i]) << i;

  std::vector<int64_t> widened(100, -1);
  shard->Read(4321, widened.size(), widened.data());
  for (size_t i = 0; i < widened.size(); ++i) EXPECT_EQ(widened[i], tokens[4321 + i]) << i;
}

TEST(TokenShardTest, RoundTripsUint16Tokens) { ExpectRoundTrip(65536, 2); }

TEST(TokenShardTest, RoundTripsUint32Tokens) { ExpectRoundTrip(65537, 4); }

TEST(TokenShardTest, HeaderIsLittleEndianWithTheDocumentedLayout) {
  const std::string path = TestDir() + "/shard.bin";
  ASSERT_THAT(WriteTokenShard(path, std::vector<uint32_t>{1, 2, 0x1234}, 50000), IsOk());
  std::ifstream in(path, std::ios::binary);
  std::vector<unsigned char> bytes((std::istreambuf_iterator<char>(in)),
                                   std::istreambuf_iterator<char>());
  ASSERT_EQ(bytes.size(), 70u);
  EXPECT_EQ(std::string(bytes.begin(), bytes.begin() + 8), "TSRSHRD1");
  EXPECT_EQ(bytes[8], 1);      // version
  EXPECT_EQ(bytes[12], 2);     // token_bytes
  EXPECT_EQ(bytes[16], 3);     // num_tokens
  EXPECT_EQ(bytes[24], 0x50);  // vocab_size 50000 = 0xc350
  EXPECT_EQ(bytes[25], 0xc3);
  for (size_t i = 28; i < 64; ++i) EXPECT_EQ(bytes[i], 0) << i;
  EXPECT_EQ(bytes[68], 0x34);
  EXPECT_EQ(bytes[69], 0x12);
}

TEST(TokenShardTest, EmptyShardOpens) {
  const std::string path = TestDir() + "/empty.bin";
  ASSERT_THAT(WriteTokenShard(path, {}, 257), IsOk());
  absl::StatusOr<TokenShard> shard = TokenShard::Open(path);
  ASSERT_THAT(shard, IsOk());
  EXPECT_EQ(shard->size(), 0u);
}

TEST(TokenShardTest, TruncatedShardIsDataLoss) {
  const std::string path = TestDir() + "/truncated.bin";
  ASSERT_THAT(WriteTokenShard(path, Ramp(1000, 257, 1), 257), IsOk());
  ASSERT_EQ(truncate(path.c_str(), 1500), 0);
  EXPECT_THAT(TokenShard::Open(path),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr(absl::StrCat(path,
                                              ": truncated: header says 1000 tokens (2064 "
                                              "bytes) but the file has 1500 bytes"))));
}

TEST(TokenShardTest, FileShorterThanHeaderIsDataLoss) {
  const std::string path = TestDir() + "/tiny.bin";
  ASSERT_THAT(WriteTokenShard(path, Ramp(10, 257, 1), 257), IsOk());
  ASSERT_EQ(truncate(path.c_str(), 20), 0);
  EXPECT_THAT(TokenShard::Open(path),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr(path + ": truncated")));
}

TEST(TokenShardTest, BadMagicIsDataLoss) {
  const std::string path = TestDir() + "/bad_magic.bin";
  ASSERT_THAT(WriteTokenShard(path, Ramp(10, 257, 1), 257), IsOk());
  {
    std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
    file.write("NOTASHRD", 8);
  }
  EXPECT_THAT(TokenShard::Open(path),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr(path + ": not a token shard")));
}

TEST(TokenShardTest, UnknownVersionIsDataLoss) {
  const std::string path = TestDir() + "/version.bin";
  ASSERT_THAT(WriteTokenShard(path, Ramp(10, 257, 1), 257), IsOk());
  {
    std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(8);
    file.put(3);
  }
  EXPECT_THAT(TokenShard::Open(path),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr(path + ": unsupported")));
}

// A version-1 file written byte by byte as older builds did: still opens, with every token counted.
TEST(TokenShardTest, VersionOneShardStillOpensWithEveryTokenCounted) {
  const std::string path = TestDir() + "/v1.bin";
  {
    std::ofstream out(path, std::ios::binary);
    char header[64] = {'T', 'S', 'R', 'S', 'H', 'R', 'D', '1', 1, 0, 0, 0, 2, 0, 0, 0, 3};
    header[24] = 1;  // vocab_size 257 (0x101)
    header[25] = 1;
    out.write(header, sizeof(header));
    const uint16_t tokens[3] = {5, 256, 7};
    out.write(reinterpret_cast<const char*>(tokens), sizeof(tokens));
  }
  absl::StatusOr<TokenShard> shard = TokenShard::Open(path);
  ASSERT_THAT(shard, IsOk());
  EXPECT_EQ(shard->version(), 1u);
  EXPECT_EQ(shard->vocab_size(), 257u);
  EXPECT_FALSE(shard->has_loss_mask());
  EXPECT_EQ(shard->sample_tokens(), 0u);
  EXPECT_EQ(shard->token(1), 256u);
  std::vector<uint8_t> mask(3, 7);
  shard->ReadLossMask(0, 3, mask.data());
  EXPECT_EQ(mask, (std::vector<uint8_t>{1, 1, 1}));
}

TEST(TokenShardTest, PlainWriteStaysVersionOne) {
  const std::string path = TestDir() + "/plain.bin";
  ASSERT_THAT(WriteTokenShard(path, Ramp(10, 257, 1), 257), IsOk());
  absl::StatusOr<TokenShard> shard = TokenShard::Open(path);
  ASSERT_THAT(shard, IsOk());
  EXPECT_EQ(shard->version(), 1u);
  EXPECT_FALSE(shard->has_loss_mask());
}

TEST(TokenShardTest, LossMaskAndSampleSizeRoundTripAsVersionTwo) {
  const std::string path = TestDir() + "/masked.bin";
  const std::vector<uint32_t> tokens = Ramp(12, 70000, 6007);
  const std::vector<uint8_t> mask = {0, 0, 1, 1, 0, 1, 0, 0, 0, 1, 1, 1};
  ASSERT_THAT(WriteTokenShard(path, tokens, 70000, {.loss_mask = mask, .sample_tokens = 4}),
              IsOk());
  EXPECT_EQ(fs::file_size(path), 64 + tokens.size() * 4 + tokens.size());
  absl::StatusOr<TokenShard> shard = TokenShard::Open(path);
  ASSERT_THAT(shard, IsOk());
  EXPECT_EQ(shard->version(), 2u);
  EXPECT_TRUE(shard->has_loss_mask());
  EXPECT_EQ(shard->sample_tokens(), 4u);
  for (size_t i = 0; i < tokens.size(); ++i) ASSERT_EQ(shard->token(i), tokens[i]) << i;
  std::vector<uint8_t> read(5);
  shard->ReadLossMask(3, 5, read.data());
  EXPECT_EQ(read, std::vector<uint8_t>(mask.begin() + 3, mask.begin() + 8));
}

TEST(TokenShardTest, RecordStartsRoundTripAfterTheMask) {
  const std::string path = TestDir() + "/records.bin";
  const std::vector<uint32_t> tokens = Ramp(8, 257, 31);
  const std::vector<uint8_t> mask = {1, 1, 1, 0, 1, 1, 1, 0};
  const std::vector<uint8_t> starts = {1, 0, 0, 1, 0, 0, 0, 0};
  ASSERT_THAT(WriteTokenShard(path, tokens, 257,
                              {.loss_mask = mask, .sample_tokens = 8, .record_starts = starts}),
              IsOk());
  EXPECT_EQ(fs::file_size(path), 64 + tokens.size() * 2 + 2 * tokens.size());
  absl::StatusOr<TokenShard> shard = TokenShard::Open(path);
  ASSERT_THAT(shard, IsOk());
  EXPECT_EQ(shard->version(), 2u);
  EXPECT_TRUE(shard->has_loss_mask());
  EXPECT_TRUE(shard->has_record_starts());
  std::vector<uint8_t> read(8);
  shard->ReadLossMask(0, 8, read.data());
  EXPECT_EQ(read, mask);
  shard->ReadRecordStarts(0, 8, read.data());
  EXPECT_EQ(read, starts);

  // Record starts alone make a version-2 shard too; without them every byte reads 0.
  ASSERT_THAT(WriteTokenShard(path, tokens, 257, {.record_starts = starts}), IsOk());
  shard = TokenShard::Open(path);
  ASSERT_THAT(shard, IsOk());
  EXPECT_EQ(shard->version(), 2u);
  EXPECT_FALSE(shard->has_loss_mask());
  shard->ReadRecordStarts(2, 3, read.data());
  EXPECT_EQ(std::vector<uint8_t>(read.begin(), read.begin() + 3), (std::vector<uint8_t>{0, 1, 0}));
  ASSERT_THAT(WriteTokenShard(path, tokens, 257, {.loss_mask = mask}), IsOk());
  shard = TokenShard::Open(path);
  ASSERT_THAT(shard, IsOk());
  EXPECT_FALSE(shard->has_record_starts());
  shard->ReadRecordStarts(0, 8, read.data());
  EXPECT_EQ(read, std::vector<uint8_t>(8, 0));

  const std::vector<uint8_t> bad = {1, 0, 3, 0, 0, 0, 0, 0};
  EXPECT_THAT(
      WriteTokenShard(path, tokens, 257, {.record_starts = bad}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("record starts: entry 2 is 3")));
  ASSERT_THAT(WriteTokenShard(path, tokens, 257, {.record_starts = starts}), IsOk());
  fs::resize_file(path, fs::file_size(path) - 1);
  EXPECT_THAT(TokenShard::Open(path),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("with record starts")));
}

TEST(TokenShardTest, BadMaskOrSampleSizeIsRefused) {
  const std::string path = TestDir() + "/bad.bin";
  const std::vector<uint32_t> tokens = Ramp(6, 257, 1);
  const std::vector<uint8_t> short_mask = {1, 1};
  EXPECT_THAT(
      WriteTokenShard(path, tokens, 257, {.loss_mask = short_mask}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("loss mask: 2 entries for 6 tokens")));
  const std::vector<uint8_t> bad_mask = {1, 1, 2, 0, 0, 0};
  EXPECT_THAT(WriteTokenShard(path, tokens, 257, {.loss_mask = bad_mask}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("loss mask: entry 2 is 2")));
  TokenShardExtras whole_samples;
  whole_samples.sample_tokens = 4;
  EXPECT_THAT(WriteTokenShard(path, tokens, 257, whole_samples),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not whole samples of 4")));
}

TEST(TokenShardTest, TruncatedLossMaskIsDataLoss) {
  const std::string path = TestDir() + "/cut.bin";
  const std::vector<uint8_t> mask(10, 1);
  ASSERT_THAT(WriteTokenShard(path, Ramp(10, 257, 1), 257, {.loss_mask = mask}), IsOk());
  fs::resize_file(path, fs::file_size(path) - 3);
  EXPECT_THAT(TokenShard::Open(path),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("with a loss mask")));
}

TEST(TokenShardTest, MissingShardIsNotFound) {
  const std::string path = TestDir() + "/missing.bin";
  EXPECT_THAT(TokenShard::Open(path), StatusIs(absl::StatusCode::kNotFound, HasSubstr(path)));
}

TEST(TokenShardTest, WriteRefusesTokensOutsideTheVocabulary) {
  const std::string path = TestDir() + "/out_of_vocab.bin";
  EXPECT_THAT(WriteTokenShard(path, std::vector<uint32_t>{1, 2, 257}, 257),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("token 2 is 257")));
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

TEST(TokenShardTest, MovedShardStaysReadable) {
  const std::string path = TestDir() + "/moved.bin";
  ASSERT_THAT(WriteTokenShard(path, std::vector<uint32_t>{5, 6, 7}, 257), IsOk());
  absl::StatusOr<TokenShard> opened = TokenShard::Open(path);
  ASSERT_THAT(opened, IsOk());
  std::vector<TokenShard> shards;
  shards.push_back(std::move(*opened));
  shards.reserve(16);  // moves the shard again
  EXPECT_EQ(shards[0].size(), 3u);
  EXPECT_EQ(shards[0].token(2), 7u);
}

}  // namespace
}  // namespace tessera::trainer

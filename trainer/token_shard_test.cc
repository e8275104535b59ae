#include "trainer/token_shard.h"

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
    file.put(2);
  }
  EXPECT_THAT(TokenShard::Open(path),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr(path + ": unsupported")));
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

#include "trainer/io/checkpoint.h"

#include <dirent.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "common/xxh3.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/json_util.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "tests/util/temp_dir.h"
#include "trainer/io/sha256.h"

namespace tessera::trainer {
namespace {

using ::google::protobuf::util::MessageDifferencer;
using ::tessera::testing::IsOk;
using ::tessera::testing::ReadBytes;
using ::tessera::testing::ScopedTempDir;
using ::tessera::testing::StatusIs;
using ::tessera::testing::WriteBytes;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;

bool Exists(const std::string& path) {
  struct stat info;
  return ::stat(path.c_str(), &info) == 0;
}

bool IsDirectory(const std::string& path) {
  struct stat info;
  return ::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode);
}

bool IsRegularFile(const std::string& path) {
  struct stat info;
  return ::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode);
}

// Names in directory `path`, sorted, without "." and "..".
std::vector<std::string> ListNames(const std::string& path) {
  std::vector<std::string> names;
  DIR* dir = ::opendir(path.c_str());
  if (dir == nullptr) return names;
  while (const dirent* entry = ::readdir(dir)) {
    std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(dir);
  std::sort(names.begin(), names.end());
  return names;
}

// Deterministic, distinct content for each (step, rank).
std::string ShardContent(int64_t step, int rank) {
  std::string content;
  for (int i = 0; i < 1000 + rank * 37; ++i) {
    content.push_back(static_cast<char>((step * 131 + rank * 17 + i * 7) & 0xff));
  }
  return content;
}

// Plays every rank writing its shard, then rank 0 committing.
absl::StatusOr<v1::CheckpointManifest> WriteCheckpoint(const std::string& root, int64_t step,
                                                       int world_size, int keep_last,
                                                       std::vector<int64_t>* retired = nullptr) {
  absl::StatusOr<std::string> staging = PrepareStaging(root, step);
  if (!staging.ok()) return staging.status();
  for (int rank = 0; rank < world_size; ++rank) {
    WriteBytes(StagingDir(root, step) + "/" + ShardFileName(rank), ShardContent(step, rank));
  }
  v1::CheckpointManifest manifest;
  manifest.set_job_id("job-1");
  return CommitCheckpoint(root, step, manifest, world_size, keep_last, {}, 0, retired);
}

std::string CheckpointPath(const std::string& root, int64_t step) {
  return root + "/" + CheckpointDirName(step);
}

TEST(Sha256Test, KnownVectors) {
  EXPECT_EQ(Sha256Hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(Sha256Test, FileMatchesBytesAcrossChunks) {
  ScopedTempDir tmp("checkpoint_test");
  const std::string dir = tmp.path();
  WriteBytes(dir + "/abc", "abc");
  EXPECT_EQ(*Sha256File(dir + "/abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  // Larger than one read chunk (1 MiB), not a multiple of it.
  std::string big;
  for (int i = 0; i < 3 * (1 << 20) + 12345; ++i) big.push_back(static_cast<char>(i * 31 % 251));
  WriteBytes(dir + "/big", big);
  absl::StatusOr<std::string> digest = Sha256File(dir + "/big");
  ASSERT_THAT(digest, IsOk());
  EXPECT_EQ(*digest, Sha256Hex(big));
}

TEST(Sha256Test, MissingFileIsNotFoundNamingIt) {
  ScopedTempDir tmp("checkpoint_test");
  const std::string path = tmp.path() + "/absent.pt";
  EXPECT_THAT(Sha256File(path), StatusIs(absl::StatusCode::kNotFound, HasSubstr(path)));
}

TEST(CheckpointNamesTest, Format) {
  EXPECT_EQ(CheckpointDirName(100), "step-00000100");
  EXPECT_EQ(CheckpointDirName(0), "step-00000000");
  EXPECT_EQ(CheckpointDirName(1234567890), "step-1234567890");
  EXPECT_EQ(ShardFileName(0), "rank-00000.pt");
  EXPECT_EQ(ShardFileName(12), "rank-00012.pt");
  EXPECT_EQ(StagingDir("/ckpt", 100), "/ckpt/.staging-step-00000100");
}

TEST(CheckpointTest, CommitMakesFinalDirAndRemovesStaging) {
  ScopedTempDir tmp("checkpoint_test");
  const std::string root = tmp.path() + "/ckpt";  // created by PrepareStaging
  absl::StatusOr<v1::CheckpointManifest> manifest = WriteCheckpoint(root, 100, 2, 0);
  ASSERT_THAT(manifest, IsOk());

  const std::string dir = CheckpointPath(root, 100);
  EXPECT_TRUE(IsDirectory(dir));
  EXPECT_FALSE(Exists(StagingDir(root, 100)));
  EXPECT_TRUE(IsRegularFile(dir + "/manifest.pb"));
  EXPECT_TRUE(IsRegularFile(dir + "/manifest.json"));

  EXPECT_EQ(manifest->format_version(), 1);
  EXPECT_EQ(manifest->step(), 100);
  EXPECT_EQ(manifest->job_id(), "job-1");
  EXPECT_GT(manifest->create_time().seconds(), 1'600'000'000);
  ASSERT_EQ(manifest->shards_size(), 2);
  for (int rank = 0; rank < 2; ++rank) {
    const v1::CheckpointShard& shard = manifest->shards(rank);
    EXPECT_EQ(shard.rank(), rank);
    EXPECT_EQ(shard.file(), ShardFileName(rank));
    EXPECT_EQ(shard.size_bytes(), static_cast<int64_t>(ShardContent(100, rank).size()));
    EXPECT_EQ(shard.xxh3_128(), Xxh3Hex(ShardContent(100, rank)));
    EXPECT_EQ(shard.sha256(), "");
    EXPECT_EQ(ReadBytes(dir + "/" + shard.file()), ShardContent(100, rank));
  }
  EXPECT_THAT(ListCheckpointDirs(root), ElementsAre(dir));
}

TEST(CheckpointTest, ShardsHashedWhileWrittenAreNotReadBack) {
  ScopedTempDir tmp("checkpoint_test");
  const std::string root = tmp.path() + "/ckpt";
  ASSERT_THAT(PrepareStaging(root, 7), IsOk());
  // Rank 0 writes through WriteHashedFile in uneven pieces; rank 1 writes plainly.
  const std::string content = ShardContent(7, 0);
  absl::StatusOr<std::string> digest =
      WriteHashedFile(StagingDir(root, 7) + "/" + ShardFileName(0), [&](const ByteSink& sink) {
        for (size_t at = 0; at < content.size(); at += 333) {
          const size_t n = std::min<size_t>(333, content.size() - at);
          ASSERT_EQ(sink(content.data() + at, n), n);
        }
      });
  ASSERT_THAT(digest, IsOk());
  EXPECT_EQ(*digest, Xxh3Hex(content));
  EXPECT_EQ(ReadBytes(StagingDir(root, 7) + "/" + ShardFileName(0)), content);
  WriteBytes(StagingDir(root, 7) + "/" + ShardFileName(1), ShardContent(7, 1));
  // The commit takes rank 0's digest as given (a wrong one shows it was not recomputed) and
  // hashes rank 1's shard itself.
  const std::string wrong(32, 'a');
  absl::StatusOr<v1::CheckpointManifest> manifest =
      CommitCheckpoint(root, 7, v1::CheckpointManifest(), 2, 0, {{ShardFileName(0), wrong}});
  ASSERT_THAT(manifest, IsOk());
  EXPECT_EQ(manifest->shards(0).xxh3_128(), wrong);
  EXPECT_EQ(manifest->shards(1).xxh3_128(), Xxh3Hex(ShardContent(7, 1)));
  // Which VerifyCheckpoint then refuses, naming the shard.
  EXPECT_THAT(VerifyCheckpoint(CheckpointPath(root, 7)),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("xxh3-128 mismatch")));
}

// The digest is computed on another thread while the next chunk is written: a caller may reuse
// its buffer as soon as a sink call returns. Three calls of several 2 MiB chunks each, all from
// one buffer refilled between them, must hash to the file's bytes.
TEST(CheckpointTest, WriteHashedFileHashesEveryChunkBeforeASinkCallReturns) {
  ScopedTempDir tmp("checkpoint_test");
  const std::string path = tmp.path() + "/shard";
  std::string buffer((5 << 20) + 3, '\0');
  std::string expected;
  absl::StatusOr<std::string> digest = WriteHashedFile(path, [&](const ByteSink& sink) {
    for (int call = 0; call < 3; ++call) {
      for (size_t i = 0; i < buffer.size(); ++i) {
        buffer[i] = static_cast<char>((i * 131 + static_cast<size_t>(call) * 7) >> 3);
      }
      expected += buffer;
      ASSERT_EQ(sink(buffer.data(), buffer.size()), buffer.size());
    }
  });
  ASSERT_THAT(digest, IsOk());
  EXPECT_EQ(*digest, Xxh3Hex(expected));
  EXPECT_EQ(ReadBytes(path), expected);
}

TEST(CheckpointTest, WriteHashedFileReportsAnUnwritablePath) {
  ScopedTempDir tmp("checkpoint_test");
  absl::StatusOr<std::string> digest =
      WriteHashedFile(tmp.path() + "/missing-dir/shard", [](const ByteSink&) {});
  EXPECT_THAT(digest, StatusIs(absl::StatusCode::kNotFound, HasSubstr("missing-dir/shard")));
}

TEST(CheckpointTest, ManifestRoundTrip) {
  ScopedTempDir tmp("checkpoint_test");
  const std::string root = tmp.path();
  ASSERT_THAT(PrepareStaging(root, 7), IsOk());
  WriteBytes(StagingDir(root, 7) + "/" + ShardFileName(0), "weights of rank 0");
  WriteBytes(StagingDir(root, 7) + "/rank-00000-optim.pt", "optimizer of rank 0");
  v1::CheckpointManifest manifest;
  manifest.set_job_id("job-rt");
  manifest.set_tokens_seen(123456789);
  manifest.mutable_layout()->set_data_parallel(1);
  manifest.mutable_data_position()->set_epoch(2);
  manifest.mutable_data_position()->set_samples_in_epoch(640);
  manifest.mutable_data_position()->set_seed(42);
  manifest.mutable_model()->set_preset("tiny-gpt2");
  manifest.mutable_model()->set_num_parameters(132928);

  absl::StatusOr<v1::CheckpointManifest> committed = CommitCheckpoint(root, 7, manifest, 1, 0);
  ASSERT_THAT(committed, IsOk());
  EXPECT_EQ(committed->job_id(), "job-rt");
  EXPECT_EQ(committed->tokens_seen(), 123456789);
  ASSERT_EQ(committed->shards_size(), 2);  // both files of rank 0, by name
  EXPECT_EQ(committed->shards(0).file(), "rank-00000-optim.pt");
  EXPECT_EQ(committed->shards(0).rank(), 0);
  EXPECT_EQ(committed->shards(1).file(), "rank-00000.pt");

  absl::StatusOr<v1::CheckpointManifest> verified = VerifyCheckpoint(CheckpointPath(root, 7));
  ASSERT_THAT(verified, IsOk());
  EXPECT_TRUE(MessageDifferencer::Equals(*verified, *committed))
      << verified->DebugString() << "\nvs\n"
      << committed->DebugString();

  v1::CheckpointManifest from_json;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(
                  ReadBytes(CheckpointPath(root, 7) + "/manifest.json"), &from_json)
                  .ok());
  EXPECT_TRUE(MessageDifferencer::Equals(from_json, *committed)) << from_json.DebugString();
}

TEST(CheckpointTest, VerifyCatchesFlippedByte) {
  ScopedTempDir tmp("checkpoint_test");
  const std::string root = tmp.path();
  ASSERT_THAT(WriteCheckpoint(root, 100, 2, 0), IsOk());
  const std::string shard = CheckpointPath(root, 100) + "/rank-00001.pt";
  std::string bytes = ReadBytes(shard);
  bytes[bytes.size() / 2] ^= 0x01;
  WriteBytes(shard, bytes);
  EXPECT_THAT(VerifyCheckpoint(CheckpointPath(root, 100)),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr(shard + ": xxh3-128 mismatch (manifest "),
                             HasSubstr(Xxh3Hex(ShardContent(100, 1))),
                             HasSubstr(", file " + Xxh3Hex(bytes) + ")"))));
}

// Every single-bit flip anywhere in a shard changes its XXH3-128 (checked exhaustively over a 4 KiB
// shard), so verification catches any flipped byte, as SHA-256 did.
TEST(CheckpointTest, EverySingleBitFlipChangesTheDigest) {
  std::string bytes = ShardContent(1, 0);
  bytes.resize(4096, 'x');
  const std::string digest = Xxh3Hex(bytes);
  for (size_t i = 0; i < bytes.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      bytes[i] ^= static_cast<char>(1 << bit);
      ASSERT_NE(Xxh3Hex(bytes), digest) << "byte " << i << " bit " << bit;
      bytes[i] ^= static_cast<char>(1 << bit);
    }
  }
}

// Manifests written before XXH3-128 hold only SHA-256: they still verify, and a flipped byte is
// still caught.
TEST(CheckpointTest, OlderManifestsWithSha256StillVerify) {
  ScopedTempDir tmp("checkpoint_test");
  const std::string root = tmp.path();
  ASSERT_THAT(WriteCheckpoint(root, 100, 2, 0), IsOk());
  const std::string dir = CheckpointPath(root, 100);
  v1::CheckpointManifest manifest;
  ASSERT_TRUE(manifest.ParseFromString(ReadBytes(dir + "/manifest.pb")));
  for (v1::CheckpointShard& shard : *manifest.mutable_shards()) {
    shard.clear_xxh3_128();
    shard.set_sha256(Sha256Hex(ReadBytes(dir + "/" + shard.file())));
  }
  WriteBytes(dir + "/manifest.pb", manifest.SerializeAsString());
  EXPECT_THAT(VerifyCheckpoint(dir), IsOk());
  const std::string shard = dir + "/rank-00001.pt";
  std::string bytes = ReadBytes(shard);
  bytes[bytes.size() / 2] ^= 0x01;
  WriteBytes(shard, bytes);
  EXPECT_THAT(VerifyCheckpoint(dir), StatusIs(absl::StatusCode::kDataLoss,
                                              HasSubstr(shard + ": sha256 mismatch (manifest ")));
  manifest.mutable_shards(1)->clear_sha256();
  WriteBytes(dir + "/manifest.pb", manifest.SerializeAsString());
  EXPECT_THAT(VerifyCheckpoint(dir),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("records no digest")));
}

TEST(CheckpointTest, VerifyCatchesTruncatedShard) {
  ScopedTempDir tmp("checkpoint_test");
  const std::string root = tmp.path();
  ASSERT_THAT(WriteCheckpoint(root, 100, 2, 0), IsOk());
  const std::string shard = CheckpointPath(root, 100) + "/rank-00000.pt";
  ASSERT_EQ(::truncate(shard.c_str(), 600), 0);
  EXPECT_THAT(VerifyCheckpoint(CheckpointPath(root, 100)),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr(absl::StrCat(shard, ": size 600 bytes, manifest says ",
                                              ShardContent(100, 0).size()))));
}

TEST(CheckpointTest, VerifyCatchesMissingShard) {
  ScopedTempDir tmp("checkpoint_test");
  const std::string root = tmp.path();
  ASSERT_THAT(WriteCheckpoint(root, 100, 2, 0), IsOk());
  const std::string shard = CheckpointPath(root, 100) + "/rank-00001.pt";
  ASSERT_EQ(::unlink(shard.c_str()), 0);
  EXPECT_THAT(VerifyCheckpoint(CheckpointPath(root, 100)),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr(shard + ": missing")));
}

TEST(CheckpointTest, VerifyCatchesMissingAndGarbledManifest) {
  ScopedTempDir tmp("checkpoint_test");
  const std::string root = tmp.path();
  ASSERT_THAT(WriteCheckpoint(root, 100, 1, 0), IsOk());
  const std::string manifest = CheckpointPath(root, 100) + "/manifest.pb";
  WriteBytes(manifest, "\xff\xff\xff garbage");
  EXPECT_THAT(VerifyCheckpoint(CheckpointPath(root, 100)),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr(manifest + ": cannot parse")));
  ASSERT_EQ(::unlink(manifest.c_str()), 0);
  EXPECT_THAT(VerifyCheckpoint(CheckpointPath(root, 100)),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr(manifest + ": missing (incomplete checkpoint)")));
  EXPECT_THAT(VerifyCheckpoint(root + "/step-00000999"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("step-00000999")));
}

TEST(CheckpointTest, FindLatestSkipsCorruptedNewerCheckpoint) {
  ScopedTempDir tmp("checkpoint_test");
  const std::string root = tmp.path();
  for (int64_t step : {100, 200, 300}) ASSERT_THAT(WriteCheckpoint(root, step, 2, 0), IsOk());
  const std::string shard = CheckpointPath(root, 300) + "/rank-00000.pt";
  std::string bytes = ReadBytes(shard);
  bytes[0] ^= 0x80;
  WriteBytes(shard, bytes);

  std::vector<std::string> skipped;
  absl::StatusOr<std::optional<FoundCheckpoint>> found = FindLatestCheckpoint(root, &skipped);
  ASSERT_THAT(found, IsOk());
  ASSERT_TRUE(found->has_value());
  EXPECT_EQ((*found)->path, CheckpointPath(root, 200));
  EXPECT_EQ((*found)->manifest.step(), 200);
  ASSERT_THAT(skipped, SizeIs(1));
  EXPECT_THAT(skipped[0], AllOf(HasSubstr(CheckpointPath(root, 300)),
                                HasSubstr("xxh3-128 mismatch"), HasSubstr("rank-00000.pt")));

  // Without the corruption the newest wins, and nothing is skipped.
  WriteBytes(shard, ShardContent(300, 0));
  skipped.clear();
  found = FindLatestCheckpoint(root, &skipped);
  ASSERT_THAT(found, IsOk());
  ASSERT_TRUE(found->has_value());
  EXPECT_EQ((*found)->path, CheckpointPath(root, 300));
  EXPECT_THAT(skipped, IsEmpty());
}

// DigestCheck::kNone reads no shard data: a flipped byte passes it (the resume that uses it
// hashes while loading), a changed size or a missing file does not; VerifyShardDigest then names
// the shard that was flipped. QuarantineCheckpoint sets the checkpoint aside where no listing or
// resume sees it, without overwriting an earlier one set aside.
TEST(CheckpointTest, StructureOnlyCheckDigestOfOneShardAndQuarantine) {
  ScopedTempDir tmp("checkpoint_test");
  const std::string root = tmp.path();
  for (int64_t step : {100, 200}) ASSERT_THAT(WriteCheckpoint(root, step, 2, 0), IsOk());
  const std::string dir = CheckpointPath(root, 200);
  const std::string shard = dir + "/rank-00001.pt";
  std::string bytes = ReadBytes(shard);
  bytes[bytes.size() / 2] ^= 0x01;
  WriteBytes(shard, bytes);

  absl::StatusOr<v1::CheckpointManifest> manifest = VerifyCheckpoint(dir, DigestCheck::kNone);
  ASSERT_THAT(manifest, IsOk());
  EXPECT_THAT(VerifyCheckpoint(dir),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr(shard + ": xxh3-128 mismatch")));
  ASSERT_THAT(manifest->shards(), SizeIs(2));
  for (const v1::CheckpointShard& s : manifest->shards()) {
    if (s.rank() == 0) {
      EXPECT_THAT(VerifyShardDigest(dir, s), IsOk());
    }
    if (s.rank() == 1) {
      EXPECT_THAT(VerifyShardDigest(dir, s),
                  StatusIs(absl::StatusCode::kDataLoss, HasSubstr(shard + ": xxh3-128 mismatch")));
    }
  }
  std::vector<std::string> skipped;
  auto found = FindLatestCheckpoint(root, &skipped, DigestCheck::kNone);
  ASSERT_THAT(found, IsOk());
  ASSERT_TRUE(found->has_value());
  EXPECT_EQ((*found)->path, dir);

  WriteBytes(shard, bytes + "x");
  EXPECT_THAT(VerifyCheckpoint(dir, DigestCheck::kNone),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr(shard + ": size ")));

  absl::StatusOr<std::string> moved = QuarantineCheckpoint(dir);
  ASSERT_THAT(moved, IsOk());
  EXPECT_EQ(*moved, dir + ".corrupt");
  found = FindLatestCheckpoint(root, nullptr, DigestCheck::kNone);
  ASSERT_THAT(found, IsOk());
  ASSERT_TRUE(found->has_value());
  EXPECT_EQ((*found)->path, CheckpointPath(root, 100));
  EXPECT_THAT(ListCheckpointDirs(root), ElementsAre(CheckpointPath(root, 100)));

  // The same step written again and found corrupt again is set aside next to the first.
  ASSERT_THAT(WriteCheckpoint(root, 200, 2, 0), IsOk());
  moved = QuarantineCheckpoint(dir);
  ASSERT_THAT(moved, IsOk());
  EXPECT_EQ(*moved, dir + ".corrupt-2");
  EXPECT_TRUE(std::filesystem::is_directory(dir + ".corrupt"));
  EXPECT_THAT(QuarantineCheckpoint(dir), StatusIs(absl::StatusCode::kNotFound, HasSubstr(dir)));
}

TEST(CheckpointTest, StagingDirIsNeverReturned) {
  ScopedTempDir tmp("checkpoint_test");
  const std::string root = tmp.path();
  ASSERT_THAT(WriteCheckpoint(root, 100, 2, 0), IsOk());
  // A crash at step 200 after every shard was written but before the commit.
  ASSERT_THAT(PrepareStaging(root, 200), IsOk());
  for (int rank = 0; rank < 2; ++rank) {
    WriteBytes(StagingDir(root, 200) + "/" + ShardFileName(rank), ShardContent(200, rank));
  }
  // A final directory without a manifest (e.g. copied by hand, half-way).
  ASSERT_EQ(::mkdir(CheckpointPath(root, 300).c_str(), 0755), 0);
  WriteBytes(CheckpointPath(root, 300) + "/rank-00000.pt", ShardContent(300, 0));

  std::vector<std::string> skipped;
  absl::StatusOr<std::optional<FoundCheckpoint>> found = FindLatestCheckpoint(root, &skipped);
  ASSERT_THAT(found, IsOk());
  ASSERT_TRUE(found->has_value());
  EXPECT_EQ((*found)->path, CheckpointPath(root, 100));
  ASSERT_THAT(skipped, SizeIs(1));
  EXPECT_THAT(skipped[0], AllOf(HasSubstr(CheckpointPath(root, 300)),
                                HasSubstr("missing (incomplete checkpoint)")));
  EXPECT_THAT(ListCheckpointDirs(root), ElementsAre(CheckpointPath(root, 100)));
}

TEST(CheckpointTest, FindLatestInMissingOrEmptyRootIsNone) {
  ScopedTempDir tmp("checkpoint_test");
  const std::string root = tmp.path();
  absl::StatusOr<std::optional<FoundCheckpoint>> found =
      FindLatestCheckpoint(root + "/never-created", nullptr);
  ASSERT_THAT(found, IsOk());
  EXPECT_FALSE(found->has_value());
  found = FindLatestCheckpoint(root, nullptr);
  ASSERT_THAT(found, IsOk());
  EXPECT_FALSE(found->has_value());
  EXPECT_THAT(ListCheckpointDirs(root + "/never-created"), IsEmpty());
}

TEST(CheckpointTest, KeepLastTwoKeepsTheTwoNewest) {
  ScopedTempDir tmp("checkpoint_test");
  const std::string root = tmp.path();
  // Each commit says which steps its retention deleted: what the coordinator's records drop.
  std::vector<std::vector<int64_t>> retired_by_commit;
  for (int64_t step : {100, 200, 300, 400}) {
    std::vector<int64_t> retired = {-1};
    ASSERT_THAT(WriteCheckpoint(root, step, 2, /*keep_last=*/2, &retired), IsOk());
    retired_by_commit.push_back(retired);
  }
  EXPECT_THAT(retired_by_commit,
              ElementsAre(IsEmpty(), IsEmpty(), ElementsAre(100), ElementsAre(200)));
  EXPECT_THAT(ListCheckpointDirs(root),
              ElementsAre(CheckpointPath(root, 400), CheckpointPath(root, 300)));
  EXPECT_FALSE(Exists(CheckpointPath(root, 200)));
  EXPECT_FALSE(Exists(CheckpointPath(root, 100)));
  EXPECT_THAT(ListNames(root), ElementsAre("step-00000300", "step-00000400"));
}

TEST(CheckpointTest, KeepLastZeroKeepsAll) {
  ScopedTempDir tmp("checkpoint_test");
  const std::string root = tmp.path();
  for (int64_t step : {1, 2, 3}) ASSERT_THAT(WriteCheckpoint(root, step, 1, 0), IsOk());
  EXPECT_THAT(ListCheckpointDirs(root), SizeIs(3));
}

TEST(CheckpointTest, RetentionKeepsTheCommittedOneWhenNewerExist) {
  ScopedTempDir tmp("checkpoint_test");
  const std::string root = tmp.path();
  for (int64_t step : {300, 400}) ASSERT_THAT(WriteCheckpoint(root, step, 1, 0), IsOk());
  // A job that resumed from an older step commits below existing checkpoints.
  std::vector<int64_t> retired;
  ASSERT_THAT(WriteCheckpoint(root, 200, 1, /*keep_last=*/2, &retired), IsOk());
  EXPECT_THAT(retired, ElementsAre(300));
  EXPECT_THAT(ListCheckpointDirs(root),
              ElementsAre(CheckpointPath(root, 400), CheckpointPath(root, 200)));
}

TEST(CheckpointTest, CommitRemovesStaleStagingOfOlderSteps) {
  ScopedTempDir tmp("checkpoint_test");
  const std::string root = tmp.path();
  ASSERT_THAT(PrepareStaging(root, 50), IsOk());   // crashed attempt
  ASSERT_THAT(PrepareStaging(root, 500), IsOk());  // a newer one is left alone
  ASSERT_THAT(WriteCheckpoint(root, 100, 1, 0), IsOk());
  EXPECT_FALSE(Exists(StagingDir(root, 50)));
  EXPECT_TRUE(Exists(StagingDir(root, 500)));
}

TEST(CheckpointTest, PrepareStagingClearsAStaleAttempt) {
  ScopedTempDir tmp("checkpoint_test");
  const std::string root = tmp.path();
  ASSERT_THAT(PrepareStaging(root, 100), IsOk());
  WriteBytes(StagingDir(root, 100) + "/rank-00003.pt", "from a crashed attempt");
  absl::StatusOr<std::string> staging = PrepareStaging(root, 100);
  ASSERT_THAT(staging, IsOk());
  EXPECT_EQ(*staging, StagingDir(root, 100));
  EXPECT_TRUE(IsDirectory(*staging));
  EXPECT_THAT(ListNames(*staging), IsEmpty());
}

TEST(CheckpointTest, CommitWithMissingRankFailsNamingIt) {
  ScopedTempDir tmp("checkpoint_test");
  const std::string root = tmp.path();
  ASSERT_THAT(PrepareStaging(root, 100), IsOk());
  WriteBytes(StagingDir(root, 100) + "/" + ShardFileName(0), "r0");
  WriteBytes(StagingDir(root, 100) + "/" + ShardFileName(2), "r2");
  EXPECT_THAT(CommitCheckpoint(root, 100, {}, 4, 0),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr(StagingDir(root, 100)), HasSubstr("ranks 1, 3"))));
  ASSERT_EQ(::unlink((StagingDir(root, 100) + "/" + ShardFileName(2)).c_str()), 0);
  EXPECT_THAT(CommitCheckpoint(root, 100, {}, 2, 0),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("from rank 1 of")));
  EXPECT_FALSE(Exists(CheckpointPath(root, 100)));
  EXPECT_TRUE(Exists(StagingDir(root, 100)));
}

TEST(CheckpointTest, CommitRejectsForeignFilesAndOutOfRangeRanks) {
  ScopedTempDir tmp("checkpoint_test");
  const std::string root = tmp.path();
  ASSERT_THAT(PrepareStaging(root, 100), IsOk());
  WriteBytes(StagingDir(root, 100) + "/" + ShardFileName(0), "r0");
  WriteBytes(StagingDir(root, 100) + "/" + ShardFileName(5), "r5");
  EXPECT_THAT(CommitCheckpoint(root, 100, {}, 1, 0),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("rank-00005.pt"), HasSubstr("world_size is 1"))));
  ASSERT_EQ(::unlink((StagingDir(root, 100) + "/" + ShardFileName(5)).c_str()), 0);
  WriteBytes(StagingDir(root, 100) + "/notes.txt", "?");
  EXPECT_THAT(CommitCheckpoint(root, 100, {}, 1, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("notes.txt")));
  EXPECT_THAT(CommitCheckpoint(root + "/elsewhere", 100, {}, 1, 0),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no staging directory")));
}

TEST(CheckpointTest, RecommittingAStepReplacesIt) {
  ScopedTempDir tmp("checkpoint_test");
  const std::string root = tmp.path();
  ASSERT_THAT(WriteCheckpoint(root, 100, 1, 0), IsOk());
  ASSERT_THAT(PrepareStaging(root, 100), IsOk());
  WriteBytes(StagingDir(root, 100) + "/" + ShardFileName(0), "second attempt");
  absl::StatusOr<v1::CheckpointManifest> manifest = CommitCheckpoint(root, 100, {}, 1, 0);
  ASSERT_THAT(manifest, IsOk());
  EXPECT_EQ(ReadBytes(CheckpointPath(root, 100) + "/rank-00000.pt"), "second attempt");
  EXPECT_THAT(VerifyCheckpoint(CheckpointPath(root, 100)), IsOk());
  EXPECT_THAT(ListNames(root), ElementsAre("step-00000100"));
}

}  // namespace
}  // namespace tessera::trainer

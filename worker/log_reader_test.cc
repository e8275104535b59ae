// Tests of LogReader: starting at the last N lines, incremental reads as a log grows, truncation,
// and a missing file.
#include "worker/log_reader.h"

#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/temp_dir.h"

namespace tessera::worker {
namespace {

using ::tessera::testing::IsOkAndHolds;
using ::tessera::testing::StatusIs;
using ::testing::HasSubstr;

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

void AppendFile(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::app) << text;
}

// Everything from `tail_lines` on, read in one go.
std::string ReadTail(const std::string& path, int tail_lines) {
  absl::StatusOr<LogReader> reader = LogReader::Open(path, tail_lines);
  if (!reader.ok()) return absl::StrCat("error: ", reader.status().ToString());
  absl::StatusOr<std::string> data = reader->ReadMore(1 << 30);
  return data.ok() ? *data : absl::StrCat("error: ", data.status().ToString());
}

class LogReaderTest : public ::testing::Test {
 protected:
  const std::string path_ = absl::StrCat(::tessera::testing::TestDir(), "/rank-0.log");
};

TEST_F(LogReaderTest, TailLinesStartsAtTheLastLines) {
  WriteFile(path_, "a\nbb\nccc\n");
  EXPECT_EQ(ReadTail(path_, 1), "ccc\n");
  EXPECT_EQ(ReadTail(path_, 2), "bb\nccc\n");
  EXPECT_EQ(ReadTail(path_, 3), "a\nbb\nccc\n");
  EXPECT_EQ(ReadTail(path_, 10), "a\nbb\nccc\n");
  EXPECT_EQ(ReadTail(path_, 0), "a\nbb\nccc\n");
  absl::StatusOr<LogReader> reader = LogReader::Open(path_, 2);
  ASSERT_TRUE(reader.ok());
  EXPECT_EQ(reader->offset(), 2);
}

TEST_F(LogReaderTest, UnterminatedLastLineCountsAsALine) {
  WriteFile(path_, "a\nbb\nccc");
  EXPECT_EQ(ReadTail(path_, 1), "ccc");
  EXPECT_EQ(ReadTail(path_, 2), "bb\nccc");
}

TEST_F(LogReaderTest, EmptyLinesAndEmptyFile) {
  WriteFile(path_, "");
  EXPECT_EQ(ReadTail(path_, 5), "");
  WriteFile(path_, "x\n\n\n");
  EXPECT_EQ(ReadTail(path_, 1), "\n");
  EXPECT_EQ(ReadTail(path_, 2), "\n\n");
}

TEST_F(LogReaderTest, TailSpansManyScanBlocks) {
  std::string text;
  for (int i = 0; i < 30000; ++i) absl::StrAppendFormat(&text, "line %05d\n", i);
  WriteFile(path_, text);
  // Each line is 11 bytes, so the last 25000 lines start at line 5000.
  EXPECT_EQ(ReadTail(path_, 25000), text.substr(5000 * 11));
  EXPECT_EQ(ReadTail(path_, 30000), text);
}

TEST_F(LogReaderTest, ReadMoreFollowsTheGrowingFile) {
  WriteFile(path_, "first\n");
  absl::StatusOr<LogReader> reader = LogReader::Open(path_, 0);
  ASSERT_TRUE(reader.ok());
  EXPECT_THAT(reader->ReadMore(1024), IsOkAndHolds("first\n"));
  EXPECT_EQ(reader->offset(), 6);
  EXPECT_THAT(reader->ReadMore(1024), IsOkAndHolds(""));

  AppendFile(path_, "second\n");
  EXPECT_THAT(reader->ReadMore(1024), IsOkAndHolds("second\n"));
  EXPECT_EQ(reader->offset(), 13);

  AppendFile(path_, "0123456789");
  EXPECT_THAT(reader->ReadMore(4), IsOkAndHolds("0123"));
  EXPECT_EQ(reader->offset(), 17);
  EXPECT_THAT(reader->ReadMore(0), IsOkAndHolds(""));

  // Moving the reader keeps its file and offset.
  LogReader moved = std::move(*reader);
  EXPECT_THAT(moved.ReadMore(100), IsOkAndHolds("456789"));
  EXPECT_THAT(moved.ReadMore(100), IsOkAndHolds(""));
}

TEST_F(LogReaderTest, TruncatedFileIsReadFromItsStart) {
  WriteFile(path_, "a long first attempt\n");
  absl::StatusOr<LogReader> reader = LogReader::Open(path_, 0);
  ASSERT_TRUE(reader.ok());
  EXPECT_THAT(reader->ReadMore(1024), IsOkAndHolds("a long first attempt\n"));
  WriteFile(path_, "new\n");
  EXPECT_THAT(reader->ReadMore(1024), IsOkAndHolds("new\n"));
}

TEST_F(LogReaderTest, MissingFileIsNotFound) {
  EXPECT_THAT(LogReader::Open(path_ + ".missing", 10),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr(path_ + ".missing")));
}

}  // namespace
}  // namespace tessera::worker

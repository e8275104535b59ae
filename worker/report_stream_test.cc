#include "worker/report_stream.h"

#include <string>
#include <vector>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "gtest/gtest.h"

namespace tessera::worker {
namespace {

// A frame as SocketReporter::Send writes it (trainer/report/reporter.cc).
std::string Frame(const v1::TrainerReport& report) {
  std::string frame;
  google::protobuf::io::StringOutputStream stream(&frame);
  google::protobuf::io::CodedOutputStream coded(&stream);
  coded.WriteVarint32(static_cast<uint32_t>(report.ByteSizeLong()));
  report.SerializeWithCachedSizes(&coded);
  coded.Trim();
  return frame;
}

// A varint32 size prefix alone.
std::string SizePrefix(uint32_t size) {
  std::string prefix;
  google::protobuf::io::StringOutputStream stream(&prefix);
  google::protobuf::io::CodedOutputStream coded(&stream);
  coded.WriteVarint32(size);
  coded.Trim();
  return prefix;
}

v1::TrainerReport Report(int rank, int64_t step) {
  v1::TrainerReport report;
  report.set_job_id("job-1");
  report.set_rank(rank);
  report.mutable_heartbeat()->set_step(step);
  return report;
}

TEST(ReportStreamTest, ReadsFramesInOrderAcrossBufferBoundaries) {
  const std::string bytes = Frame(Report(0, 1)) + Frame(v1::TrainerReport()) + Frame(Report(3, 7));
  // Block sizes of 1 and 3 split prefixes and messages across the stream's buffers.
  for (int block_size : {1, 3, 1024}) {
    google::protobuf::io::ArrayInputStream stream(bytes.data(), static_cast<int>(bytes.size()),
                                                  block_size);
    v1::TrainerReport report;
    ASSERT_TRUE(ReadTrainerReport(&stream, &report).ok()) << block_size;
    EXPECT_EQ(report.rank(), 0);
    EXPECT_EQ(report.heartbeat().step(), 1);
    ASSERT_TRUE(ReadTrainerReport(&stream, &report).ok()) << block_size;
    EXPECT_FALSE(report.has_heartbeat());  // cleared, not merged into
    ASSERT_TRUE(ReadTrainerReport(&stream, &report).ok()) << block_size;
    EXPECT_EQ(report.rank(), 3);
    EXPECT_EQ(report.heartbeat().step(), 7);
    EXPECT_EQ(ReadTrainerReport(&stream, &report).code(), absl::StatusCode::kOutOfRange);
  }
}

TEST(ReportStreamTest, TruncatedFrameIsDataLoss) {
  const std::string frame = Frame(Report(1, 2));
  for (size_t cut = 1; cut < frame.size(); ++cut) {
    google::protobuf::io::ArrayInputStream stream(frame.data(), static_cast<int>(cut));
    v1::TrainerReport report;
    EXPECT_EQ(ReadTrainerReport(&stream, &report).code(), absl::StatusCode::kDataLoss) << cut;
  }
}

TEST(ReportStreamTest, OversizedFrameIsRefusedBeforeItsBytes) {
  // Sizes above INT_MAX once turned into a negative limit, i.e. none: the "frame" then swallowed
  // the rest of the stream as one report.
  for (uint32_t size : {kMaxTrainerReportBytes + 1, uint32_t{0x80000000}, uint32_t{0xffffffff}}) {
    const std::string bytes = SizePrefix(size) + Frame(Report(0, 1));
    google::protobuf::io::ArrayInputStream stream(bytes.data(), static_cast<int>(bytes.size()));
    v1::TrainerReport report;
    EXPECT_EQ(ReadTrainerReport(&stream, &report).code(), absl::StatusCode::kDataLoss) << size;
  }
}

TEST(ReportStreamTest, MalformedSizePrefixIsDataLossNotTheEnd) {
  // Eleven bytes with the continuation bit: no varint32 (found by tests/fuzz/report_stream_fuzz).
  const std::string bytes = std::string(11, '\x86') + Frame(Report(0, 1));
  google::protobuf::io::ArrayInputStream stream(bytes.data(), static_cast<int>(bytes.size()));
  v1::TrainerReport report;
  EXPECT_EQ(ReadTrainerReport(&stream, &report).code(), absl::StatusCode::kDataLoss);
}

TEST(ReportStreamTest, FrameMustHoldExactlyOneReport) {
  // A frame of 4 bytes that are not a TrainerReport: field 1, a string of 5 bytes cut at 2.
  const std::string bytes = SizePrefix(4) + std::string{'\x0a', '\x05', 'a', 'b'};
  google::protobuf::io::ArrayInputStream stream(bytes.data(), static_cast<int>(bytes.size()));
  v1::TrainerReport report;
  EXPECT_EQ(ReadTrainerReport(&stream, &report).code(), absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace tessera::worker

// TensorBoard event files: CRC32C against the standard check value, TFRecord framing, and files
// read back record by record (lengths and both CRCs checked) into the events written. tests/
// tensorboard_test.py reads a trainer's files with tensorboard's own reader.
#include "trainer/report/tensorboard_writer.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/base/internal/endian.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "trainer/report/tensorboard_event.pb.h"
#include "trainer/report/tensorboard_reports.h"

namespace tessera::trainer {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::StatusIs;

// The events of a TFRecord file, each record's framing and CRCs checked.
std::vector<tensorboard::Event> ReadEvents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string bytes = buffer.str();
  std::vector<tensorboard::Event> events;
  size_t at = 0;
  while (at < bytes.size()) {
    EXPECT_GE(bytes.size() - at, 16u) << "a truncated record at " << at;
    if (bytes.size() - at < 16) break;
    const uint64_t length = absl::little_endian::Load64(bytes.data() + at);
    EXPECT_EQ(absl::little_endian::Load32(bytes.data() + at + 8),
              MaskCrc32c(Crc32c(std::string_view(bytes.data() + at, 8))));
    const std::string_view data(bytes.data() + at + 12, length);
    EXPECT_EQ(absl::little_endian::Load32(bytes.data() + at + 12 + length),
              MaskCrc32c(Crc32c(data)));
    tensorboard::Event event;
    EXPECT_TRUE(event.ParseFromString(std::string(data)));
    events.push_back(event);
    at += 16 + length;
  }
  return events;
}

absl::Time FixedNow() { return absl::FromUnixSeconds(1'700'000'000); }

TensorBoardWriterOptions FlushEvery(absl::Duration interval) {
  TensorBoardWriterOptions options;
  options.flush_interval = interval;
  return options;
}

TEST(Crc32cTest, MatchesTheStandardCheckValueAndTheMask) {
  // CRC-32C's check value (the CRC of "123456789"), as in RFC 3720's appendix.
  EXPECT_EQ(Crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(Crc32c(""), 0u);
  // mask(c) = rotate right by 15, plus a constant.
  EXPECT_EQ(MaskCrc32c(0), 0xa282ead8u);
  EXPECT_EQ(MaskCrc32c(0x8000u), 0x00000001u + 0xa282ead8u);
}

TEST(TfRecordTest, FramesTheDataWithItsLengthAndCrcs) {
  const std::string record = TfRecord("abc");
  ASSERT_EQ(record.size(), 8u + 4u + 3u + 4u);
  EXPECT_EQ(absl::little_endian::Load64(record.data()), 3u);
  EXPECT_EQ(record.substr(12, 3), "abc");
  EXPECT_EQ(absl::little_endian::Load32(record.data() + 15), MaskCrc32c(Crc32c("abc")));
}

class TensorBoardWriterTest : public ::testing::Test {
 protected:
  std::string dir_ = ::testing::TempDir() + "/tb-" +
                     ::testing::UnitTest::GetInstance()->current_test_info()->name();
  void SetUp() override { std::filesystem::remove_all(dir_); }
};

TEST_F(TensorBoardWriterTest, WritesTheVersionScalarsAndTextItReadsBack) {
  TensorBoardWriterOptions options;
  options.now = &FixedNow;
  options.file_suffix = ".r0";
  auto writer = TensorBoardWriter::Open(dir_ + "/run", options);
  ASSERT_THAT(writer, IsOk());
  const std::string path = (*writer)->path();
  EXPECT_THAT(path, ::testing::HasSubstr("/run/events.out.tfevents.1700000000."));
  EXPECT_THAT(path, ::testing::EndsWith(".r0"));
  (*writer)->AddScalar("train/loss", 1, 5.25);
  (*writer)->AddScalar("train/loss", 2, 4.5);
  (*writer)->AddText("job/spec", 0, "name: tiny");
  ASSERT_THAT((*writer)->Close(), IsOk());

  const std::vector<tensorboard::Event> events = ReadEvents(path);
  ASSERT_EQ(events.size(), 4u);
  EXPECT_EQ(events[0].file_version(), "brain.Event:2");
  EXPECT_DOUBLE_EQ(events[0].wall_time(), 1'700'000'000.0);
  EXPECT_EQ(events[1].step(), 1);
  ASSERT_EQ(events[1].summary().value_size(), 1);
  EXPECT_EQ(events[1].summary().value(0).tag(), "train/loss");
  EXPECT_FLOAT_EQ(events[1].summary().value(0).simple_value(), 5.25f);
  EXPECT_FLOAT_EQ(events[2].summary().value(0).simple_value(), 4.5f);
  const tensorboard::Summary::Value& text = events[3].summary().value(0);
  EXPECT_EQ(text.metadata().plugin_data().plugin_name(), "text");
  EXPECT_EQ(text.tensor().dtype(), tensorboard::DT_STRING);
  ASSERT_EQ(text.tensor().string_val_size(), 1);
  EXPECT_EQ(text.tensor().string_val(0), "name: tiny");
}

TEST_F(TensorBoardWriterTest, WritesRankZerosStepBreakdownAsScalars) {
  auto writer = TensorBoardWriter::Open(dir_ + "/breakdown", TensorBoardWriterOptions{});
  ASSERT_THAT(writer, IsOk());
  v1::TrainerReport report;
  v1::StepMetrics* m = report.mutable_metrics();
  m->set_step(7);
  m->set_loss(2.5);
  v1::StepTimeBreakdown* b = m->mutable_breakdown();
  b->set_forward_seconds(0.25);
  b->set_backward_seconds(0.5);
  b->set_other_seconds(0.125);
  v1::CollectiveTime* c = b->add_collectives();
  c->set_kind("reduce_scatter");
  c->set_dim("dp");
  c->set_seconds(0.0625);
  WriteToTensorBoard(report, **writer);
  ASSERT_THAT((*writer)->Close(), IsOk());
  std::map<std::string, float> scalars;
  for (const tensorboard::Event& event : ReadEvents((*writer)->path())) {
    for (const tensorboard::Summary::Value& value : event.summary().value()) {
      EXPECT_EQ(event.step(), 7);
      scalars[value.tag()] = value.simple_value();
    }
  }
  EXPECT_FLOAT_EQ(scalars.at("breakdown/forward_seconds"), 0.25f);
  EXPECT_FLOAT_EQ(scalars.at("breakdown/backward_seconds"), 0.5f);
  EXPECT_FLOAT_EQ(scalars.at("breakdown/optimizer_seconds"), 0.0f);
  EXPECT_FLOAT_EQ(scalars.at("breakdown/data_wait_seconds"), 0.0f);
  EXPECT_FLOAT_EQ(scalars.at("breakdown/checkpoint_blocked_seconds"), 0.0f);
  EXPECT_FLOAT_EQ(scalars.at("breakdown/other_seconds"), 0.125f);
  EXPECT_FLOAT_EQ(scalars.at("breakdown/collective/reduce_scatter_dp_seconds"), 0.0625f);
  EXPECT_FLOAT_EQ(scalars.at("train/loss"), 2.5f);
}

TEST_F(TensorBoardWriterTest, BuffersUntilTheFlushIntervalOrAnExplicitFlush) {
  auto writer = TensorBoardWriter::Open(dir_, FlushEvery(absl::Hours(1)));
  ASSERT_THAT(writer, IsOk());
  (*writer)->AddScalar("lr", 1, 0.1);
  EXPECT_EQ(ReadEvents((*writer)->path()).size(), 1u) << "only the version event yet";
  ASSERT_THAT((*writer)->Flush(), IsOk());
  EXPECT_EQ(ReadEvents((*writer)->path()).size(), 2u);

  // With no interval every event goes out as it is added.
  auto eager = TensorBoardWriter::Open(dir_, FlushEvery(absl::ZeroDuration()));
  ASSERT_THAT(eager, IsOk());
  EXPECT_NE((*eager)->path(), (*writer)->path());
  (*eager)->AddScalar("lr", 1, 0.1);
  EXPECT_EQ(ReadEvents((*eager)->path()).size(), 2u);
}

TEST_F(TensorBoardWriterTest, ADirectoryThatCannotBeMadeIsAnError) {
  std::filesystem::create_directories(dir_);
  std::ofstream(dir_ + "/file") << "x";
  EXPECT_THAT(TensorBoardWriter::Open(dir_ + "/file/tb"),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::HasSubstr(dir_)));
}

}  // namespace
}  // namespace tessera::trainer

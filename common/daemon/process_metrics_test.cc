// Process metrics: the parsing of a made-up /proc, and a reading of the real one.
#include "common/daemon/process_metrics.h"

#include <fcntl.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"
#include "tests/util/temp_dir.h"

namespace tessera {
namespace {

using ::tessera::testing::IsOk;
using ::testing::Contains;
using ::testing::HasSubstr;

// A /proc holding self/stat, self/fd with `fds` entries, and stat with a btime line.
std::string FakeProc(const std::string& stat_line, int fds) {
  const std::string root = ::tessera::testing::TestDir() + "/proc";
  std::filesystem::remove_all(root);
  std::filesystem::create_directories(root + "/self/fd");
  std::ofstream(root + "/self/stat") << stat_line;
  std::ofstream(root + "/stat") << "cpu  1 2 3 4\nbtime 1700000000\nprocesses 99\n";
  for (int i = 0; i < fds; ++i) std::ofstream(root + "/self/fd/" + std::to_string(i)) << "";
  return root;
}

TEST(ProcessMetricsTest, ReadsCpuMemoryFdsAndStartTimeFromProc) {
  // Fields 14-15 (utime, stime) 250 + 150 ticks, 22 starttime 1234 ticks, 23 vsize, 24 rss pages;
  // the command name holds a space and a parenthesis.
  const std::string root = FakeProc(
      "4242 (tessera (w) x) S 1 4242 4242 0 -1 4194560 1000 0 0 0 250 150 0 0 20 0 12 0 1234 "
      "987654321 2000 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 3 0 0 0 0 0\n",
      5);
  absl::StatusOr<ProcessSample> sample = ReadProcessSample(root, 100, 4096);
  ASSERT_THAT(sample, IsOk());
  EXPECT_DOUBLE_EQ(sample->cpu_seconds, 4.0);
  EXPECT_EQ(sample->resident_memory_bytes, 2000 * 4096);
  EXPECT_EQ(sample->virtual_memory_bytes, 987654321);
  EXPECT_EQ(sample->open_fds, 5);
  EXPECT_DOUBLE_EQ(sample->start_time_seconds, 1700000000 + 12.34);
}

TEST(ProcessMetricsTest, AMalformedStatLineNamesTheFile) {
  const std::string root = FakeProc("4242 (short) S 1 2 3\n", 0);
  absl::StatusOr<ProcessSample> sample = ReadProcessSample(root, 100, 4096);
  ASSERT_FALSE(sample.ok());
  EXPECT_THAT(sample.status().message(), HasSubstr(root + "/self/stat"));
  EXPECT_FALSE(ReadProcessSample(root + "/missing").ok());
}

TEST(ProcessMetricsTest, ThisProcessAsPrometheusSeesIt) {
  // One more descriptor open while reading must show.
  const absl::StatusOr<ProcessSample> before = ReadProcessSample();
  ASSERT_THAT(before, IsOk());
  const int fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  const absl::StatusOr<ProcessSample> after = ReadProcessSample();
  close(fd);
  ASSERT_THAT(after, IsOk());
  EXPECT_EQ(after->open_fds, before->open_fds + 1);
  EXPECT_GT(after->resident_memory_bytes, 1 << 20);
  EXPECT_GE(after->virtual_memory_bytes, after->resident_memory_bytes);
  const double now = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
  EXPECT_LE(after->start_time_seconds, now + 1);
  EXPECT_GT(after->start_time_seconds, now - 3600) << "this test started within the hour";

  const std::string text = prometheus::TextSerializer().Serialize(ProcessMetrics().Collect());
  const std::vector<std::string> lines = absl::StrSplit(text, '\n', absl::SkipEmpty());
  EXPECT_THAT(lines, Contains("# TYPE process_cpu_seconds_total counter"));
  for (const char* gauge : {"process_resident_memory_bytes", "process_virtual_memory_bytes",
                            "process_open_fds", "process_start_time_seconds"}) {
    EXPECT_THAT(lines, Contains(std::string("# TYPE ") + gauge + " gauge"));
  }
}

}  // namespace
}  // namespace tessera

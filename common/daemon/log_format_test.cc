#include "common/daemon/log_format.h"

#include <unistd.h>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace tessera {
namespace {

using ::tessera::testing::StatusIs;

TEST(LogFormatTest, ParsesTheTwoFormatsAndNamesTheFlagOtherwise) {
  EXPECT_EQ(*ParseLogFormat("text"), LogFormat::kText);
  EXPECT_EQ(*ParseLogFormat("json"), LogFormat::kJson);
  EXPECT_THAT(ParseLogFormat("yaml"),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("--log_format")));
}

TEST(LogFormatTest, JsonLineCarriesTimeComponentPidAndTheMessageEscaped) {
  // 2026-11-24T21:50:01.123Z
  const int64_t time_ns = 1795557001123000000;
  const std::string line =
      JsonLogLine(time_ns, "coordinator", "job \"a\"\tfailed: C:\\path", "", "");
  EXPECT_EQ(line.find('\n'), std::string::npos);
  const nlohmann::json parsed = nlohmann::json::parse(line);
  EXPECT_EQ(parsed["time"], "2026-11-24T21:50:01.123Z");
  EXPECT_EQ(parsed["component"], "coordinator");
  EXPECT_EQ(parsed["pid"], static_cast<int64_t>(getpid()));
  EXPECT_EQ(parsed["message"], "job \"a\"\tfailed: C:\\path");
  EXPECT_FALSE(parsed.contains("severity"));
  EXPECT_FALSE(parsed.contains("source"));
}

TEST(LogFormatTest, GrpcLinesKeepSeverityAndSource) {
  const nlohmann::json parsed =
      nlohmann::json::parse(JsonLogLine(0, "worker", "connect failed", "ERROR", "chttp2.cc:12"));
  EXPECT_EQ(parsed["time"], "1970-01-01T00:00:00.000Z");
  EXPECT_EQ(parsed["severity"], "ERROR");
  EXPECT_EQ(parsed["source"], "chttp2.cc:12");
}

TEST(LogFormatTest, BytesThatAreNotUtf8StillMakeValidJson) {
  const std::string line = JsonLogLine(0, "worker", std::string("path \xff\xfe end"));
  const nlohmann::json parsed = nlohmann::json::parse(line);
  EXPECT_EQ(parsed["message"], "path \xEF\xBF\xBD\xEF\xBF\xBD end");
}

}  // namespace
}  // namespace tessera

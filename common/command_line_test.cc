#include "common/command_line.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace tessera {
namespace {

std::vector<std::string> Rewritten(std::vector<std::string> args) {
  std::vector<char*> argv;
  for (auto& arg : args) argv.push_back(arg.data());
  AcceptDashedFlags(static_cast<int>(argv.size()), argv.data());
  return args;
}

TEST(AcceptDashedFlagsTest, FlagNamesLoseTheirDashesValuesKeepThem) {
  EXPECT_EQ(Rewritten({"bin", "--metrics-listen=0.0.0.0:9464", "--log-format", "json",
                       "--heartbeat_timeout=5s", "--work-dir=/a-b/c-d", "-v", "pos-arg"}),
            (std::vector<std::string>{"bin", "--metrics_listen=0.0.0.0:9464", "--log_format",
                                      "json", "--heartbeat_timeout=5s", "--work_dir=/a-b/c-d",
                                      "-v", "pos-arg"}));
}

TEST(AcceptDashedFlagsTest, NothingAfterABareDoubleDash) {
  EXPECT_EQ(Rewritten({"bin", "--node-name=a", "--", "--not-a-flag"}),
            (std::vector<std::string>{"bin", "--node_name=a", "--", "--not-a-flag"}));
}

}  // namespace
}  // namespace tessera

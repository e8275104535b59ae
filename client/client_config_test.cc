#include "client/client_config.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/temp_dir.h"

namespace tessera::client {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::ScopedTempDir;
using ::testing::HasSubstr;

TEST(ClientConfigTest, ParsesEveryKeyAndRefusesUnknownOnes) {
  setenv("HOME", "/home/alice", 1);
  auto config = ParseClientConfig(
      "coordinator: tessera.example.com:50051\ntoken: abc\ntls_ca: ~/ca.crt\n"
      "tls_cert: /etc/alice.crt\ntls_key: /etc/alice.key\n");
  ASSERT_THAT(config, IsOk());
  EXPECT_EQ(config->coordinator, "tessera.example.com:50051");
  EXPECT_EQ(config->token, "abc");
  EXPECT_EQ(config->tls_ca, "/home/alice/ca.crt");
  EXPECT_EQ(config->tls_cert, "/etc/alice.crt");
  EXPECT_EQ(config->tls_key, "/etc/alice.key");
  auto typo = ParseClientConfig("tokn: abc\n");
  EXPECT_EQ(typo.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(typo.status().message(), HasSubstr("unknown key 'tokn'"));
  EXPECT_THAT(ParseClientConfig(""), IsOk());
}

TEST(ClientConfigTest, SeveralCoordinatorsAsAListOrCommaSeparated) {
  auto list = ParseClientConfig("coordinator: [a.example.com:50051, b.example.com:50051]\n");
  ASSERT_THAT(list, IsOk());
  EXPECT_EQ(list->coordinator, "a.example.com:50051,b.example.com:50051");
  auto joined = ParseClientConfig("coordinator: a:1,b:2\n");
  ASSERT_THAT(joined, IsOk());
  EXPECT_EQ(joined->coordinator, "a:1,b:2");
}

TEST(ClientConfigTest, FlagThenEnvironmentThenDefaultPath) {
  ScopedTempDir dir;
  setenv("HOME", dir.path().c_str(), 1);
  unsetenv("XDG_CONFIG_HOME");
  unsetenv("TESSERA_CONFIG");
  bool named = true;
  EXPECT_EQ(ClientConfigPath("", &named), dir.path() + "/.config/tessera/config.yaml");
  EXPECT_FALSE(named);
  // A missing default file is an empty config; a missing named one an error.
  auto empty = LoadClientConfig("");
  ASSERT_THAT(empty, IsOk());
  EXPECT_TRUE(empty->token.empty());
  EXPECT_EQ(LoadClientConfig(dir.path() + "/nope.yaml").status().code(),
            absl::StatusCode::kNotFound);
  setenv("TESSERA_CONFIG", "/from/env.yaml", 1);
  EXPECT_EQ(ClientConfigPath("", &named), "/from/env.yaml");
  EXPECT_TRUE(named);
  EXPECT_EQ(ClientConfigPath("/from/flag.yaml", &named), "/from/flag.yaml");
  unsetenv("TESSERA_CONFIG");
}

TEST(ClientConfigTest, ATokenInAFileOthersCanReadIsRefused) {
  ScopedTempDir dir;
  const std::string path = dir.path() + "/config.yaml";
  std::ofstream(path) << "token: secret\n";
  ASSERT_EQ(chmod(path.c_str(), 0644), 0);
  auto exposed = LoadClientConfig(path);
  EXPECT_EQ(exposed.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(exposed.status().message(), HasSubstr("chmod 600"));
  ASSERT_EQ(chmod(path.c_str(), 0600), 0);
  auto config = LoadClientConfig(path);
  ASSERT_THAT(config, IsOk());
  EXPECT_EQ(config->token, "secret");
}

}  // namespace
}  // namespace tessera::client

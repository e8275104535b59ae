#include "worker/node_key.h"

#include <sys/stat.h>

#include <fstream>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/temp_dir.h"

namespace tessera::worker {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::ScopedTempDir;
using ::testing::HasSubstr;

TEST(NodeKeyTest, MadeOnceKeptAfterwardsAndPrivate) {
  ScopedTempDir dir;
  const std::string work_dir = dir.path() + "/work";
  auto first = LoadOrCreateNodeKey(work_dir);
  ASSERT_THAT(first, IsOk());
  EXPECT_EQ(first->size(), 64u);
  auto again = LoadOrCreateNodeKey(work_dir);
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ(*again, *first);
  struct stat info {};
  ASSERT_EQ(stat((work_dir + "/node.key").c_str(), &info), 0);
  EXPECT_EQ(info.st_mode & 0777, 0600u);

  ScopedTempDir other;
  auto different = LoadOrCreateNodeKey(other.path());
  ASSERT_THAT(different, IsOk());
  EXPECT_NE(*different, *first);
}

TEST(NodeKeyTest, RefusesAKeyOthersCanReadOrThatIsNoKey) {
  ScopedTempDir dir;
  ASSERT_THAT(LoadOrCreateNodeKey(dir.path()), IsOk());
  const std::string path = dir.path() + "/node.key";
  ASSERT_EQ(chmod(path.c_str(), 0644), 0);
  auto exposed = LoadOrCreateNodeKey(dir.path());
  EXPECT_EQ(exposed.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(exposed.status().message(), HasSubstr("chmod 600"));

  std::ofstream(path, std::ios::trunc) << "not a key\n";
  ASSERT_EQ(chmod(path.c_str(), 0600), 0);
  auto garbage = LoadOrCreateNodeKey(dir.path());
  EXPECT_EQ(garbage.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(garbage.status().message(), HasSubstr("not a node key"));
}

}  // namespace
}  // namespace tessera::worker

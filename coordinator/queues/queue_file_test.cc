// QueueFile: the queue file read at start (a bad one refused), re-read when it changes at most
// once per check interval on the simulated clock, a bad later version refused with the previous
// configuration kept.

#include "coordinator/queues/queue_file.h"

#include <filesystem>
#include <fstream>
#include <string>

#include "common/clock.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/temp_dir.h"

namespace tessera::coordinator {
namespace {

using ::tessera::testing::StatusIs;
using ::testing::HasSubstr;

constexpr char kTwoQueues[] = R"(
queues:
  - name: nlp
    nominal: {gpus: 8}
  - name: vision
    nominal: {gpus: 4}
)";

// Replaces the file (a new inode), as an editor or a ConfigMap update does.
void Write(const std::string& path, const std::string& text) {
  const std::string next = path + ".next";
  std::ofstream(next) << text;
  std::filesystem::rename(next, path);
}

TEST(QueueFileTest, WithoutAPathThereIsOneImplicitQueue) {
  auto file = QueueFile::Create({});
  ASSERT_THAT(file.status(), testing::IsOk());
  EXPECT_TRUE((*file)->Current()->implicit());
  EXPECT_THAT((*file)->ReloadIfChanged(), testing::IsOk());
}

TEST(QueueFileTest, ABadFileStopsTheStartNamingTheField) {
  ::tessera::testing::ScopedTempDir dir("queue-file");
  const std::string path = dir.path() + "/queues.yaml";
  Write(path, "queues:\n  - name: nlp\n    nominal: {gpus: -4}\n");
  EXPECT_THAT(QueueFile::Create({.path = path}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("nominal.gpus: must be >= 0, got -4")));
  EXPECT_THAT(QueueFile::Create({.path = dir.path() + "/missing.yaml"}).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("missing.yaml")));
}

TEST(QueueFileTest, AChangeIsReadOnceTheCheckIntervalPassedAndABadOneIsRefused) {
  ::tessera::testing::ScopedTempDir dir("queue-file");
  const std::string path = dir.path() + "/queues.yaml";
  Write(path, kTwoQueues);
  SimulatedClock clock;
  auto created = QueueFile::Create(
      {.path = path, .reload_check_interval = absl::Seconds(1), .clock = &clock});
  ASSERT_THAT(created.status(), testing::IsOk());
  QueueFile& file = **created;
  ASSERT_EQ(file.Current()->queues.size(), 2u);
  EXPECT_EQ(file.reloads(), 1);

  // Changed, but not looked at before the interval has passed.
  Write(path, "queues:\n  - name: nlp\n    nominal: {gpus: 16}\n");
  EXPECT_EQ(file.Current()->queues.size(), 2u);
  clock.Advance(absl::Seconds(1));
  std::shared_ptr<const QueueConfig> changed = file.Current();
  ASSERT_EQ(changed->queues.size(), 1u);
  EXPECT_EQ(changed->queues[0].nominal.gpus, 16);
  EXPECT_EQ(file.reloads(), 2);

  // A bad version is refused: the previous configuration stays, and it is not read again until
  // the file changes once more.
  Write(path, "queues:\n  - name: nlp\n    nominal: {gpus: 16}\n    colour: blue\n");
  clock.Advance(absl::Seconds(1));
  EXPECT_THAT(file.ReloadIfChanged(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("colour")));
  EXPECT_EQ(file.Current().get(), changed.get());
  EXPECT_THAT(file.ReloadIfChanged(), testing::IsOk());
  EXPECT_EQ(file.reloads(), 2);

  Write(path, kTwoQueues);
  clock.Advance(absl::Seconds(1));
  EXPECT_EQ(file.Current()->queues.size(), 2u);
  EXPECT_EQ(file.reloads(), 3);
  // What a caller holds stays valid after a reload.
  EXPECT_EQ(changed->queues[0].nominal.gpus, 16);
}

}  // namespace
}  // namespace tessera::coordinator

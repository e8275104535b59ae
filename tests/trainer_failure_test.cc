// Real tessera-trainer processes that must fail, and say why with a typed failure report: a
// truncated shard or tokens beyond the vocabulary (DATA_ERROR, naming the file), divergence
// (NAN_LOSS), a pipeline stage whose peer died (naming the rank), a taken master port
// (RENDEZVOUS, naming the port).

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <csignal>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/v1/trainer.pb.h"
#include "tests/trainer_training_fixture.h"
#include "tests/util/free_port.h"
#include "tests/util/subprocess.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using ::tessera::testing::IsOk;
using ::tessera::testing::ParseReports;
using ::tessera::testing::PickFreePort;
using ::tessera::testing::Subprocess;
using ::tessera::testing::TrainerRun;
using ::tessera::testing::TrainerTrainingTest;
using ::testing::HasSubstr;

TEST_F(TrainerTrainingTest, TruncatedShardIsRefusedByName) {
  std::string dir = MakeTempDir("bad-data");
  std::string shard = dir + "/train-00000.bin";
  fs::copy_file(*data_dir_ + "/train-00000.bin", shard);
  fs::resize_file(shard, fs::file_size(shard) - 1000);
  std::vector<std::string> flags = BaseFlags(5);
  flags[1] = Shards("data.train_shards", shard);
  TrainerRun run = RunTrainer(flags);
  EXPECT_NE(run.exit_code, 0);
  EXPECT_THAT(run.output, HasSubstr(shard));
  EXPECT_THAT(run.output, HasSubstr("truncated"));
  bool typed = false;
  for (const auto& report : run.reports) {
    typed |= report.has_failure() && report.failure().kind() == v1::FAILURE_KIND_DATA_ERROR;
  }
  EXPECT_TRUE(typed) << "no DATA_ERROR failure report in:\n" << run.output;
}

// A shard whose header is fine but whose body holds ids beyond its vocabulary fails the run as
// DATA_ERROR naming the file, instead of indexing past the embedding.
TEST_F(TrainerTrainingTest, TokensBeyondTheVocabularyAreADataError) {
  std::string dir = MakeTempDir("bad-tokens");
  std::string shard = dir + "/train-00000.bin";
  fs::copy_file(*data_dir_ + "/train-00000.bin", shard);
  {
    std::fstream file(shard, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(4096);
    const std::string ones(fs::file_size(shard) - 4096, '\xff');
    file.write(ones.data(), static_cast<std::streamsize>(ones.size()));
  }
  std::vector<std::string> flags = BaseFlags(5);
  flags[1] = Shards("data.train_shards", shard);
  TrainerRun run = RunTrainer(flags);
  EXPECT_NE(run.exit_code, 0);
  EXPECT_THAT(run.output, HasSubstr(shard + ": token "));
  EXPECT_THAT(run.output, HasSubstr("not below the vocabulary size 257"));
  bool typed = false;
  for (const auto& report : run.reports) {
    typed |= report.has_failure() && report.failure().kind() == v1::FAILURE_KIND_DATA_ERROR;
  }
  EXPECT_TRUE(typed) << "no DATA_ERROR failure report in:\n" << run.output;
}

TEST_F(TrainerTrainingTest, DivergenceIsReportedAsNanLoss) {
  // A learning rate of 1e4 without clipping blows the weights up within steps.
  std::vector<std::string> flags = BaseFlags(20);
  flags.push_back("--set=optimizer.schedule.peak_learning_rate=1e4");
  flags.push_back("--set=optimizer.schedule.warmup_steps=0");
  flags.push_back("--set=optimizer.grad_clip_norm=0");
  TrainerRun run = RunTrainer(flags);
  EXPECT_EQ(run.exit_code, 1);
  bool typed = false;
  for (const auto& report : run.reports) {
    typed |= report.has_failure() && report.failure().kind() == v1::FAILURE_KIND_NAN_LOSS;
  }
  EXPECT_TRUE(typed) << "no NAN_LOSS failure report in:\n" << run.output;
  EXPECT_LT(run.losses.size(), 20u);
}

// A pipeline stage that dies mid-step: its peer fails within seconds naming the lost stage's
// rank, with a typed failure, instead of waiting forever.
TEST_F(TrainerTrainingTest, DeadPipelineStageFailsItsPeerNamingTheRank) {
  std::vector<std::string> flags = BaseFlags(100000);
  flags.push_back("--set=parallelism.layout.pipeline_parallel=2");
  flags = ForWorld(flags, 2);
  const absl::StatusOr<int> port = PickFreePort();
  ASSERT_THAT(port, IsOk());
  std::vector<Subprocess> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    auto process = Subprocess::Start(
        flags, {.merge_stdout = true,
                .extra_env = {absl::StrCat("RANK=", rank), "WORLD_SIZE=2",
                              absl::StrCat("LOCAL_RANK=", rank), "LOCAL_WORLD_SIZE=2",
                              "MASTER_ADDR=127.0.0.1", absl::StrCat("MASTER_PORT=", *port)}});
    ASSERT_THAT(process, IsOk());
    ranks.push_back(std::move(*process));
  }
  ASSERT_THAT(ranks[0].WaitForStderrLine("\"step\":\"3\"", absl::Seconds(120)), IsOk())
      << ranks[0].stderr_text();
  auto killed = ranks[1].Stop(SIGKILL);
  ASSERT_THAT(killed, IsOk());
  const absl::Time start = absl::Now();
  auto exit = ranks[0].Wait(absl::Seconds(60));
  ASSERT_THAT(exit, IsOk()) << "rank 0 did not notice its lost peer:\n" << ranks[0].stderr_text();
  EXPECT_NE(exit->exit_code, 0);
  EXPECT_LT(absl::Now() - start, absl::Seconds(40));
  TrainerRun run;
  run.output = ranks[0].stderr_text();
  ParseReports(run);
  // Named by the pipeline's send/receive, or by the check-in after another collective failed.
  EXPECT_THAT(run.output,
              ::testing::ContainsRegex("stage 1 \\(rank 1\\)|rank\\(s\\) 1 did not answer"))
      << run.output;
  // A closed connection is a consequence of rank 1's death (PEER_FAILED); only a peer that
  // stalls rather than dies would surface as a timeout.
  bool typed = false;
  for (const auto& report : run.reports) {
    typed |= report.has_failure() &&
             (report.failure().kind() == v1::FAILURE_KIND_PEER_FAILED ||
              report.failure().kind() == v1::FAILURE_KIND_COLLECTIVE_TIMEOUT) &&
             // "stage 1 (rank 1)" from the pipeline, "rank(s) 1 did not answer" from the check-in.
             (absl::StrContains(report.failure().message(), "rank 1") ||
              absl::StrContains(report.failure().message(), "rank(s) 1")) &&
             report.failure().time().seconds() > 0;
  }
  EXPECT_TRUE(typed) << run.output;
}

// Rank 0 finds the master port taken by another process: it fails at once with
// FAILURE_KIND_RENDEZVOUS and a message that says so (not a collective timeout).
TEST_F(TrainerTrainingTest, ATakenMasterPortIsARendezvousFailureNamingThePort) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(listener, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  address.sin_port = 0;
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  ASSERT_EQ(listen(listener, 4), 0);
  socklen_t length = sizeof(address);
  ASSERT_EQ(getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length), 0);
  const int port = ntohs(address.sin_port);
  // Rank 0 of two, alone: it never gets as far as waiting for rank 1.
  auto process = Subprocess::Start(
      ForWorld(BaseFlags(2), 2),
      {.merge_stdout = true,
       .extra_env = {"RANK=0", "WORLD_SIZE=2", "LOCAL_RANK=0", "LOCAL_WORLD_SIZE=2",
                     "MASTER_ADDR=127.0.0.1", absl::StrCat("MASTER_PORT=", port)}});
  ASSERT_THAT(process, IsOk());
  auto exit = process->Wait(absl::Minutes(2));
  close(listener);
  ASSERT_THAT(exit, IsOk());
  TrainerRun run;
  run.exit_code = exit->exit_code;
  run.output = process->stderr_text();
  ParseReports(run);
  EXPECT_NE(run.exit_code, 0);
  EXPECT_THAT(run.output, HasSubstr(absl::StrCat("cannot listen on the master port ", port)));
  bool typed = false;
  for (const auto& report : run.reports) {
    typed |= report.has_failure() && report.failure().kind() == v1::FAILURE_KIND_RENDEZVOUS;
  }
  EXPECT_TRUE(typed) << run.output;
}

}  // namespace
}  // namespace tessera

// Runs real tessera-trainer processes on the bundled corpus (CPU, Gloo) and
// checks the trainer's promises: the loss falls, two data-parallel processes
// follow the single-process curve, a stopped and resumed run equals an
// uninterrupted one, and corrupted inputs are refused by name.

#include <torch/serialize.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "planner/model_config.h"
#include "tessera/v1/trainer.pb.h"
#include "tests/util/subprocess.h"
#include "trainer/model.h"
#include "trainer/torch_pch.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using ::tessera::testing::BinDir;
using ::tessera::testing::IsOk;
using ::tessera::testing::RunCommand;
using ::tessera::testing::Subprocess;
using ::testing::HasSubstr;

struct TrainerRun {
  int exit_code = -1;
  std::string output;
  std::vector<v1::TrainerReport> reports;
  // step -> loss, from the metrics reports.
  std::map<int64_t, double> losses;
};

void ParseReports(TrainerRun& run) {
  for (absl::string_view line : absl::StrSplit(run.output, '\n')) {
    if (!absl::StartsWith(line, "{")) continue;
    v1::TrainerReport report;
    if (!google::protobuf::util::JsonStringToMessage(std::string(line), &report).ok()) continue;
    if (report.has_metrics()) run.losses[report.metrics().step()] = report.metrics().loss();
    run.reports.push_back(std::move(report));
  }
}

class TrainerTrainingTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    data_dir_ = new std::string(MakeTempDir("data"));
    auto prepared = RunCommand({Trainer(), "prepare", "--input=" + CorpusPath(),
                                "--output_dir=" + *data_dir_, "--val_fraction=0.05"});
    ASSERT_THAT(prepared, IsOk());
    ASSERT_EQ(prepared->exit.exit_code, 0) << prepared->output;
  }

  static std::string Trainer() { return BinDir() + "/tessera-trainer"; }
  static std::string CorpusPath() { return TESSERA_CORPUS_FILE; }

  static std::string MakeTempDir(const std::string& name) {
    std::string pattern = absl::StrCat(::testing::TempDir(), "tessera-", name, "-XXXXXX");
    std::vector<char> buffer(pattern.begin(), pattern.end());
    buffer.push_back('\0');
    char* dir = mkdtemp(buffer.data());
    EXPECT_NE(dir, nullptr);
    return dir;
  }

  // decay_steps pins the schedule, so a run of fewer steps follows the same
  // learning-rate curve as a longer one (stop/resume compares the two).
  static std::vector<std::string> BaseFlags(int steps, const std::string& checkpoint_dir = "",
                                            int decay_steps = 0) {
    std::vector<std::string> flags = {Trainer(),
                                      "--data=" + *data_dir_ + "/train-*.bin",
                                      "--preset=tiny-gpt2",
                                      "--seq_len=64",
                                      "--global_batch=8",
                                      "--micro_batch=2",
                                      "--lr=3e-3",
                                      "--warmup=5",
                                      absl::StrCat("--steps=", steps),
                                      absl::StrCat("--decay_steps=", decay_steps),
                                      "--seed=7"};
    if (!checkpoint_dir.empty()) flags.push_back("--checkpoint_dir=" + checkpoint_dir);
    return flags;
  }

  static TrainerRun RunTrainer(const std::vector<std::string>& argv) {
    TrainerRun run;
    auto result = RunCommand(argv, absl::Minutes(5));
    EXPECT_THAT(result, IsOk());
    if (!result.ok()) return run;
    run.exit_code = result->exit.exit_code;
    run.output = result->output;
    ParseReports(run);
    return run;
  }

  static std::string* data_dir_;
};

std::string* TrainerTrainingTest::data_dir_ = nullptr;

TEST_F(TrainerTrainingTest, LossFallsWellBelowUniform) {
  TrainerRun run = RunTrainer(BaseFlags(300));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  ASSERT_EQ(run.losses.size(), 300u);
  // 257 byte-level tokens: a uniform guess costs ln(257) = 5.55 nats.
  EXPECT_NEAR(run.losses.at(1), std::log(257.0), 0.5);
  double tail = 0;
  for (int64_t step = 291; step <= 300; ++step) tail += run.losses.at(step) / 10;
  EXPECT_LT(tail, 2.6) << "mean loss of the last 10 steps";
  bool finished = false;
  for (const auto& report : run.reports) finished |= report.has_finished();
  EXPECT_TRUE(finished);
}

TEST_F(TrainerTrainingTest, TwoDataParallelProcessesMatchOneProcess) {
  const int steps = 12;
  std::string single_dir = MakeTempDir("ckpt-single"), dp_dir = MakeTempDir("ckpt-dp");
  TrainerRun single = RunTrainer(BaseFlags(steps, single_dir));
  ASSERT_EQ(single.exit_code, 0) << single.output;

  // Two real processes, Gloo over loopback, global batch unchanged.
  int port = 29000 + static_cast<int>(getpid() % 2000);
  std::vector<Subprocess> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    auto process = Subprocess::Start(
        BaseFlags(steps, dp_dir),
        {.merge_stdout = true,
         .extra_env = {absl::StrCat("RANK=", rank), "WORLD_SIZE=2",
                       absl::StrCat("LOCAL_RANK=", rank), "LOCAL_WORLD_SIZE=2",
                       "MASTER_ADDR=127.0.0.1", absl::StrCat("MASTER_PORT=", port)}});
    ASSERT_THAT(process, IsOk());
    ranks.push_back(std::move(*process));
  }
  std::vector<TrainerRun> runs(2);
  for (int rank = 0; rank < 2; ++rank) {
    auto exit = ranks[rank].Wait(absl::Minutes(5));
    ASSERT_THAT(exit, IsOk());
    runs[rank].exit_code = exit->exit_code;
    runs[rank].output = ranks[rank].stderr_text();
    ParseReports(runs[rank]);
    ASSERT_EQ(exit->exit_code, 0) << "rank " << rank << ":\n" << runs[rank].output;
  }
  // Rank 0 reports the all-reduced loss of each step.
  ASSERT_EQ(runs[0].losses.size(), static_cast<size_t>(steps));
  double max_difference = 0;
  for (int64_t step = 1; step <= steps; ++step) {
    // Same samples, same math; only the order of float32 additions differs
    // (per-rank means, then the all-reduce; bucketed gradient sums), which
    // moves the 6th-7th significant digit and compounds a little over steps.
    EXPECT_NEAR(runs[0].losses.at(step), single.losses.at(step), 1e-4) << "step " << step;
    max_difference =
        std::max(max_difference, std::abs(runs[0].losses.at(step) - single.losses.at(step)));
  }
  RecordProperty("max_loss_difference", std::to_string(max_difference));
  std::cout << "dp=2 vs dp=1: max |loss difference| over " << steps << " steps = " << max_difference
            << "\n";

  // Parameters are identical on both ranks after training.
  std::string last = absl::StrCat(dp_dir, "/step-", std::string(8 - 2, '0'), steps);
  v1::ModelSpec spec;
  spec.set_preset("tiny-gpt2");
  auto summary = planner::ResolveModel(spec, 64);
  ASSERT_THAT(summary, IsOk());
  std::vector<trainer::CausalLM> models;
  for (int rank = 0; rank < 2; ++rank) {
    torch::serialize::InputArchive archive, model_archive;
    archive.load_from(absl::StrCat(last, "/rank-0000", rank, ".pt"));
    archive.read("model", model_archive);
    models.emplace_back(summary->dims(), 0.02);
    models.back()->load(model_archive);
  }
  auto rank0 = models[0]->named_parameters();
  auto rank1 = models[1]->named_parameters();
  ASSERT_EQ(rank0.size(), rank1.size());
  ASSERT_GT(rank0.size(), 0u);
  for (const auto& item : rank0) {
    EXPECT_TRUE(torch::equal(item.value(), rank1[item.key()])) << item.key();
  }
  // And they moved away from the shared initialisation: training happened.
  trainer::CausalLM fresh(summary->dims(), 0.02);
  EXPECT_FALSE(torch::equal(rank0["embed.weight"], fresh->named_parameters()["embed.weight"]));
}

TEST_F(TrainerTrainingTest, StopAndResumeEqualsAnUninterruptedRun) {
  const int n = 10;
  TrainerRun straight = RunTrainer(BaseFlags(2 * n, "", 2 * n));
  ASSERT_EQ(straight.exit_code, 0) << straight.output;

  // Train n steps (checkpoint at the end), stop, then train on to 2n.
  std::string dir = MakeTempDir("ckpt-resume");
  TrainerRun first = RunTrainer(BaseFlags(n, dir, 2 * n));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  for (int64_t step = 1; step <= n; ++step) {
    EXPECT_NEAR(first.losses.at(step), straight.losses.at(step), 1e-5) << "step " << step;
  }
  TrainerRun resumed = RunTrainer(BaseFlags(2 * n, dir, 2 * n));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("resumed from"));
  ASSERT_EQ(resumed.losses.size(), static_cast<size_t>(n));
  for (int64_t step = n + 1; step <= 2 * n; ++step) {
    EXPECT_NEAR(resumed.losses.at(step), straight.losses.at(step), 1e-5) << "step " << step;
  }
}

TEST_F(TrainerTrainingTest, TruncatedShardIsRefusedByName) {
  std::string dir = MakeTempDir("bad-data");
  std::string shard = dir + "/train-00000.bin";
  fs::copy_file(*data_dir_ + "/train-00000.bin", shard);
  fs::resize_file(shard, fs::file_size(shard) - 1000);
  std::vector<std::string> flags = BaseFlags(5);
  flags[1] = "--data=" + shard;
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

TEST_F(TrainerTrainingTest, EvaluatesOnHeldOutShards) {
  std::vector<std::string> flags = BaseFlags(60);
  flags.push_back("--val_data=" + *data_dir_ + "/val-*.bin");
  flags.push_back("--eval_every=20");
  flags.push_back("--eval_batches=4");
  TrainerRun run = RunTrainer(flags);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  std::vector<v1::EvalMetrics> evals;
  for (const auto& report : run.reports) {
    if (report.has_eval()) evals.push_back(report.eval());
  }
  ASSERT_EQ(evals.size(), 3u) << run.output;
  EXPECT_EQ(evals[0].step(), 20);
  EXPECT_EQ(evals[2].step(), 60);
  for (const auto& eval : evals) {
    EXPECT_NEAR(eval.perplexity(), std::exp(eval.loss()), 1e-9 * eval.perplexity());
    // 4 micro-batches x 2 sequences x 64 tokens.
    EXPECT_EQ(eval.tokens(), 4 * 2 * 64);
  }
  EXPECT_LT(evals[2].loss(), evals[0].loss()) << "held-out loss should fall with training";
}

TEST_F(TrainerTrainingTest, DivergenceIsReportedAsNanLoss) {
  // A learning rate of 1e4 without clipping blows the weights up within steps.
  std::vector<std::string> flags = BaseFlags(20);
  flags.push_back("--lr=1e4");
  flags.push_back("--warmup=0");
  flags.push_back("--grad_clip=0");
  TrainerRun run = RunTrainer(flags);
  EXPECT_EQ(run.exit_code, 1);
  bool typed = false;
  for (const auto& report : run.reports) {
    typed |= report.has_failure() && report.failure().kind() == v1::FAILURE_KIND_NAN_LOSS;
  }
  EXPECT_TRUE(typed) << "no NAN_LOSS failure report in:\n" << run.output;
  EXPECT_LT(run.losses.size(), 20u);
}

TEST_F(TrainerTrainingTest, CorruptedCheckpointIsSkippedByName) {
  std::string dir = MakeTempDir("ckpt-corrupt");
  std::vector<std::string> flags = BaseFlags(4, dir);
  flags.push_back("--checkpoint_every=2");
  TrainerRun first = RunTrainer(flags);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  // Flip a byte in the newest checkpoint's shard.
  std::string shard = dir + "/step-00000004/rank-00000.pt";
  {
    std::fstream file(shard, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(100);
    char byte = 0;
    file.read(&byte, 1);
    file.seekp(100);
    byte = static_cast<char>(~byte);
    file.write(&byte, 1);
  }
  flags = BaseFlags(6, dir);
  TrainerRun resumed = RunTrainer(flags);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr(shard));
  EXPECT_THAT(resumed.output, HasSubstr("sha256 mismatch"));
  EXPECT_THAT(resumed.output, HasSubstr("step-00000002"));
  EXPECT_EQ(resumed.losses.begin()->first, 3) << "should resume after step 2";
}

}  // namespace
}  // namespace tessera

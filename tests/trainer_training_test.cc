// Runs real tessera-trainer processes on the bundled corpus (CPU, Gloo) and checks the training
// loop's promises: the loss falls, two data-parallel processes follow the single-process curve,
// and held-out evaluation reports its loss and tokens. The fixture is trainer_training_fixture.h;
// resume (trainer_resume_test.cc), parallel layouts (trainer_parallel_test.cc), failures
// (trainer_failure_test.cc) and the GPU checks (trainer_gpu_test.cc) have files of their own.

#include <cmath>
#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/v1/trainer.pb.h"
#include "tests/trainer_training_fixture.h"

namespace tessera {
namespace {

using ::tessera::testing::TrainerRun;
using ::tessera::testing::TrainerTrainingTest;

// Every rank reports each step's RankStepMetrics with where its time went: forward and
// backward measured, the gradient all-reduce over dp counted, and the phases plus other adding up
// to the step's wall time.
void ExpectRankStepBreakdowns(const TrainerRun& run, int rank, int64_t steps) {
  int64_t reported = 0;
  for (const v1::TrainerReport& report : run.reports) {
    if (!report.has_rank_step()) continue;
    ++reported;
    const v1::RankStepMetrics& r = report.rank_step();
    EXPECT_EQ(report.rank(), rank);
    EXPECT_EQ(r.step(), reported);
    EXPECT_GT(r.step_time_seconds(), 0);
    EXPECT_GT(r.peak_memory_bytes(), 0);
    const v1::StepTimeBreakdown& b = r.breakdown();
    EXPECT_GT(b.forward_seconds(), 0) << "rank " << rank << " step " << r.step();
    EXPECT_GT(b.backward_seconds(), 0) << "rank " << rank << " step " << r.step();
    EXPECT_GT(b.optimizer_seconds(), 0) << "rank " << rank << " step " << r.step();
    const double sum = b.forward_seconds() + b.backward_seconds() + b.optimizer_seconds() +
                       b.data_wait_seconds() + b.checkpoint_blocked_seconds() + b.other_seconds();
    EXPECT_NEAR(sum, r.step_time_seconds(), 0.01 * r.step_time_seconds())
        << "rank " << rank << " step " << r.step();
    bool dp_all_reduce = false;
    for (const v1::CollectiveTime& c : b.collectives()) {
      EXPECT_GT(c.calls(), 0);
      if (c.kind() == "all_reduce" && c.dim() == "dp") {
        dp_all_reduce = true;
        EXPECT_GT(c.seconds(), 0);
        EXPECT_GT(c.bytes(), 0);
        // The gradient buckets' all-reduces overlap (several in flight), each counting from its
        // issue: their sum may exceed the step's wall time, never the calls times it.
        EXPECT_LE(c.seconds(), static_cast<double>(c.calls()) * r.step_time_seconds());
      }
    }
    EXPECT_TRUE(dp_all_reduce) << "rank " << rank << " step " << r.step() << ": "
                               << b.ShortDebugString();
  }
  EXPECT_EQ(reported, steps) << "rank " << rank;
}

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
  std::vector<TrainerRun> runs = RunRanks(BaseFlags(steps, dp_dir), 2);
  ASSERT_EQ(runs.size(), 2u);
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_EQ(runs[rank].exit_code, 0) << "rank " << rank << ":\n" << runs[rank].output;
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
  for (int rank = 0; rank < 2; ++rank) ExpectRankStepBreakdowns(runs[rank], rank, steps);
  // Rank 0's job metrics carry its breakdown too, and its log the summary.
  for (const v1::TrainerReport& report : runs[0].reports) {
    if (report.has_metrics()) {
      EXPECT_TRUE(report.metrics().has_breakdown());
    }
  }
  EXPECT_THAT(runs[0].output, ::testing::HasSubstr("| all_reduce/dp "));
  RecordProperty("max_loss_difference", std::to_string(max_difference));
  std::cout << "dp=2 vs dp=1: max |loss difference| over " << steps << " steps = " << max_difference
            << "\n";
}

TEST_F(TrainerTrainingTest, EvaluatesOnHeldOutShards) {
  std::vector<std::string> flags = BaseFlags(60);
  flags.push_back(Shards("data.validation_shards", *data_dir_ + "/val-*.bin"));
  flags.push_back("--set=data.eval_interval_steps=20");
  flags.push_back("--set=data.eval_batches=4");
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

}  // namespace
}  // namespace tessera

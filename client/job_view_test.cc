#include "client/job_view.h"

#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"

namespace tessera::client {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::Not;

v1::CollectiveTime Collective(const char* kind, const char* dim, double seconds, int64_t calls,
                              int64_t bytes) {
  v1::CollectiveTime c;
  c.set_kind(kind);
  c.set_dim(dim);
  c.set_seconds(seconds);
  c.set_calls(calls);
  c.set_bytes(bytes);
  return c;
}

// A 0.5 s step: forward 0.1, backward 0.2, optimizer 0.05, data 0.025, other 0.125.
v1::StepTimeBreakdown HalfSecondBreakdown() {
  v1::StepTimeBreakdown b;
  b.set_forward_seconds(0.1);
  b.set_backward_seconds(0.2);
  b.set_optimizer_seconds(0.05);
  b.set_data_wait_seconds(0.025);
  b.set_other_seconds(0.125);
  // Out of order on purpose: the view sorts by time.
  *b.add_collectives() = Collective("all_gather", "tp", 0.02, 24, 3 * 1024);
  *b.add_collectives() = Collective("all_reduce", "dp", 0.15, 12, 48 * 1024 * 1024);
  return b;
}

v1::StepMetrics Step(int64_t step, double seconds) {
  v1::StepMetrics m;
  m.set_step(step);
  m.set_step_time_seconds(seconds);
  m.set_loss(3.0);
  return m;
}

// The line of `text` that starts (after its indent) with `prefix`; "" when none does.
std::string LineStartingWith(const std::string& text, const std::string& prefix) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    const size_t start = line.find_first_not_of(' ');
    if (start != absl::string_view::npos && line.substr(start).rfind(prefix, 0) == 0) {
      return std::string(line);
    }
  }
  return "";
}

TEST(JobViewTest, BlockShowsPhasesAsSecondsAndShareOfTheStep) {
  v1::StepMetrics m = Step(120, 0.5);
  *m.mutable_breakdown() = HalfSecondBreakdown();
  const std::string block = TimeBreakdownBlock(m);
  EXPECT_THAT(block, HasSubstr("Where the time goes (rank 0, step 120, 0.500 s)"));
  EXPECT_THAT(LineStartingWith(block, "forward"), HasSubstr("0.100 s   20.0%"));
  EXPECT_THAT(LineStartingWith(block, "backward"), HasSubstr("0.200 s   40.0%"));
  EXPECT_THAT(LineStartingWith(block, "optimizer"), HasSubstr("0.050 s   10.0%"));
  EXPECT_THAT(LineStartingWith(block, "data wait"), HasSubstr("0.025 s    5.0%"));
  EXPECT_THAT(LineStartingWith(block, "checkpoint blocked"), HasSubstr("0.000 s    0.0%"));
  EXPECT_THAT(LineStartingWith(block, "other"), HasSubstr("0.125 s   25.0%"));
  // Largest collective first, with calls and bytes.
  const std::string all_reduce = LineStartingWith(block, "all_reduce/dp");
  EXPECT_THAT(all_reduce, HasSubstr("0.150 s   30.0%  12 calls  48.0 MiB"));
  EXPECT_THAT(LineStartingWith(block, "all_gather/tp"), HasSubstr("24 calls  3.0 KiB"));
  EXPECT_LT(block.find("all_reduce/dp"), block.find("all_gather/tp"));
}

TEST(JobViewTest, BlockFallsBackToThePhasesSumAndFoldsTheTail) {
  // No step time in the report: percentages of the phases' sum (0.5 s).
  v1::StepMetrics m = Step(7, 0);
  *m.mutable_breakdown() = HalfSecondBreakdown();
  for (int i = 0; i < kTopCollectives; ++i) {
    *m.mutable_breakdown()->add_collectives() = Collective("send_recv", "pp", 0.001, 1, 10);
  }
  const std::string block = TimeBreakdownBlock(m);
  EXPECT_THAT(block, HasSubstr("step 7, 0.500 s"));
  EXPECT_THAT(LineStartingWith(block, "backward"), HasSubstr("40.0%"));
  // 7 collectives: the top 5, then the other 2 (0.002 s) on one line.
  EXPECT_THAT(LineStartingWith(block, "2 more"), HasSubstr("0.002 s    0.4%"));
}

TEST(JobViewTest, NothingWithoutABreakdown) {
  // An older trainer: no breakdown at all, or an empty one.
  v1::StepMetrics m = Step(5, 0.5);
  EXPECT_EQ(TimeBreakdownBlock(m), "");
  EXPECT_EQ(BreakdownSummary(m), "");
  m.mutable_breakdown();
  EXPECT_EQ(TimeBreakdownBlock(m), "");
  v1::StragglerReport straggler;
  v1::RankStepTime* rank = straggler.add_ranks();
  rank->set_rank(0);
  rank->set_node_id("n1");
  rank->set_step_seconds(0.5);
  rank->set_busy_seconds(0.4);
  EXPECT_EQ(RankBreakdownTable(straggler), "");
  v1::Job cpu_job;
  cpu_job.add_placements()->set_gpu_index(-1);
  EXPECT_FALSE(HoldsGpus(cpu_job));
  EXPECT_EQ(GpuTable(cpu_job), "");
}

TEST(JobViewTest, RankTableShowsEachRanksShares) {
  v1::StragglerReport straggler;
  v1::RankStepTime* r0 = straggler.add_ranks();
  r0->set_rank(0);
  r0->set_node_id("node-a");
  r0->set_step_seconds(0.5);
  r0->set_busy_seconds(0.35);
  *r0->mutable_breakdown() = HalfSecondBreakdown();
  // Rank 1's worker predates breakdowns: its row has figures but no shares.
  v1::RankStepTime* r1 = straggler.add_ranks();
  r1->set_rank(1);
  r1->set_node_id("a-much-longer-node");
  r1->set_step_seconds(0.5);
  r1->set_busy_seconds(0.45);
  const std::string table = RankBreakdownTable(straggler);
  EXPECT_THAT(table, HasSubstr("fwd%"));
  const std::string row0 = LineStartingWith(table, "0  node-a");
  EXPECT_THAT(row0, HasSubstr("0.500    0.350   20.0   40.0   10.0    5.0  all_reduce/dp 0.150 s"));
  const std::string row1 = LineStartingWith(table, "1  a-much-longer-node");
  EXPECT_THAT(row1, HasSubstr("0.500    0.450      -      -      -      -  -"));
  // The node column is as wide as the longest node id: the columns line up.
  EXPECT_EQ(row0.find("0.500"), row1.find("0.500"));
}

TEST(JobViewTest, WatchSummaryIsOneCompactLine) {
  v1::StepMetrics m = Step(3, 0.5);
  *m.mutable_breakdown() = HalfSecondBreakdown();
  EXPECT_EQ(BreakdownSummary(m),
            "fwd 20% bwd 40% opt 10% data 5% other 25% | top all_reduce/dp 30%");
  // Checkpoint blocking shows on the steps it hits.
  m.mutable_breakdown()->set_checkpoint_blocked_seconds(0.05);
  m.mutable_breakdown()->set_other_seconds(0.075);
  EXPECT_THAT(BreakdownSummary(m), HasSubstr("data 5% ckpt 10% other 15%"));
  m.mutable_breakdown()->clear_collectives();
  EXPECT_THAT(BreakdownSummary(m), Not(HasSubstr("top")));
}

// A job on four GPUs: ranks 0 and 1 on gpu-a's GPUs 0 and 1 (H100s), rank 2 on gpu-b's GPU 0
// (no product name), rank 3 on GPU 3 of a node no longer listed.
struct GpuJob {
  v1::Job job;
  std::vector<v1::Node> nodes;
};
GpuJob FourGpuRanks() {
  GpuJob out;
  out.job.set_job_id("job-00000001");
  auto place = [&](int rank, const char* node, int gpu) {
    v1::RankPlacement* p = out.job.add_placements();
    p->set_rank(rank);
    p->set_node_id(node);
    p->set_gpu_index(gpu);
  };
  place(0, "gpu-a", 0);
  place(1, "gpu-a", 1);
  place(2, "gpu-b", 0);
  place(3, "gone", 3);
  out.nodes.resize(2);
  out.nodes[0].set_node_id("gpu-a");
  for (int i = 0; i < 2; ++i) {
    v1::GpuDevice* gpu = out.nodes[0].mutable_resources()->add_gpus();
    gpu->set_index(i);
    gpu->set_uuid(i == 0 ? "GPU-aaaa" : "GPU-bbbb");
    gpu->set_name("NVIDIA H100 80GB HBM3");
  }
  out.nodes[1].set_node_id("gpu-b");
  v1::GpuDevice* gpu = out.nodes[1].mutable_resources()->add_gpus();
  gpu->set_index(0);
  gpu->set_uuid("GPU-cccc");
  return out;
}

TEST(JobViewTest, GpuTableJoinsPlacementsWithTheNodesInventory) {
  const auto [placed, nodes] = FourGpuRanks();
  ASSERT_TRUE(HoldsGpus(placed));
  const v1::Job job = WithGpuIdentity(placed, nodes);
  const std::string table = GpuTable(job);
  EXPECT_THAT(LineStartingWith(table, "0  gpu-a"), HasSubstr("0  GPU-aaaa  NVIDIA H100 80GB HBM3"));
  EXPECT_THAT(LineStartingWith(table, "1  gpu-a"), HasSubstr("1  GPU-bbbb"));
  EXPECT_THAT(LineStartingWith(table, "2  gpu-b"), HasSubstr("0  GPU-cccc"));
  // Rank 2 is on gpu-b's GPU 0, not gpu-a's.
  EXPECT_THAT(LineStartingWith(table, "2  gpu-b"), Not(HasSubstr("GPU-aaaa")));
  // A node no longer listed: the index, and "?" for the UUID.
  EXPECT_THAT(LineStartingWith(table, "3  gone"), HasSubstr("3  ?"));
}

// The devices a placement names are kept (the coordinator recorded them when it placed the
// ranks); only unnamed ones are looked up. The job stays a v1.Job: its JSON is protobuf's, which
// a strict parser reads back whole.
TEST(JobViewTest, TheJobWithItsGpusIsAPlainJobThatAStrictJsonParserReads) {
  auto [job, nodes] = FourGpuRanks();
  job.set_job_id("job-00000001");
  job.mutable_placements(1)->set_gpu_uuid("GPU-recorded");
  job.mutable_placements(1)->set_gpu_name("NVIDIA H200");
  const v1::Job named = WithGpuIdentity(job, nodes);
  EXPECT_EQ(named.placements(0).gpu_uuid(), "GPU-aaaa");
  EXPECT_EQ(named.placements(0).gpu_name(), "NVIDIA H100 80GB HBM3");
  EXPECT_EQ(named.placements(1).gpu_uuid(), "GPU-recorded");
  EXPECT_EQ(named.placements(1).gpu_name(), "NVIDIA H200");
  EXPECT_EQ(named.placements(2).gpu_uuid(), "GPU-cccc");
  EXPECT_EQ(named.placements(3).gpu_uuid(), "");

  std::string json;
  ASSERT_TRUE(google::protobuf::util::MessageToJsonString(named, &json).ok());
  v1::Job parsed;
  google::protobuf::util::JsonParseOptions strict;
  strict.ignore_unknown_fields = false;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json, &parsed, strict).ok()) << json;
  EXPECT_EQ(parsed.placements(0).gpu_uuid(), "GPU-aaaa");
  EXPECT_EQ(parsed.job_id(), "job-00000001");
}

TEST(JobViewTest, ExpertLoadShowsTheMeanAndWorstLayerAndItsBusiestExperts) {
  v1::StepMetrics metrics;
  metrics.set_step(12);
  EXPECT_EQ(ExpertLoadBlock(metrics), "") << "a dense model";
  const int64_t tokens[3][4] = {{2, 2, 2, 2}, {1, 5, 0, 2}, {3, 2, 2, 1}};
  const double imbalance[3] = {1.0, 2.5, 1.5};
  for (int layer = 0; layer < 3; ++layer) {
    v1::ExpertLoad* load = metrics.add_expert_load();
    load->set_layer(layer);
    for (int64_t t : tokens[layer]) load->add_tokens(t);
    load->set_imbalance(imbalance[layer]);
  }
  const std::string block = ExpertLoadBlock(metrics);
  EXPECT_THAT(block, HasSubstr("experts (step 12): imbalance (busiest expert / mean) 1.67 mean "
                               "over 3 layers, 2.50 worst in layer 1"));
  EXPECT_THAT(block, HasSubstr("layer 1's busiest experts, by share of its 8 slots: 1 (62%), "
                               "3 (25%), 0 (12%)"));
  // Points from the stored curve keep each layer's imbalance, not the counts.
  for (v1::ExpertLoad& load : *metrics.mutable_expert_load()) load.clear_tokens();
  EXPECT_THAT(ExpertLoadBlock(metrics), Not(HasSubstr("busiest experts")));
  EXPECT_THAT(ExpertLoadBlock(metrics), HasSubstr("2.50 worst in layer 1"));
}

TEST(JobViewTest, RollbacksShowTheSpikeTheResumeAndTheSkippedData) {
  v1::Job job;
  EXPECT_EQ(RollbackBlock(job), "") << "no guard, no block";
  job.mutable_spec()->mutable_guard()->set_max_rollbacks(2);
  EXPECT_EQ(RollbackBlock(job), "  rollbacks: 0 of 2\n");
  v1::Rollback* rollback = job.add_rollbacks();
  rollback->mutable_spike()->set_step(12);
  rollback->mutable_spike()->set_loss(310.2);
  rollback->mutable_spike()->set_loss_median(2.41);
  rollback->mutable_spike()->set_cause("loss 310.2 at step 12 > 3 x median 2.41");
  rollback->set_resume_step(10);
  rollback->mutable_skipped()->set_step(12);
  rollback->mutable_skipped()->set_batches(4);
  EXPECT_EQ(RollbackLine(*rollback),
            "rollback after step 12 (loss 310.2, window median 2.41): resumes from step 10, "
            "skips 4 global batch(es) at step 12: loss 310.2 at step 12 > 3 x median 2.41");
  v1::Rollback* bare = job.add_rollbacks();
  bare->mutable_spike()->set_step(20);
  bare->mutable_spike()->set_cause("loss spike at step 20");
  bare->mutable_skipped()->set_step(20);
  bare->mutable_skipped()->set_batches(1);
  const std::string block = RollbackBlock(job);
  EXPECT_THAT(block, HasSubstr("  rollbacks: 2 of 2\n    rollback after step 12 (loss"));
  EXPECT_THAT(block, HasSubstr("    rollback after step 20: resumes from step 0, skips 1"));
}

}  // namespace
}  // namespace tessera::client

// The pipeline schedules' order of operations without tensors: plain 1F1B for one chunk per
// stage, Megatron-Core's interleaved assignment for several, every send matched by the receive
// its peer posts in the same order, no stage waiting on one that waits on it (the stages are
// simulated with blocking receives and posted sends, as PipelineSchedule runs them), the
// activations in flight, and the bubble of a uniform-cost model against Narayanan et al.'s
// (p - 1) / (v m). Also the refusals of a layout the schedule cannot run.
#include <algorithm>
#include <deque>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "trainer/parallel/pipeline.h"
#include "trainer/parallel/pipeline_parallelism.h"

namespace tessera::trainer {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::StatusIs;
using ::testing::HasSubstr;
using Kind = PipelineOp::Kind;

// "F<chunk>.<micro-batch>" / "B<chunk>.<micro-batch>" for the computations, in order.
std::string ComputeOrder(const std::vector<PipelineOp>& ops) {
  std::vector<std::string> out;
  for (const PipelineOp& op : ops) {
    if (op.kind == Kind::kForward) out.push_back(absl::StrCat("F", op.chunk, ".", op.micro_batch));
    if (op.kind == Kind::kBackward) {
      out.push_back(absl::StrCat("B", op.chunk, ".", op.micro_batch));
    }
  }
  return absl::StrJoin(out, " ");
}

TEST(InterleavedPipelineOpsTest, OneChunkIsPlainOneFOneB) {
  for (int p : {2, 3, 4}) {
    for (int m : {1, 2, 3, 8}) {
      for (int s = 0; s < p; ++s) {
        // PipelineSchedule::Train's order: min(p - s - 1, m) warm-up forwards, then one forward
        // and one backward, then the remaining backwards.
        const int warmup = std::min(p - s - 1, m);
        std::vector<std::string> expected;
        for (int i = 0; i < warmup; ++i) expected.push_back(absl::StrCat("F0.", i));
        for (int i = 0; i < m - warmup; ++i) {
          expected.push_back(absl::StrCat("F0.", i + warmup));
          expected.push_back(absl::StrCat("B0.", i));
        }
        for (int i = m - warmup; i < m; ++i) expected.push_back(absl::StrCat("B0.", i));
        EXPECT_EQ(ComputeOrder(InterleavedPipelineOps(p, s, 1, m)), absl::StrJoin(expected, " "))
            << "p " << p << " stage " << s << " m " << m;
      }
    }
  }
}

TEST(InterleavedPipelineOpsTest, TwoStagesTwoChunksOrder) {
  // p 2, v 2, m 4: forwards take micro-batches in groups of p through chunk 0 then chunk 1;
  // backwards the same groups through chunk 1 then chunk 0. Stage 0 warms up with 1 + 2
  // forwards, stage 1 with 0 + 2.
  EXPECT_EQ(ComputeOrder(InterleavedPipelineOps(2, 0, 2, 4)),
            "F0.0 F0.1 F1.0 F1.1 B1.0 F0.2 B1.1 F0.3 B0.0 F1.2 B0.1 F1.3 B1.2 B1.3 B0.2 B0.3");
  EXPECT_EQ(ComputeOrder(InterleavedPipelineOps(2, 1, 2, 4)),
            "F0.0 F0.1 F1.0 B1.0 F1.1 B1.1 F0.2 B0.0 F0.3 B0.1 F1.2 B1.2 F1.3 B1.3 B0.2 B0.3");
  // Stage 0's chunk 1 (the model's chunk 2) receives from stage 1's chunk 0 across the wrap;
  // stage 1's chunk 1 (the model's last) computes the loss and sends nothing forward.
  const std::vector<PipelineOp> ops = InterleavedPipelineOps(2, 0, 2, 4);
  EXPECT_EQ(ops[0], (PipelineOp{Kind::kForward, 0, 0, -1}));
  EXPECT_EQ(ops[1], (PipelineOp{Kind::kSendActivation, 0, 0, 1}));
  for (const PipelineOp& op : InterleavedPipelineOps(2, 1, 2, 4)) {
    EXPECT_FALSE(op.kind == Kind::kSendActivation && op.chunk == 1) << op.ToString();
    EXPECT_FALSE(op.kind == Kind::kReceiveGradient && op.chunk == 1) << op.ToString();
  }
}

// A run of every stage's operations: compute costs one unit, messages arrive at once; a
// receive blocks until its peer's matching send ran.
struct Simulation {
  bool finished = false;
  std::string stuck;           // the operations the stages were blocked at, when not finished
  int makespan = 0;            // time units until the last stage finished
  std::vector<int> idle;       // per stage: makespan - its busy units
  std::vector<int> in_flight;  // per stage: most forwards whose backward had not run yet
  std::vector<std::string> errors;
};

Simulation Simulate(int p, int v, int m) {
  std::vector<std::vector<PipelineOp>> ops;
  for (int s = 0; s < p; ++s) ops.push_back(InterleavedPipelineOps(p, s, v, m));
  // (from, to, is_gradient) -> FIFO of (model chunk, micro-batch, time sent), as c10d matches a
  // peer's sends of one tag in order.
  std::map<std::tuple<int, int, bool>, std::deque<std::tuple<int, int, int>>> channels;
  std::vector<size_t> next(p, 0);
  std::vector<int> clock(p, 0), busy(p, 0), alive(p, 0);
  Simulation sim;
  sim.in_flight.assign(p, 0);
  bool progress = true;
  while (progress) {
    progress = false;
    for (int s = 0; s < p; ++s) {
      while (next[s] < ops[s].size()) {
        const PipelineOp& op = ops[s][next[s]];
        const int model_chunk = op.chunk * p + s;
        if (op.kind == Kind::kReceiveActivation || op.kind == Kind::kReceiveGradient) {
          const bool gradient = op.kind == Kind::kReceiveGradient;
          auto& channel = channels[{op.peer, s, gradient}];
          if (channel.empty()) break;  // blocked until the peer sends
          const auto [sent_chunk, sent_mb, time] = channel.front();
          channel.pop_front();
          const int expected_chunk = gradient ? model_chunk + 1 : model_chunk - 1;
          if (sent_chunk != expected_chunk || sent_mb != op.micro_batch) {
            sim.errors.push_back(absl::StrCat("stage ", s, " ", op.ToString(), " got chunk ",
                                              sent_chunk, " mb ", sent_mb));
          }
          clock[s] = std::max(clock[s], time);
        } else if (op.kind == Kind::kSendActivation || op.kind == Kind::kSendGradient) {
          channels[{s, op.peer, op.kind == Kind::kSendGradient}].emplace_back(
              model_chunk, op.micro_batch, clock[s]);
        } else {
          clock[s] += 1;
          busy[s] += 1;
          alive[s] += op.kind == Kind::kForward ? 1 : -1;
          sim.in_flight[s] = std::max(sim.in_flight[s], alive[s]);
        }
        ++next[s];
        progress = true;
      }
    }
  }
  sim.finished = true;
  for (int s = 0; s < p; ++s) {
    if (next[s] < ops[s].size()) {
      sim.finished = false;
      sim.stuck += absl::StrCat(" stage ", s, " at ", ops[s][next[s]].ToString());
    }
  }
  for (const auto& [key, channel] : channels) {
    if (!channel.empty()) {
      sim.errors.push_back(absl::StrCat(channel.size(), " sends from stage ", std::get<0>(key),
                                        " to ", std::get<1>(key), " never received"));
    }
  }
  sim.makespan = *std::max_element(clock.begin(), clock.end());
  for (int s = 0; s < p; ++s) sim.idle.push_back(sim.makespan - busy[s]);
  return sim;
}

TEST(InterleavedPipelineOpsTest, MatchedDeadlockFreeAndIdealBubble) {
  for (int p : {2, 3, 4}) {
    for (int v : {1, 2, 3, 4}) {
      for (int groups : {1, 2, 3, 5}) {
        const int m = groups * p;
        SCOPED_TRACE(absl::StrCat("p ", p, " v ", v, " m ", m));
        const Simulation sim = Simulate(p, v, m);
        ASSERT_TRUE(sim.finished) << "deadlock:" << sim.stuck;
        EXPECT_THAT(sim.errors, ::testing::IsEmpty());
        // Each stage computes 2 m v chunk passes (a forward and a backward of each chunk and
        // micro-batch); the fill and drain leave 2 (p - 1) of them idle, so the bubble is
        // (p - 1) / (v m) of the ideal time.
        const int ideal = 2 * m * v;
        for (int s = 0; s < p; ++s) {
          EXPECT_EQ(sim.idle[s], 2 * (p - 1)) << "stage " << s;
          EXPECT_DOUBLE_EQ(static_cast<double>(sim.idle[s]) / ideal,
                           static_cast<double>(p - 1) / (v * m));
          // The warm-up's forwards and one more are alive at once (all of them when fewer).
          EXPECT_EQ(sim.in_flight[s], std::min(m * v, (p - s - 1) + (v - 1) * p + 1))
              << "stage " << s;
        }
        EXPECT_EQ(sim.makespan, ideal + 2 * (p - 1));
      }
    }
  }
}

TEST(InterleavedPipelineOpsTest, OneChunkRunsAnyMicroBatchCount) {
  for (int m : {1, 3, 5, 7}) {
    const Simulation sim = Simulate(4, 1, m);
    ASSERT_TRUE(sim.finished) << "m " << m << ":" << sim.stuck;
    EXPECT_THAT(sim.errors, ::testing::IsEmpty());
    EXPECT_EQ(sim.makespan, 2 * m + 2 * 3);
  }
}

TEST(PipelineSplitsTest, VirtualStagesOfTheLayout) {
  v1::Layout layout;
  EXPECT_EQ(VirtualStagesOf(layout), 1);
  layout.set_pipeline_virtual_stages(3);
  EXPECT_EQ(VirtualStagesOf(layout), 3);
}

}  // namespace
}  // namespace tessera::trainer

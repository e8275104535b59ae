// The planner's expert, context and interleaved pipeline parallelism: long sequences that fit only
// when split over context-parallel ranks, a mixture of experts whose memory per device drops by
// the expert share under expert parallelism, and the interleaved bubble (pp-1)/(v x m).
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/devices.h"
#include "planner/job_plan.h"
#include "planner/layout_planner.h"
#include "planner/model_config.h"

namespace tessera::planner {
namespace {

using ::testing::HasSubstr;

v1::ModelDims Preset(const std::string& name) {
  v1::ModelSpec spec;
  spec.set_preset(name);
  auto summary = ResolveModel(spec, 1);
  EXPECT_TRUE(summary.ok()) << summary.status();
  return summary->dims();
}

ClusterShape Cluster(const std::string& device, int gpus, int per_node) {
  ClusterShape c;
  c.device = *DevicePreset(device);
  c.gpus = gpus;
  c.gpus_per_node = per_node;
  return c;
}

Workload Work(v1::ModelDims dims, int seq, int64_t batch) {
  Workload w;
  w.dims = std::move(dims);
  w.seq_len = seq;
  w.global_batch = batch;
  return w;
}

// Whether a layout of context-parallel degree `cp` is among the fitting candidates of `result`.
bool AnyFits(const SearchResult& result, int cp) {
  return std::any_of(
      result.candidates.begin(), result.candidates.end(), [&](const v1::LayoutCandidate& x) {
        return x.plan().fits() && std::max(1, x.plan().layout().context_parallel()) == cp;
      });
}

TEST(LayoutSplitTest, LongSequencesFitOnlyWhenContextParallel) {
  // qwen3-14b on 262,144-token sequences over 8 x H200: even tp 8 with sequence parallelism and
  // full recomputation holds 262,144 x 5120 float32 layer inputs per layer and vocab-parallel
  // logits of every token; splitting the sequence over cp ranks divides both.
  const Workload w = Work(Preset("qwen3-14b"), 262144, 8);
  const ClusterShape c = Cluster("h200", 8, 8);
  SearchLimits no_cp;
  no_cp.max_cp = 1;
  const SearchResult without = SearchLayouts(w, c, no_cp);
  EXPECT_EQ(without.fitting, 0);
  const v1::LayoutPlan closest = ChoosePlan(without, c);
  EXPECT_FALSE(closest.fits());
  EXPECT_THAT(closest.explanation(), HasSubstr("No layout fits"));

  const SearchResult with = SearchLayouts(w, c, SearchLimits{});
  ASSERT_GT(with.fitting, 0);
  const v1::LayoutPlan plan = ChoosePlan(with, c);
  ASSERT_TRUE(plan.fits()) << plan.explanation();
  const int cp = plan.layout().context_parallel();
  EXPECT_GT(cp, 1);
  EXPECT_EQ(plan.world_size(), 8);
  EXPECT_EQ(plan.layout().data_parallel() * plan.layout().tensor_parallel() *
                plan.layout().pipeline_parallel() * cp,
            8);
  EXPECT_GT(plan.memory().context_ring_bytes(), 0);
  EXPECT_GT(plan.step_time().context_ring_seconds(), 0);
  EXPECT_THAT(plan.explanation(), HasSubstr(absl::StrCat("cp=", cp)));
  EXPECT_THAT(plan.explanation(),
              HasSubstr(absl::StrCat("context_parallel ", cp, ": without it no layout fits")));
}

TEST(LayoutSplitTest, ContextParallelIsChosenAtLongContextWhenItIsFaster) {
  // qwen3-32b at 131,072 tokens fits 8 x H200 without cp only as tp 8 with full recomputation,
  // close to the limit; splitting the sequence instead is estimated faster, and the plan says by
  // how much.
  const Workload w = Work(Preset("qwen3-32b"), 131072, 8);
  const ClusterShape c = Cluster("h200", 8, 8);
  SearchLimits no_cp;
  no_cp.max_cp = 1;
  const SearchResult without = SearchLayouts(w, c, no_cp);
  ASSERT_EQ(without.fitting, 1);
  const v1::LayoutPlan only = without.candidates[0].plan();
  EXPECT_EQ(only.layout().tensor_parallel(), 8);
  EXPECT_EQ(only.layout().activation_checkpointing_mode(), v1::ACTIVATION_CHECKPOINTING_FULL);

  const SearchResult with = SearchLayouts(w, c, SearchLimits{});
  EXPECT_TRUE(AnyFits(with, 1));
  const v1::LayoutPlan plan = ChoosePlan(with, c);
  ASSERT_TRUE(plan.fits());
  EXPECT_GT(plan.layout().context_parallel(), 1);
  EXPECT_GT(plan.step_time().tokens_per_second(), only.step_time().tokens_per_second());
  EXPECT_THAT(plan.explanation(), HasSubstr("faster than the fastest layout without it"));
}

TEST(LayoutSplitTest, ContextParallelDividesActivationsAndAddsRingTraffic) {
  const Workload w = Work(Preset("qwen3-8b"), 32768, 8);
  const ClusterShape c = Cluster("h200", 8, 8);
  LayoutChoice plain{8, 1, 1, 0, 1, false, v1::ACTIVATION_CHECKPOINTING_NONE};
  LayoutChoice split = plain;
  split.dp = 2;
  split.cp = 4;
  ASSERT_FALSE(InvalidReason(w, split, c).has_value());
  const v1::MemoryEstimate a = EstimateMemory(w, plain, c)[0];
  const v1::MemoryEstimate b = EstimateMemory(w, split, c)[0];
  // A layer's activations for one micro-batch are linear in its tokens (flash attention).
  EXPECT_NEAR(static_cast<double>(b.activations_per_layer_bytes()),
              a.activations_per_layer_bytes() / 4.0, 0.001 * a.activations_per_layer_bytes());
  // Ring buffers: K/V and their gradients, send and receive: 4 x 2 x kv_heads 8 x head_dim 128 x
  // 8192 tokens x 2 bytes.
  EXPECT_EQ(b.context_ring_bytes(), 4 * 2 * 8 * 128 * 8192 * 2);
  EXPECT_EQ(a.context_ring_bytes(), 0);
  const v1::StepTimeEstimate ta = EstimateStepTime(w, plain, c);
  const v1::StepTimeEstimate tb = EstimateStepTime(w, split, c);
  // Per layer, three passes (forward, and keys/values then their gradients in backward) of
  // cp - 1 hops; 4 micro-batches per step at dp 2.
  const double block = 2.0 * 8 * 128 * 8192 * 2;
  const double hop = block / c.device.intra_node_bandwidth() + 20e-6;
  EXPECT_NEAR(tb.context_ring_seconds(), 4 * 36 * 3 * 3 * hop, 1e-9);
  EXPECT_EQ(ta.context_ring_seconds(), 0);
  // The same model FLOPs either way.
  EXPECT_DOUBLE_EQ(ta.model_flops(), tb.model_flops());
}

TEST(LayoutSplitTest, MixtureOfExpertsChoosesExpertParallelismAndSavesTheExpertShare) {
  // qwen3-30b-a3b on 8 x H200 with ZeRO at most 1 (what the trainer runs next to model splits)
  // and no pipeline stages: 30.5B parameters of float32 weights and gradients are 244 GB per
  // replica, but 29.0B of them are routed experts, which ep splits.
  const Workload w = Work(Preset("qwen3-30b-a3b"), 4096, 64);
  const ClusterShape c = Cluster("h200", 8, 8);
  SearchLimits limits;
  limits.max_zero = 1;
  // Pipeline stages split the experts too (each stage holds its layers' experts): without ep a
  // layout fits with pp, which the search may then prefer.
  SearchLimits staged_limits = limits;
  staged_limits.max_ep = 1;
  const v1::LayoutPlan staged = ChoosePlan(SearchLayouts(w, c, staged_limits), c);
  ASSERT_TRUE(staged.fits()) << staged.explanation();
  EXPECT_GT(staged.layout().pipeline_parallel(), 1);
  EXPECT_GT(staged.memory().expert_state_bytes(), 0);
  // Without pipeline stages (and tensor splits, which also divide the experts:
  // MixtureOfExpertsSplitsItsExpertsOverEpTimesTp), ep is what makes it fit.
  limits.max_pp = 1;
  limits.max_tp = 1;
  SearchLimits no_ep = limits;
  no_ep.max_ep = 1;
  EXPECT_EQ(SearchLayouts(w, c, no_ep).fitting, 0);
  const SearchResult result = SearchLayouts(w, c, limits);
  const v1::LayoutPlan plan = ChoosePlan(result, c);
  ASSERT_TRUE(plan.fits()) << plan.explanation();
  const int ep = plan.layout().expert_parallel();
  EXPECT_GT(ep, 1);
  EXPECT_THAT(plan.explanation(),
              HasSubstr(absl::StrCat("expert_parallel ", ep, ": without it no layout fits")));
  EXPECT_GT(plan.memory().expert_all_to_all_bytes(), 0);
  EXPECT_GT(plan.step_time().expert_all_to_all_seconds(), 0);

  // The same layout without ep: the expert state grows by ep, and the rest stays.
  LayoutChoice chosen = FromProto(plan.layout(), plan.micro_batch_size());
  LayoutChoice replicated = chosen;
  replicated.ep = 1;
  const v1::MemoryEstimate split = EstimateMemory(w, chosen, c)[0];
  const v1::MemoryEstimate whole = EstimateMemory(w, replicated, c)[0];
  const int64_t expert_parameters = int64_t{48} * 128 * 3 * 2048 * 768;
  EXPECT_EQ(whole.parameters() - split.parameters(), expert_parameters - expert_parameters / ep);
  // Float32 weights and gradients (8 bytes) plus AdamW moments (8 bytes) sharded by ZeRO-1 over
  // the dp / ep ranks holding the same experts.
  const int zero = plan.layout().zero_stage();
  const int64_t dp = plan.layout().data_parallel();
  auto expert_state = [&](int64_t experts, int64_t holders) {
    return 8 * experts + (zero >= 1 ? (8 * experts + holders - 1) / holders : 8 * experts);
  };
  EXPECT_EQ(whole.expert_state_bytes(), expert_state(expert_parameters, dp));
  EXPECT_EQ(split.expert_state_bytes(), expert_state(expert_parameters / ep, dp / ep));
  // Everything but the experts' state is the same: the router and attention stay replicated.
  EXPECT_EQ(whole.weights_bytes() + whole.gradients_bytes() + whole.optimizer_bytes() -
                whole.expert_state_bytes(),
            split.weights_bytes() + split.gradients_bytes() + split.optimizer_bytes() -
                split.expert_state_bytes());
  EXPECT_LT(split.total_bytes(), whole.total_bytes());
  EXPECT_GE(whole.total_bytes() - split.total_bytes(),
            whole.expert_state_bytes() - split.expert_state_bytes());
  // Compute follows the 3.35B active parameters, not the 30.5B.
  EXPECT_NEAR(
      EstimateStepTime(w, chosen, c).model_flops(),
      (6.0 * CountActiveParameters(w.dims) + AttentionFlopsPerToken(w.dims, 4096)) * 4096 * 64,
      1e3);
}

TEST(LayoutSplitTest, MixtureOfExpertsSplitsItsExpertsOverEpTimesTp) {
  const Workload w = Work(Preset("qwen3-30b-a3b"), 4096, 64);
  const ClusterShape c = Cluster("h200", 8, 8);
  // Each rank holds num_experts / ep experts of moe_intermediate_size / tp width: the expert
  // parameters per rank are the model's / (ep x tp), in every combination.
  const int64_t expert_parameters = int64_t{48} * 128 * 3 * 2048 * 768;
  const LayoutChoice base{.dp = 4, .tp = 2, .zero = 1, .micro_batch = 1, .ep = 2};
  for (const auto& [tp, ep] :
       {std::pair{1, 1}, std::pair{2, 1}, std::pair{2, 2}, std::pair{4, 2}, std::pair{8, 1}}) {
    SCOPED_TRACE(absl::StrCat("tp ", tp, " ep ", ep));
    LayoutChoice l = base;
    l.tp = tp;
    l.ep = ep;
    l.dp = 8 / tp;
    if (l.dp % ep != 0) continue;
    const v1::MemoryEstimate mem = EstimateMemory(w, l, c)[0];
    // Float32 weights and gradients (8 bytes) plus AdamW moments (8 bytes) sharded by ZeRO-1 over
    // the dp / ep ranks holding the same experts.
    const int64_t local = expert_parameters / (ep * tp);
    const int64_t holders = l.dp / ep;
    EXPECT_EQ(mem.expert_state_bytes(), 8 * local + (8 * local + holders - 1) / holders);
  }
  // The router stays whole on every tp rank; the attention and the shared parts split.
  LayoutChoice one = base, two = base;
  one.tp = 1;
  one.dp = 8;
  two.dp = 4;
  const int64_t router = int64_t{48} * 128 * 2048;
  const int64_t whole = EstimateMemory(w, one, c)[0].parameters();
  const int64_t split = EstimateMemory(w, two, c)[0].parameters();
  EXPECT_GT(split, (whole - router) / 2 + router - 1e6);
  EXPECT_LT(split, (whole - router) / 2 + router + 1e6);

  // `parallelism: auto` may split a mixture of experts over tp: without ep and pipeline stages,
  // tp is what makes qwen3-30b-a3b fit on 8 x H200 with ZeRO at most 1.
  SearchLimits limits;
  limits.max_zero = 1;
  limits.max_pp = 1;
  limits.max_ep = 1;
  SearchLimits no_tp = limits;
  no_tp.max_tp = 1;
  EXPECT_EQ(SearchLayouts(w, c, no_tp).fitting, 0);
  const v1::LayoutPlan plan = ChoosePlan(SearchLayouts(w, c, limits), c);
  ASSERT_TRUE(plan.fits()) << plan.explanation();
  EXPECT_GT(plan.layout().tensor_parallel(), 1);
}

TEST(LayoutSplitTest, InterleavingShrinksTheBubbleToPpMinusOneOverVm) {
  // qwen3-8b's 36 layers over pp 4: 9 per stage, in v = 3 chunks of 3.
  const Workload w = Work(Preset("qwen3-8b"), 4096, 16);
  const ClusterShape c = Cluster("h200", 8, 8);
  LayoutChoice plain{2, 1, 4, 0, 1, false, v1::ACTIVATION_CHECKPOINTING_NONE};  // m = 8
  LayoutChoice interleaved = plain;
  interleaved.v = 3;
  ASSERT_FALSE(InvalidReason(w, interleaved, c).has_value());
  const v1::StepTimeEstimate a = EstimateStepTime(w, plain, c);
  const v1::StepTimeEstimate b = EstimateStepTime(w, interleaved, c);
  EXPECT_NEAR(a.pipeline_bubble_fraction(), 3.0 / 8, 1e-12);
  EXPECT_NEAR(b.pipeline_bubble_fraction(), 3.0 / (3 * 8), 1e-12);
  // The bubble is that fraction of the micro-batches' busy time.
  const double busy = b.compute_seconds() + b.tensor_parallel_seconds();
  EXPECT_NEAR(b.pipeline_bubble_seconds(), 3.0 / 24 * busy, 1e-9);
  EXPECT_NEAR(a.pipeline_bubble_seconds(), 3 * b.pipeline_bubble_seconds(), 1e-9);
  // Three times the pipeline messages: 2 x v x (m + pp - 1) transfers.
  EXPECT_NEAR(b.pipeline_transfer_seconds(), 3 * a.pipeline_transfer_seconds(), 1e-12);
  // Megatron's warm-up: the first stage holds 2 x 3 + 2 x 4 + 1 = 15 chunks of 3 layers (45
  // layer micro-batches) against 1F1B's 4 micro-batches of 9 layers (36).
  const v1::MemoryEstimate ma = EstimateMemory(w, plain, c)[0];
  const v1::MemoryEstimate mb = EstimateMemory(w, interleaved, c)[0];
  EXPECT_EQ(ma.activations_bytes() - ma.activations_per_layer_bytes() * 36,
            mb.activations_bytes() - mb.activations_per_layer_bytes() * 45);
  // The last stage: 2 x 0 + 2 x 4 + 1 = 9 chunks, 27 layer micro-batches against 1F1B's 9.
  const v1::MemoryEstimate la = EstimateMemory(w, plain, c)[3];
  const v1::MemoryEstimate lb = EstimateMemory(w, interleaved, c)[3];
  EXPECT_EQ(lb.activations_bytes() - la.activations_bytes(), 18 * la.activations_per_layer_bytes());
}

TEST(LayoutSplitTest, SearchInterleavesWhenItShrinksTheBubble) {
  // Few micro-batches per step make the bubble large: qwen3-8b on 8 x H200 with pipeline stages
  // only (tp 1, pp 8: 36 layers do not split in 8, so pp 4 x dp 2), global batch 16.
  const Workload w = Work(Preset("qwen3-8b"), 4096, 16);
  const ClusterShape c = Cluster("h200", 8, 8);
  SearchLimits limits;
  limits.max_tp = 1;
  limits.max_cp = 1;
  limits.max_zero = 0;
  limits.micro_batch = 1;
  const SearchResult result = SearchLayouts(w, c, limits);
  const v1::LayoutPlan plan = ChoosePlan(result, c);
  ASSERT_TRUE(plan.fits()) << plan.explanation();
  ASSERT_GT(plan.layout().pipeline_parallel(), 1) << plan.explanation();
  const int v = plan.layout().pipeline_virtual_stages();
  EXPECT_GT(v, 1) << plan.explanation();
  const int m = plan.gradient_accumulation_steps();
  EXPECT_NEAR(plan.step_time().pipeline_bubble_fraction(),
              (plan.layout().pipeline_parallel() - 1.0) / (v * m), 1e-12);
  EXPECT_THAT(plan.explanation(), HasSubstr(absl::StrCat("pipeline_virtual_stages ", v, ": ")));
  EXPECT_THAT(plan.explanation(), HasSubstr("faster than the fastest layout without it"));
}

TEST(LayoutSplitTest, JobSpecLimitsAndWhatTheTrainerRunsApply) {
  v1::JobSpec spec;
  spec.mutable_model()->set_preset("qwen3-14b");
  spec.mutable_data()->set_seq_len(262144);
  spec.mutable_batch()->set_global_batch_size(8);
  spec.mutable_resources()->set_gpus(8);
  JobPlanOptions options;
  options.device = *DevicePreset("h200");
  options.devices_per_node = 8;
  options.runnable_only = true;
  // Context-parallel ranks shard with the data-parallel ones, so the trainer's layouts include
  // cp with ZeRO 3, and the long sequence fits.
  absl::StatusOr<JobPlan> planned = PlanJobSpec(spec, options);
  ASSERT_TRUE(planned.ok()) << planned.status();
  ASSERT_TRUE(planned->plan.fits()) << planned->plan.explanation();
  EXPECT_GT(planned->plan.layout().context_parallel(), 1);
  EXPECT_TRUE(CheckTrainerRuns(planned->plan.layout()).ok());
  // max_context_parallel 1 keeps every candidate unsplit, and then nothing fits.
  spec.mutable_parallelism()->mutable_auto_layout()->set_max_context_parallel(1);
  planned = PlanJobSpec(spec, options);
  ASSERT_TRUE(planned.ok()) << planned.status();
  EXPECT_FALSE(planned->plan.fits());
  for (const v1::LayoutCandidate& x : planned->candidates) {
    EXPECT_LE(x.plan().layout().context_parallel(), 1);
  }
  spec.mutable_parallelism()->mutable_auto_layout()->set_max_expert_parallel(-1);
  EXPECT_EQ(PlanJobSpec(spec, options).status().code(), absl::StatusCode::kInvalidArgument);

  // A mixture of experts: never context-parallel in what the trainer runs, and ep next to ZeRO 0
  // or 1 only.
  v1::JobSpec moe;
  moe.mutable_model()->set_preset("qwen3-30b-a3b");
  moe.mutable_data()->set_seq_len(4096);
  moe.mutable_batch()->set_global_batch_size(64);
  moe.mutable_resources()->set_gpus(8);
  planned = PlanJobSpec(moe, options);
  ASSERT_TRUE(planned.ok()) << planned.status();
  EXPECT_TRUE(planned->plan.fits()) << planned->plan.explanation();
  for (const v1::LayoutCandidate& x : planned->candidates) {
    const v1::Layout& l = x.plan().layout();
    EXPECT_LE(l.context_parallel(), 1) << x.ShortDebugString();
    if (l.expert_parallel() > 1) {
      EXPECT_LE(l.zero_stage(), 1) << x.ShortDebugString();
    }
  }
  v1::Layout layout;
  layout.set_data_parallel(8);
  layout.set_tensor_parallel(1);
  layout.set_pipeline_parallel(1);
  layout.set_expert_parallel(2);
  layout.set_zero_stage(2);
  const absl::Status refused = CheckTrainerRuns(layout);
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(refused.message()),
              HasSubstr("parallelism.layout.zero_stage: 2 with expert_parallel 2"));
  layout.set_expert_parallel(1);
  layout.set_context_parallel(2);
  layout.set_data_parallel(4);
  EXPECT_TRUE(CheckTrainerRuns(layout).ok());
}

}  // namespace
}  // namespace tessera::planner

#include "planner/layout_rules.h"

#include <string>

#include "gtest/gtest.h"

namespace tessera::planner {
namespace {

v1::ModelDims Dims(int heads, int kv_heads, int ffn, int layers) {
  v1::ModelDims dims;
  dims.set_num_attention_heads(heads);
  dims.set_num_kv_heads(kv_heads);
  dims.set_ffn_hidden_size(ffn);
  dims.set_num_layers(layers);
  return dims;
}

TEST(LayoutRulesTest, DegreesThatDivideEveryDimensionPass) {
  const v1::ModelDims dims = Dims(32, 8, 14336, 32);
  for (int tp : {1, 2, 4, 8}) {
    for (int pp : {1, 2, 4, 8, 16, 32}) {
      EXPECT_FALSE(CheckModelDivisibility(dims, tp, pp).has_value()) << tp << " " << pp;
    }
  }
}

TEST(LayoutRulesTest, EachBrokenRuleNamesItsFieldAndDimension) {
  const auto text = [](const v1::ModelDims& dims, int tp, int pp) {
    const auto violation = CheckModelDivisibility(dims, tp, pp);
    return violation ? violation->ToString() : std::string("ok");
  };
  EXPECT_EQ(text(Dims(12, 12, 3072, 12), 8, 1),
            "parallelism.layout.tensor_parallel: 8 does not divide the model's "
            "num_attention_heads 12");
  EXPECT_EQ(text(Dims(32, 8, 14336, 32), 16, 1),
            "parallelism.layout.tensor_parallel: 16 does not divide the model's num_kv_heads 8");
  EXPECT_EQ(text(Dims(32, 8, 11004, 32), 8, 1),
            "parallelism.layout.tensor_parallel: 8 does not divide the model's "
            "ffn_hidden_size 11004");
  EXPECT_EQ(text(Dims(32, 8, 14336, 32), 1, 3),
            "parallelism.layout.pipeline_parallel: 3 does not divide the model's num_layers 32");
  // Tensor parallelism is checked first.
  EXPECT_EQ(CheckModelDivisibility(Dims(12, 12, 3072, 12), 8, 5)->field,
            "parallelism.layout.tensor_parallel");
}

TEST(LayoutRulesTest, MixtureOfExpertsSplitsItsExpertsOverTensorRanks) {
  v1::ModelDims dims = Dims(32, 8, 14336, 32);
  dims.set_num_experts(8);
  EXPECT_FALSE(CheckModelDivisibility(dims, 1, 1).has_value());
  // moe_intermediate_size 0 stands for ffn_hidden_size.
  EXPECT_FALSE(CheckModelDivisibility(dims, 2, 1).has_value());
  EXPECT_FALSE(CheckModelDivisibility(dims, 8, 2).has_value());
  // The experts' width is what tp splits, not the (unused) dense ffn_hidden_size.
  dims.set_ffn_hidden_size(11003);
  dims.set_moe_intermediate_size(768);
  EXPECT_FALSE(CheckModelDivisibility(dims, 8, 1).has_value());
  dims.set_moe_intermediate_size(1001);
  auto tp = CheckModelDivisibility(dims, 2, 1);
  ASSERT_TRUE(tp.has_value());
  EXPECT_EQ(tp->ToString(),
            "parallelism.layout.tensor_parallel: 2 does not divide the model's "
            "moe_intermediate_size 1001");
  dims.set_moe_intermediate_size(768);
  dims.set_shared_expert_intermediate_size(1004);
  EXPECT_FALSE(CheckModelDivisibility(dims, 4, 1).has_value());
  tp = CheckModelDivisibility(dims, 8, 1);
  ASSERT_TRUE(tp.has_value());
  EXPECT_EQ(tp->ToString(),
            "parallelism.layout.tensor_parallel: 8 does not divide the model's "
            "shared_expert_intermediate_size 1004");
  // Every stage holds MoE blocks and its layers' share of the router loss.
  EXPECT_FALSE(CheckModelDivisibility(dims, 1, 2).has_value());
  // The pipeline split of the layers still applies.
  const auto pp = CheckModelDivisibility(dims, 1, 3);
  ASSERT_TRUE(pp.has_value());
  EXPECT_EQ(pp->field, "parallelism.layout.pipeline_parallel");
}

std::string SplitText(const v1::ModelDims& dims, int seq_len, SplitDegrees degrees) {
  const auto violation = CheckSplitRules(dims, seq_len, degrees);
  return violation ? violation->ToString() : std::string("ok");
}

TEST(LayoutRulesTest, ContextExpertAndVirtualStageDegreesThatFitPass) {
  v1::ModelDims moe = Dims(32, 8, 14336, 32);
  moe.set_num_experts(64);
  // Unset degrees mean 1; cp 4 splits 4096 tokens into 8 chunks of 512; ep 8 of dp 16 holds 8
  // experts per rank; v 4 gives each of 2 stages 4 chunks of 4 layers.
  EXPECT_EQ(SplitText(moe, 4096, {.data_parallel = 16, .pipeline_parallel = 1}), "ok");
  EXPECT_EQ(SplitText(moe, 4096,
                      {.data_parallel = 16,
                       .pipeline_parallel = 2,
                       .expert_parallel = 8,
                       .pipeline_virtual_stages = 4}),
            "ok");
  v1::ModelDims dense = moe;
  dense.set_num_experts(0);
  EXPECT_EQ(SplitText(dense, 4096,
                      {.data_parallel = 16,
                       .pipeline_parallel = 2,
                       .context_parallel = 4,
                       .pipeline_virtual_stages = 4}),
            "ok");
  // The trainer does not run context parallelism on a mixture of experts: refused here, for the
  // coordinator, the layout search and the trainer alike.
  EXPECT_EQ(SplitText(moe, 4096, {.data_parallel = 16, .context_parallel = 4}),
            "parallelism.layout.context_parallel: 4 with a mixture-of-experts model (64 experts) "
            "is not supported: the routers' load-balancing loss would count only a rank's part of "
            "each sequence; use 1");
  // Sequence parallelism splits the tokens each rank holds over tp, with or without cp.
  EXPECT_EQ(SplitText(dense, 4094, {.tensor_parallel = 4, .sequence_parallel = true}),
            "parallelism.layout.sequence_parallel: data.seq_len 4094 is not divisible by "
            "tensor_parallel 4 (sequence parallelism splits each sequence over tp)");
}

TEST(LayoutRulesTest, EachBrokenSplitRuleNamesItsField) {
  const v1::ModelDims dense = Dims(32, 8, 14336, 32);
  v1::ModelDims moe = dense;
  moe.set_num_experts(12);
  EXPECT_EQ(SplitText(dense, 4096, {.context_parallel = -1}),
            "parallelism.layout.context_parallel: must be >= 0 (0 means 1), got -1");
  EXPECT_EQ(SplitText(dense, 4096, {.expert_parallel = -2}),
            "parallelism.layout.expert_parallel: must be >= 0 (0 means 1), got -2");
  EXPECT_EQ(SplitText(dense, 4096, {.pipeline_virtual_stages = -3}),
            "parallelism.layout.pipeline_virtual_stages: must be >= 0 (0 means 1), got -3");
  // seq_len 4100 = 4 x 1025: divisible by cp 2 but not by 2 x cp.
  EXPECT_EQ(SplitText(dense, 4100, {.context_parallel = 2}), "ok");
  EXPECT_EQ(SplitText(dense, 4100, {.context_parallel = 4}),
            "parallelism.layout.context_parallel: 4: 2 x context_parallel (8) does not divide "
            "data.seq_len 4100 (each sequence is split into 2 x cp causal chunks)");
  EXPECT_EQ(SplitText(dense, 4096, {.data_parallel = 4, .expert_parallel = 2}),
            "parallelism.layout.expert_parallel: 2 with a dense model (num_experts 0): expert "
            "parallelism splits a mixture of experts; use 1");
  EXPECT_EQ(SplitText(moe, 4096, {.data_parallel = 8, .expert_parallel = 8}),
            "parallelism.layout.expert_parallel: 8 does not divide the model's num_experts 12");
  EXPECT_EQ(SplitText(moe, 4096, {.data_parallel = 6, .expert_parallel = 4}),
            "parallelism.layout.expert_parallel: 4 does not divide data_parallel 6 (experts are "
            "split inside the data-parallel group)");
  EXPECT_EQ(SplitText(dense, 4096, {.pipeline_parallel = 1, .pipeline_virtual_stages = 2}),
            "parallelism.layout.pipeline_virtual_stages: 2 needs pipeline_parallel > 1, got "
            "pipeline_parallel 1");
  EXPECT_EQ(SplitText(dense, 4096, {.pipeline_parallel = 4, .pipeline_virtual_stages = 3}),
            "parallelism.layout.pipeline_virtual_stages: 3 does not divide the 8 layers of each "
            "pipeline stage (num_layers 32 / pipeline_parallel 4)");
  // Sequence parallelism splits each context-parallel rank's 4100 / 2 = 2050 tokens over tp.
  EXPECT_EQ(SplitText(dense, 4100,
                      {.context_parallel = 2, .tensor_parallel = 2, .sequence_parallel = true}),
            "ok");
  EXPECT_EQ(SplitText(dense, 4100,
                      {.context_parallel = 2, .tensor_parallel = 4, .sequence_parallel = true}),
            "parallelism.layout.sequence_parallel: tensor_parallel 4 does not divide the 2050 "
            "tokens of each context-parallel rank (data.seq_len 4100 / context_parallel 2)");
  // The interleaved schedule runs micro-batches in groups of pp.
  EXPECT_EQ(
      SplitText(
          dense, 4096,
          {.pipeline_parallel = 4, .pipeline_virtual_stages = 2, .micro_batches_per_step = 8}),
      "ok");
  EXPECT_EQ(
      SplitText(
          dense, 4096,
          {.pipeline_parallel = 4, .pipeline_virtual_stages = 2, .micro_batches_per_step = 6}),
      "parallelism.layout.pipeline_virtual_stages: 2 needs the micro-batches per step (6 = "
      "global batch / (micro-batch x data_parallel)) to be a multiple of pipeline_parallel "
      "4");
}

}  // namespace
}  // namespace tessera::planner

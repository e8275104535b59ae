// LoRA's targets and defaults (planner/lora.h), and the planner's memory for a LoRA spec.
#include "planner/lora.h"

#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/job_plan.h"
#include "planner/devices.h"
#include "planner/model_config.h"

namespace tessera::planner {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

v1::ModelDims Dims(const std::string& preset) {
  v1::ModelSpec spec;
  spec.set_preset(preset);
  auto summary = ResolveModel(spec, 64);
  EXPECT_TRUE(summary.ok()) << summary.status();
  return summary->dims();
}

std::vector<std::string> Modules(const ResolvedLora& lora) {
  std::vector<std::string> out;
  for (const LoraTarget& t : lora.targets) out.push_back(t.module);
  return out;
}

TEST(LoraTest, EmptyTargetsMeanEveryLinearLayer) {
  v1::LoraSpec spec;
  spec.set_rank(8);
  const v1::ModelDims llama = Dims("llama3-8b");
  auto lora_or = ResolveLora(spec, llama);
  ASSERT_TRUE(lora_or.ok()) << lora_or.status();
  const ResolvedLora lora = *lora_or;
  EXPECT_EQ(lora.alpha, 16);  // 2 * rank
  EXPECT_THAT(Modules(lora), ElementsAre("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate",
                                         "mlp.up", "mlp.down"));
  EXPECT_THAT(lora.peft_target_modules, ElementsAre("q_proj", "k_proj", "v_proj", "o_proj",
                                                    "gate_proj", "up_proj", "down_proj"));
  // Llama 3 8B: d 4096, q 4096, kv 1024, ffn 14336.
  EXPECT_EQ(lora.parameters_per_layer,
            8 * ((4096 + 4096) + 2 * (4096 + 1024) + (4096 + 4096) + 2 * (4096 + 14336) +
                 (14336 + 4096)));
}

TEST(LoraTest, TargetsByLeafNamePathOrTesseraName) {
  v1::LoraSpec spec;
  spec.set_rank(4);
  spec.set_alpha(32);
  spec.set_dropout(0.05);
  spec.add_target_modules("q_proj");
  spec.add_target_modules("self_attn.v_proj");
  spec.add_target_modules("mlp.down");
  auto lora_or = ResolveLora(spec, Dims("tiny-llama"));
  ASSERT_TRUE(lora_or.ok()) << lora_or.status();
  const ResolvedLora lora = *lora_or;
  EXPECT_THAT(Modules(lora), ElementsAre("attn.q", "attn.v", "mlp.down"));
  EXPECT_EQ(lora.alpha, 32);
  EXPECT_DOUBLE_EQ(lora.dropout, 0.05);
}

TEST(LoraTest, Gpt2CProjNamesBothUnlessQualified) {
  v1::LoraSpec spec;
  spec.set_rank(2);
  spec.add_target_modules("c_proj");
  auto both_or = ResolveLora(spec, Dims("tiny-gpt2"));
  ASSERT_TRUE(both_or.ok()) << both_or.status();
  const ResolvedLora both = *both_or;
  EXPECT_THAT(Modules(both), ElementsAre("attn.proj", "mlp.proj"));
  // PEFT matches by suffix: the parent keeps the two apart.
  EXPECT_THAT(both.peft_target_modules, ElementsAre("attn.c_proj", "mlp.c_proj"));
  spec.set_target_modules(0, "attn.c_proj");
  auto one_or = ResolveLora(spec, Dims("tiny-gpt2"));
  ASSERT_TRUE(one_or.ok()) << one_or.status();
  const ResolvedLora one = *one_or;
  EXPECT_THAT(Modules(one), ElementsAre("attn.proj"));
}

TEST(LoraTest, BadSpecsNameTheField) {
  const v1::ModelDims llama = Dims("tiny-llama");
  v1::LoraSpec spec;
  EXPECT_THAT(ResolveLora(spec, llama),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lora.rank: must be > 0")));
  spec.set_rank(4);
  spec.set_dropout(1);
  EXPECT_THAT(ResolveLora(spec, llama), StatusIs(absl::StatusCode::kInvalidArgument,
                                                 HasSubstr("lora.dropout: must be in [0, 1)")));
  spec.set_dropout(0);
  spec.set_alpha(-1);
  EXPECT_THAT(ResolveLora(spec, llama),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lora.alpha")));
  spec.set_alpha(0);
  spec.add_target_modules("c_attn");  // GPT-2's, not Llama's
  EXPECT_THAT(ResolveLora(spec, llama),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("lora.target_modules: 'c_attn' is not a linear layer of a "
                                 "Llama block; known: q_proj")));
}

TEST(LoraTest, Nf4BaseNeedsAdapters) {
  const v1::ModelDims llama = Dims("tiny-llama");
  v1::LoraSpec spec;
  spec.set_base_quantization(v1::LORA_BASE_QUANTIZATION_NF4);
  EXPECT_THAT(ResolveLora(spec, llama),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("lora.base_quantization: NF4 quantizes the frozen base under "
                                 "LoRA adapters and needs lora.rank > 0, got 0")));
  spec.set_base_quantization(static_cast<v1::LoraBaseQuantization>(7));
  spec.set_rank(4);
  EXPECT_THAT(ResolveLora(spec, llama),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("lora.base_quantization: unknown value 7")));
  spec.set_base_quantization(v1::LORA_BASE_QUANTIZATION_NF4);
  auto lora = ResolveLora(spec, llama);
  ASSERT_THAT(lora, IsOk());
  EXPECT_TRUE(lora->base_nf4);
  v1::ModelDims moe = llama;
  moe.set_num_experts(4);
  moe.set_num_experts_per_token(2);
  moe.set_moe_intermediate_size(llama.ffn_hidden_size());
  // The experts are quantized too (each expert's projections on their own).
  auto moe_lora = ResolveLora(spec, moe);
  ASSERT_THAT(moe_lora, IsOk());
  EXPECT_TRUE(moe_lora->base_nf4);
  EXPECT_EQ(Nf4ExpertLayerBytes(moe, 2),
            2 * 3 * Nf4WeightBytes(llama.hidden_size() * llama.ffn_hidden_size()));
  EXPECT_EQ(Nf4ExpertLayerBytes(llama, 1), 0);
}

// qwen3-30b-a3b under QLoRA at dp8 x ep8: each rank holds 16 of the 128 experts of each layer, in
// NF4 (4.127 bits a weight instead of bf16's 16), and 1/8 of the experts' adapters.
TEST(LoraTest, PlannerCountsNf4ExpertsAndShardedExpertAdapters) {
  v1::JobSpec spec;
  spec.mutable_model()->set_preset("qwen3-30b-a3b");
  spec.mutable_data()->set_seq_len(2048);
  spec.mutable_batch()->set_global_batch_size(16);
  spec.mutable_batch()->set_micro_batch_size(1);
  spec.set_precision(v1::PRECISION_BF16);
  spec.mutable_resources()->set_gpus(8);
  spec.mutable_lora()->set_rank(8);
  v1::Layout* layout = spec.mutable_parallelism()->mutable_layout();
  layout->set_data_parallel(8);
  layout->set_expert_parallel(8);
  layout->set_zero_stage(1);
  JobPlanOptions options;
  options.device = *DevicePreset("h200");
  options.devices_per_node = 8;
  auto lora = PlanJobSpec(spec, options);
  ASSERT_THAT(lora, IsOk());
  spec.mutable_lora()->set_base_quantization(v1::LORA_BASE_QUANTIZATION_NF4);
  auto qlora = PlanJobSpec(spec, options);
  ASSERT_THAT(qlora, IsOk());
  const v1::ModelDims dims = Dims("qwen3-30b-a3b");
  const int64_t layers = dims.num_layers(), d = dims.hidden_size();
  const int64_t w = dims.moe_intermediate_size(), local = dims.num_experts() / 8;
  auto resolved = ResolveLora(spec.lora(), dims);
  ASSERT_THAT(resolved, IsOk());
  const int64_t expert_adapters = ExpertLoraLayerParameters(*resolved);
  EXPECT_EQ(expert_adapters, int64_t{8} * 3 * (d + w) * dims.num_experts());
  // The routed experts' frozen state (bf16 under LoRA, NF4 under QLoRA) and their adapters' 1/8
  // (float32 weight, gradient and two moments, over edp 1).
  const int64_t adapter_state = 16 * layers * expert_adapters / 8;
  EXPECT_EQ(lora->plan.memory().expert_state_bytes(),
            layers * local * 3 * d * w * 2 + adapter_state);
  EXPECT_EQ(qlora->plan.memory().expert_state_bytes(),
            layers * local * 3 * Nf4WeightBytes(d * w) + adapter_state);
  // The attention's weights go to NF4 as well; the router stays in bf16.
  int64_t attention = 0;
  for (const LoraTarget& t : LoraCandidates(dims)) {
    if (t.experts == 1) attention += t.in * t.out;
  }
  EXPECT_EQ(Nf4LayerWeights(dims), attention);
  EXPECT_EQ(lora->plan.memory().weights_bytes() - qlora->plan.memory().weights_bytes(),
            layers * (2 * attention - Nf4LayerBytes(dims)) +
                layers * (local * 3 * d * w * 2 - local * 3 * Nf4WeightBytes(d * w)));
  // AdamW's moments: ZeRO 1 splits the attention's adapters over dp 8; this rank's experts'
  // adapters (1/8 of them) are its alone (edp 1). Plus a step counter or two per unit.
  const int64_t dense_adapters = resolved->parameters_per_layer - expert_adapters;
  const int64_t moments = layers * 8 * (dense_adapters / 8 + expert_adapters / 8);
  EXPECT_GE(lora->plan.memory().optimizer_bytes(), moments);
  EXPECT_LT(lora->plan.memory().optimizer_bytes(), moments + 1024 * layers);
}

TEST(LoraTest, Nf4BytesAreFourBitsPlusDoubleQuantizedScales) {
  // 4096 x 4096: 8 MiB of codes, 262144 8-bit absmaxes, 1024 float32 scales, one offset.
  EXPECT_EQ(Nf4WeightBytes(int64_t{4096} * 4096), 8388608 + 262144 + 4 * 1024 + 4);
  // Partial blocks round up: 100 values are 50 bytes, 2 blocks, 1 scale, 1 offset.
  EXPECT_EQ(Nf4WeightBytes(100), 50 + 2 + 4 + 4);
  EXPECT_EQ(Nf4WeightBytes(7), 4 + 1 + 4 + 4);
  // QLoRA's 4.127 bits per weight on a 7B-sized layer.
  const v1::ModelDims llama = Dims("llama3-8b");
  int64_t weights = 0;
  for (const LoraTarget& t : LoraCandidates(llama)) weights += t.in * t.out;
  const double bits = 8.0 * Nf4LayerBytes(llama) / weights;
  EXPECT_NEAR(bits, 4.127, 0.001);
}

TEST(LoraTest, PlannerCountsTheNf4BaseAtItsBytes) {
  v1::JobSpec spec;
  spec.mutable_model()->set_preset("llama3-8b");
  spec.mutable_data()->set_seq_len(2048);
  spec.mutable_batch()->set_global_batch_size(16);
  spec.mutable_batch()->set_micro_batch_size(2);
  spec.set_precision(v1::PRECISION_BF16);
  spec.mutable_resources()->set_gpus(1);
  spec.mutable_lora()->set_rank(16);
  JobPlanOptions options;
  options.device = *DevicePreset("h100-sxm");
  options.devices_per_node = 8;
  options.runnable_only = true;
  auto lora = PlanJobSpec(spec, options);
  ASSERT_THAT(lora, IsOk());
  spec.mutable_lora()->set_base_quantization(v1::LORA_BASE_QUANTIZATION_NF4);
  auto qlora = PlanJobSpec(spec, options);
  ASSERT_THAT(qlora, IsOk());
  const v1::ModelDims dims = Dims("llama3-8b");
  int64_t weights = 0;
  for (const LoraTarget& t : LoraCandidates(dims)) weights += t.in * t.out;
  // bf16's 2 bytes per block linear weight become NF4's bytes; the rest stays.
  EXPECT_EQ(lora->plan.memory().weights_bytes() - qlora->plan.memory().weights_bytes(),
            dims.num_layers() * (2 * weights - Nf4LayerBytes(dims)));
}

TEST(LoraTest, PlannerCountsOnlyTheTargetedAdaptersAndRunsDataParallel) {
  v1::JobSpec spec;
  spec.mutable_model()->set_preset("llama3-8b");
  spec.mutable_data()->set_seq_len(2048);
  spec.mutable_batch()->set_global_batch_size(16);
  spec.mutable_batch()->set_micro_batch_size(2);
  spec.set_precision(v1::PRECISION_BF16);
  spec.mutable_resources()->set_gpus(8);
  spec.mutable_lora()->set_rank(16);
  JobPlanOptions options;
  options.device = *DevicePreset("h100-sxm");
  options.devices_per_node = 8;
  options.runnable_only = true;
  auto all_or = PlanJobSpec(spec, options);
  ASSERT_TRUE(all_or.ok()) << all_or.status();
  const JobPlan all = *all_or;
  ASSERT_TRUE(all.plan.fits()) << all.plan.explanation();
  EXPECT_EQ(all.plan.lora_rank(), 16);
  EXPECT_EQ(all.plan.layout().tensor_parallel(), 1);
  EXPECT_EQ(all.plan.layout().pipeline_parallel(), 1);
  EXPECT_LE(all.plan.layout().zero_stage(), 1);
  spec.mutable_lora()->add_target_modules("q_proj");
  spec.mutable_lora()->add_target_modules("v_proj");
  auto qv_or = PlanJobSpec(spec, options);
  ASSERT_TRUE(qv_or.ok()) << qv_or.status();
  const JobPlan qv = *qv_or;
  // AdamW state: two float32 moments per adapter parameter (plus step counters): q and v only
  // hold 16 * ((4096 + 4096) + (4096 + 1024)) per layer of 32.
  const int64_t qv_adapters = int64_t{32} * 16 * ((4096 + 4096) + (4096 + 1024));
  const int64_t dp = qv.plan.layout().data_parallel();
  const int64_t optimizer = qv.plan.memory().optimizer_bytes();
  EXPECT_GE(optimizer, 8 * qv_adapters / (qv.plan.layout().zero_stage() == 1 ? dp : 1));
  EXPECT_LT(optimizer, all.plan.memory().optimizer_bytes());
  v1::Layout layout;
  layout.set_data_parallel(2);
  layout.set_tensor_parallel(2);
  // Adapters split like their base layers.
  EXPECT_THAT(CheckTrainerRunsLora(layout), IsOk());
  layout.set_zero_stage(2);
  EXPECT_THAT(CheckTrainerRunsLora(layout),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("zero_stage 2 with lora")));
  layout.set_tensor_parallel(1);
  layout.set_zero_stage(1);
  EXPECT_THAT(CheckTrainerRunsLora(layout), IsOk());
  // The experts' adapters are sharded with the experts.
  layout.set_expert_parallel(2);
  EXPECT_THAT(CheckTrainerRunsLora(layout), IsOk());
  layout.set_pipeline_parallel(2);
  EXPECT_THAT(CheckTrainerRunsLora(layout),
              StatusIs(absl::StatusCode::kUnimplemented,
                       HasSubstr("pipeline_parallel 2, zero_stage 1 with lora: this trainer runs "
                                 "LoRA under data, tensor and expert parallelism")));
}

// A plan carries the resolved LoRA (LayoutPlan.lora) whole: what comes back is what went in, so
// the trainer builds the adapters the coordinator resolved and the planner counted.
TEST(LoraTest, ThePlansFormHoldsTheWholeResolution) {
  v1::LoraSpec spec;
  spec.set_rank(4);
  spec.set_alpha(16);
  spec.set_dropout(0.1);
  spec.set_base_quantization(v1::LORA_BASE_QUANTIZATION_NF4);
  auto lora = ResolveLora(spec, Dims("tiny-gpt2"));
  ASSERT_THAT(lora, IsOk());
  ASSERT_FALSE(lora->targets.empty());
  const ResolvedLora back = FromLoraPlan(ToLoraPlan(*lora));
  EXPECT_EQ(back.rank, 4);
  EXPECT_EQ(back.alpha, 16);
  EXPECT_EQ(back.dropout, 0.1);
  EXPECT_TRUE(back.base_nf4);
  EXPECT_EQ(back.parameters_per_layer, lora->parameters_per_layer);
  EXPECT_EQ(back.peft_target_modules, lora->peft_target_modules);
  ASSERT_EQ(back.targets.size(), lora->targets.size());
  for (size_t i = 0; i < back.targets.size(); ++i) {
    EXPECT_EQ(back.targets[i].module, lora->targets[i].module);
    EXPECT_EQ(back.targets[i].hf_module, lora->targets[i].hf_module);
    EXPECT_EQ(back.targets[i].in, lora->targets[i].in);
    EXPECT_EQ(back.targets[i].out, lora->targets[i].out);
    EXPECT_EQ(back.targets[i].experts, lora->targets[i].experts);
  }
}

}  // namespace
}  // namespace tessera::planner

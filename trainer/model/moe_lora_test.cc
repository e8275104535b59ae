// Per-expert LoRA on MoeLayerImpl: the adapters' shapes and names, the layer's output against the
// same layer with each expert's adapted weights merged (W_e + scale B_e A_e, computed another
// way), that only the adapters receive gradients once the base is frozen, and QLoRA's experts in
// NF4 against their dequantized weights.
#include "trainer/model/moe_lora.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "trainer/model/lora.h"
#include "trainer/model/moe.h"
#include "trainer/model/nf4.h"
#include "trainer/torch_pch.h"

namespace tessera::trainer {
namespace {

using ::testing::HasSubstr;

MoeOptions SmallOptions() {
  MoeOptions options;
  options.hidden_size = 8;
  options.num_experts = 4;
  options.top_k = 2;
  options.expert_intermediate_size = 6;
  options.init_std = 0.4;
  return options;
}

const std::set<std::string> kAllExperts = {kMoeLoraGate, kMoeLoraUp, kMoeLoraDown};

// Each adapter's split under tp follows its base's (lora.h): a column-parallel base splits B's
// rows (GPT-2's qkv in three blocks), a row-parallel one A's columns; the other matrix is
// replicated. Expert adapters' logical expert count is the local one times ep.
TEST(LoraShardTest, AdaptersSplitLikeTheirBase) {
  using Kind = ParamShard::Kind;
  const ParamShard qkv{.kind = Kind::kColumn, .blocks = 3, .global_shape = {48, 16}};
  const ParamShard qkv_a = LoraShardOf("layers.0.attn.qkv.lora_a", {4, 16}, qkv, 2, 1);
  EXPECT_EQ(qkv_a.kind, Kind::kReplicated);
  EXPECT_EQ(qkv_a.global_shape, (std::vector<int64_t>{4, 16}));
  const ParamShard qkv_b = LoraShardOf("layers.0.attn.qkv.lora_b", {24, 4}, qkv, 2, 1);
  EXPECT_EQ(qkv_b.kind, Kind::kColumn);
  EXPECT_EQ(qkv_b.blocks, 3);
  EXPECT_EQ(qkv_b.global_shape, (std::vector<int64_t>{48, 4}));

  const ParamShard proj{.kind = Kind::kRow, .blocks = 1, .global_shape = {16, 16}};
  const ParamShard proj_a = LoraShardOf("layers.0.attn.proj.lora_a", {4, 8}, proj, 2, 1);
  EXPECT_EQ(proj_a.kind, Kind::kRow);
  EXPECT_EQ(proj_a.global_shape, (std::vector<int64_t>{4, 16}));
  EXPECT_EQ(LoraShardOf("layers.0.attn.proj.lora_b", {16, 4}, proj, 2, 1).kind, Kind::kReplicated);

  const ParamShard down{.kind = Kind::kExpertRow, .blocks = 1, .global_shape = {8, 16, 12}};
  const ParamShard down_a = LoraShardOf("layers.0.mlp.experts.down.lora_a", {4, 4, 6}, down, 2, 2);
  EXPECT_EQ(down_a.kind, Kind::kExpertRow);
  EXPECT_EQ(down_a.global_shape, (std::vector<int64_t>{8, 4, 12}));
  const ParamShard down_b = LoraShardOf("layers.0.mlp.experts.down.lora_b", {4, 16, 4}, down, 2, 2);
  EXPECT_EQ(down_b.kind, Kind::kReplicated);
  EXPECT_EQ(down_b.global_shape, (std::vector<int64_t>{8, 16, 4}));
  const ParamShard gate{.kind = Kind::kExpertColumn, .blocks = 1, .global_shape = {8, 12, 16}};
  const ParamShard gate_b = LoraShardOf("layers.0.mlp.experts.gate.lora_b", {4, 6, 4}, gate, 2, 2);
  EXPECT_EQ(gate_b.kind, Kind::kExpertColumn);
  EXPECT_EQ(gate_b.global_shape, (std::vector<int64_t>{8, 12, 4}));

  EXPECT_EQ(LoraBaseParameterName("layers.0.attn.q.lora_a"), "layers.0.attn.q.weight");
  EXPECT_EQ(LoraBaseParameterName("layers.0.mlp.experts.up.lora_b"), "layers.0.mlp.experts.up");
}

TEST(MoeLoraTest, EveryExpertGetsItsOwnAdapters) {
  torch::manual_seed(1);
  MoeLayer layer(SmallOptions(), torch::kFloat64);
  layer->AddLora(/*rank=*/3, /*scale=*/2.0, /*dropout=*/0, {kMoeLoraGate, kMoeLoraDown, "attn.q"});
  const auto params = layer->named_parameters();
  ASSERT_TRUE(params.contains("experts.gate.lora_a"));
  EXPECT_EQ(params["experts.gate.lora_a"].sizes(), (std::vector<int64_t>{4, 3, 8}));
  EXPECT_EQ(params["experts.gate.lora_b"].sizes(), (std::vector<int64_t>{4, 6, 3}));
  EXPECT_EQ(params["experts.down.lora_a"].sizes(), (std::vector<int64_t>{4, 3, 6}));
  EXPECT_EQ(params["experts.down.lora_b"].sizes(), (std::vector<int64_t>{4, 8, 3}));
  EXPECT_FALSE(params.contains("experts.up.lora_a"));
  // The stacked weights keep their names beside their adapters.
  EXPECT_EQ(params["experts.gate"].sizes(), (std::vector<int64_t>{4, 6, 8}));
}

TEST(MoeLoraTest, AdaptersAreSizedFromTheStackedWeightNotTheExpertCount) {
  // An expert-parallel rank holds a slice of the experts: 2 of the layer's 4 here.
  torch::nn::Module experts;
  const torch::Tensor gate = torch::zeros({2, 6, 8}), down = torch::zeros({2, 8, 6});
  const MoeExpertLora lora = AttachMoeExpertLora(experts, gate, gate, down, 3, 1.0, 0, kAllExperts);
  EXPECT_EQ(lora.up.a.sizes(), (std::vector<int64_t>{2, 3, 8}));
  EXPECT_EQ(lora.down.b.sizes(), (std::vector<int64_t>{2, 8, 3}));
}

TEST(MoeLoraTest, OutputEqualsTheLayerWithEachExpertsAdapterMerged) {
  torch::manual_seed(2);
  MoeLayer adapted(SmallOptions(), torch::kFloat64);
  torch::manual_seed(2);
  MoeLayer merged(SmallOptions(), torch::kFloat64);
  const double scale = 1.5;
  adapted->AddLora(3, scale, 0, kAllExperts);
  auto params = adapted->named_parameters();
  auto merged_params = merged->named_parameters();
  {
    torch::NoGradGuard no_grad;
    for (const char* name : {"gate", "up", "down"}) {
      const std::string stem = std::string("experts.") + name;
      params[stem + ".lora_a"].normal_(0, 0.3);
      params[stem + ".lora_b"].normal_(0, 0.3);
      // Expert by expert, as the merged export computes it in one batched product.
      for (int64_t e = 0; e < 4; ++e) {
        merged_params[stem][e].add_(
            at::mm(params[stem + ".lora_b"][e], params[stem + ".lora_a"][e]) * scale);
      }
    }
  }
  const torch::Tensor x = torch::randn({3, 5, 8}, torch::kFloat64);
  const torch::Tensor ours = adapted->forward(x).output;
  EXPECT_TRUE(torch::allclose(ours, merged->forward(x).output, 1e-12, 1e-12));
  // The adapters matter: without them the output differs.
  torch::manual_seed(2);
  MoeLayer base(SmallOptions(), torch::kFloat64);
  EXPECT_FALSE(torch::allclose(ours, base->forward(x).output, 1e-6, 1e-6));
}

TEST(MoeLoraTest, OnlyTheAdaptersTrainWhenTheBaseIsFrozen) {
  torch::manual_seed(3);
  MoeLayer layer(SmallOptions(), torch::kFloat64);
  for (auto& param : layer->parameters()) param.requires_grad_(false);
  layer->AddLora(2, 1.0, 0, kAllExperts);
  for (const auto& item : layer->named_parameters()) {
    if (absl::EndsWith(item.key(), ".lora_a")) {
      torch::NoGradGuard no_grad;
      item.value().normal_(0, 0.3);
    }
    if (absl::EndsWith(item.key(), ".lora_a") || absl::EndsWith(item.key(), ".lora_b")) {
      item.value().requires_grad_(true);
    }
  }
  // Enough tokens that every expert is routed some.
  const torch::Tensor x = torch::randn({64, 8}, torch::kFloat64);
  MoeOutput out = layer->forward(x);
  ASSERT_EQ(out.tokens_per_expert.min().item<int64_t>() > 0, true);
  out.output.pow(2).sum().backward();
  for (const auto& item : layer->named_parameters()) {
    const bool adapter =
        absl::EndsWith(item.key(), ".lora_a") || absl::EndsWith(item.key(), ".lora_b");
    EXPECT_EQ(item.value().grad().defined(), adapter) << item.key();
    if (absl::EndsWith(item.key(), ".lora_b")) {
      // Every expert's B gets a gradient of its own.
      for (int64_t e = 0; e < 4; ++e) {
        EXPECT_GT(item.value().grad()[e].abs().max().item<double>(), 0) << item.key() << " " << e;
      }
    }
  }
}

// QLoRA on the experts: the layer with its stacked expert weights in NF4 computes, in forward and
// backward, what the same layer computes with each expert's weight replaced by its dequantized
// NF4 value (quantized expert by expert here, another way than the layer's stacked path).
TEST(MoeLoraTest, Nf4ExpertsComputeWithTheirDequantizedWeights) {
  MoeOptions options = SmallOptions();
  options.hidden_size = 16;
  options.expert_intermediate_size = 12;  // 192 values an expert: three 64-value blocks
  torch::manual_seed(4);
  MoeLayer quantized(options);
  torch::manual_seed(4);
  MoeLayer reference(options);
  torch::manual_seed(4);
  MoeLayer original(options);
  auto reference_params = reference->named_parameters();
  {
    torch::NoGradGuard no_grad;
    for (const std::string name : {"gate", "up", "down"}) {
      torch::Tensor stacked = reference_params["experts." + name];
      quantized->QuantizeExpertsNf4(name, stacked.clone());
      for (int64_t e = 0; e < options.num_experts; ++e) {
        absl::StatusOr<Nf4Tensor> expert = QuantizeNf4(stacked[e]);
        ASSERT_TRUE(expert.ok()) << expert.status();
        stacked[e].copy_(DequantizeNf4(*expert));
      }
    }
  }
  auto params = quantized->named_parameters();
  EXPECT_FALSE(params.contains("experts.gate"));
  ASSERT_TRUE(params.contains("experts.down.weight_nf4_codes"));
  // 4 experts of 192 values, two to a byte; one 8-bit absmax per block.
  EXPECT_EQ(params["experts.down.weight_nf4_codes"].sizes(), (std::vector<int64_t>{4, 96}));
  EXPECT_EQ(params["experts.down.weight_nf4_absmax_codes"].sizes(), (std::vector<int64_t>{4, 3}));
  EXPECT_FALSE(params["experts.down.weight_nf4_codes"].requires_grad());

  quantized->AddLora(3, 1.5, 0, kAllExperts);
  reference->AddLora(3, 1.5, 0, kAllExperts);
  params = quantized->named_parameters();
  reference_params = reference->named_parameters();
  EXPECT_EQ(params["experts.gate.lora_a"].sizes(), (std::vector<int64_t>{4, 3, 16}));
  EXPECT_EQ(params["experts.gate.lora_a"].device().type(), torch::kCPU);
  {
    torch::NoGradGuard no_grad;
    for (const std::string name : {"gate", "up", "down"}) {
      for (const char* matrix : {".lora_a", ".lora_b"}) {
        const std::string key = "experts." + name + matrix;
        params[key].normal_(0, 0.3);
        reference_params[key].copy_(params[key]);
      }
    }
  }
  for (const auto& item : params) {
    if (absl::StrContains(item.key(), ".lora_")) item.value().requires_grad_(true);
  }
  const torch::Tensor x = torch::randn({64, 16});
  const torch::Tensor x_quantized = x.clone().requires_grad_(true);
  const torch::Tensor x_reference = x.clone().requires_grad_(true);
  const torch::Tensor ours = quantized->forward(x_quantized).output;
  const torch::Tensor expected = reference->forward(x_reference).output;
  EXPECT_TRUE(torch::allclose(ours, expected, 1e-5, 1e-5));
  ours.pow(2).sum().backward();
  expected.pow(2).sum().backward();
  EXPECT_TRUE(torch::allclose(x_quantized.grad(), x_reference.grad(), 1e-4, 1e-5));
  for (const std::string name : {"gate", "up", "down"}) {
    const std::string key = "experts." + name + ".lora_b";
    EXPECT_TRUE(torch::allclose(params[key].grad(), reference_params[key].grad(), 1e-4, 1e-5))
        << key;
  }
  // The quantization is in effect: the unquantized experts compute something else.
  original->AddLora(3, 1.5, 0, kAllExperts);
  auto original_params = original->named_parameters();
  {
    torch::NoGradGuard no_grad;
    for (const auto& item : params) {
      if (absl::StrContains(item.key(), ".lora_")) original_params[item.key()].copy_(item.value());
    }
  }
  EXPECT_FALSE(torch::allclose(ours, original->forward(x).output, 1e-4, 1e-4));
}

TEST(MoeLoraTest, RouterTargetsAreRefused) {
  MoeLayer layer(SmallOptions(), torch::kFloat64);
  try {
    layer->AddLora(2, 1.0, 0, {"mlp.router"});
    FAIL() << "a router target was accepted";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("mlp.router"));
  }
}

}  // namespace
}  // namespace tessera::trainer

// Per-expert LoRA on MoeLayerImpl: the adapters' shapes and names, the layer's output against the
// same layer with each expert's adapted weights merged (W_e + scale B_e A_e, computed another
// way), and that only the adapters receive gradients once the base is frozen.
#include "trainer/model/moe_lora.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "absl/strings/match.h"
#include "trainer/model/moe.h"
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
  const MoeExpertLora lora =
      AttachMoeExpertLora(experts, gate, gate, down, 3, 1.0, 0, kAllExperts);
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
    const bool adapter = absl::EndsWith(item.key(), ".lora_a") ||
                         absl::EndsWith(item.key(), ".lora_b");
    EXPECT_EQ(item.value().grad().defined(), adapter) << item.key();
    if (absl::EndsWith(item.key(), ".lora_b")) {
      // Every expert's B gets a gradient of its own.
      for (int64_t e = 0; e < 4; ++e) {
        EXPECT_GT(item.value().grad()[e].abs().max().item<double>(), 0) << item.key() << " " << e;
      }
    }
  }
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

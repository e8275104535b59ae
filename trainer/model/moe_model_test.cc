// CausalLM with mixture-of-experts blocks: the MoE layer replaces each block's MLP under the names
// HF import maps, the parameter count equals the planner's, the training loss is the
// cross-entropy plus router_aux_loss_coef times the reported router loss, and FULL activation
// checkpointing keeps the loss and every gradient (the router's through the load-balancing loss
// included) of the uncheckpointed model.

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "planner/model_config.h"
#include "trainer/model/model.h"
#include "trainer/model/test_model_dims.h"
#include "trainer/torch_pch.h"

namespace tessera::trainer {
namespace {

// TinyQwenDims with 4 experts of width 32, 2 per token, in every layer.
v1::ModelDims TinyMoeDims(double aux_loss_coef = 0.05) {
  v1::ModelSpec spec;
  *spec.mutable_dims() = testing::TinyQwenDims();
  v1::ModelDims* dims = spec.mutable_dims();
  dims->set_num_experts(4);
  dims->set_num_experts_per_token(2);
  dims->set_moe_intermediate_size(32);
  dims->set_norm_topk_prob(true);
  dims->set_router_aux_loss_coef(aux_loss_coef);
  return testing::ResolvedDims(spec);
}

CausalLM MakeModel(const v1::ModelDims& dims) {
  torch::manual_seed(11);
  return CausalLM(dims, 0.02);
}

TEST(MoeModelTest, ExpertsReplaceTheMlpAndCountAsThePlannerDoes) {
  const v1::ModelDims dims = TinyMoeDims();
  CausalLM model = MakeModel(dims);
  std::map<std::string, std::vector<int64_t>> shapes;
  int64_t total = 0;
  for (const auto& item : model->named_parameters()) {
    shapes[item.key()] = item.value().sizes().vec();
    total += item.value().numel();
  }
  EXPECT_EQ(total, planner::CountParameters(dims));
  EXPECT_EQ(shapes.at("layers.0.mlp.router.weight"), (std::vector<int64_t>{4, 64}));
  EXPECT_EQ(shapes.at("layers.1.mlp.experts.gate"), (std::vector<int64_t>{4, 32, 64}));
  EXPECT_EQ(shapes.at("layers.1.mlp.experts.down"), (std::vector<int64_t>{4, 64, 32}));
  EXPECT_FALSE(shapes.contains("layers.0.mlp.gate.weight"));
}

TEST(MoeModelTest, TrainingLossAddsTheWeightedRouterLoss) {
  const v1::ModelDims dims = TinyMoeDims(0.05);
  CausalLM model = MakeModel(dims);
  torch::manual_seed(3);
  const torch::Tensor tokens = torch::randint(dims.vocab_size(), {2, 16}, torch::kLong);
  const torch::Tensor targets = torch::randint(dims.vocab_size(), {2, 16}, torch::kLong);
  torch::NoGradGuard no_grad;
  model->eval();
  const double eval_loss = model->Loss(tokens, targets).item<double>();
  model->train();
  const double train_loss = model->Loss(tokens, targets).item<double>();
  const torch::Tensor aux = model->last_router_aux_loss();
  ASSERT_TRUE(aux.defined());
  EXPECT_NEAR(train_loss - eval_loss, 0.05 * aux.item<double>(), 1e-6);
  // num_experts * sum_e f_e P_e: top_k when balanced, at most top_k * num_experts.
  EXPECT_GE(aux.item<double>(), 2.0 * (1 - 1e-6));
  EXPECT_LE(aux.item<double>(), 8.0);
  const torch::Tensor counts = model->last_tokens_per_expert();
  ASSERT_EQ(counts.sizes(), (std::vector<int64_t>{2, 4}));
  EXPECT_TRUE(torch::equal(counts.sum(1), torch::full({2}, 2 * 16 * 2, torch::kLong)));
  // The logits path reports the router loss too.
  model->forward(tokens);
  EXPECT_NEAR(model->last_router_aux_loss().item<double>(), aux.item<double>(), 1e-6);
  // A dense model reports none.
  CausalLM dense = MakeModel(testing::TinyQwenDims());
  dense->Loss(tokens, targets);
  EXPECT_FALSE(dense->last_router_aux_loss().defined());
}

TEST(MoeModelTest, FullCheckpointingKeepsLossAndEveryGradient) {
  const v1::ModelDims dims = TinyMoeDims(0.5);
  torch::manual_seed(5);
  const torch::Tensor tokens = torch::randint(dims.vocab_size(), {2, 16}, torch::kLong);
  const torch::Tensor targets = torch::randint(dims.vocab_size(), {2, 16}, torch::kLong);
  CausalLM plain = MakeModel(dims);
  CausalLM checkpointed = MakeModel(dims);
  checkpointed->SetActivationCheckpointing(v1::ACTIVATION_CHECKPOINTING_FULL);
  const torch::Tensor plain_loss = plain->Loss(tokens, targets);
  plain_loss.backward();
  const torch::Tensor checkpointed_loss = checkpointed->Loss(tokens, targets);
  checkpointed_loss.backward();
  EXPECT_TRUE(torch::allclose(plain_loss, checkpointed_loss, 0, 1e-6));
  const auto expected = plain->named_parameters();
  for (const auto& item : checkpointed->named_parameters()) {
    const torch::Tensor want = expected[item.key()].grad();
    ASSERT_TRUE(want.defined() && item.value().grad().defined()) << item.key();
    EXPECT_TRUE(torch::allclose(item.value().grad(), want, 1e-5, 1e-7)) << item.key();
  }
  // The router's gradient includes the load-balancing term: without it, it differs.
  CausalLM unweighted = MakeModel(TinyMoeDims(0.0));
  unweighted->Loss(tokens, targets).backward();
  EXPECT_FALSE(torch::allclose(unweighted->named_parameters()["layers.0.mlp.router.weight"].grad(),
                               expected["layers.0.mlp.router.weight"].grad(), 1e-5, 1e-7));
}

TEST(MoeModelTest, LoraOnAnMoeBlockAdaptsTheExpertsOnly) {
  // A dense MLP's target names no module of an MoE block.
  CausalLM dense_names = MakeModel(TinyMoeDims());
  LoraOptions options{.rank = 4, .scale = 1, .dropout = 0, .targets = {"attn.q", "mlp.up"}};
  EXPECT_THROW(dense_names->AddLora(options), c10::Error);
  CausalLM model = MakeModel(TinyMoeDims());
  options.targets = {"attn.q", "mlp.experts.up"};
  model->AddLora(options);
  const auto params = model->named_parameters();
  EXPECT_TRUE(params.contains("layers.0.mlp.experts.up.lora_a"));
  EXPECT_TRUE(params.contains("layers.0.mlp.experts.up.lora_b"));
  EXPECT_FALSE(params.contains("layers.0.mlp.experts.gate.lora_a"));
  // AddLora draws A over every expert's input width and leaves B zero.
  const torch::Tensor a = params["layers.0.mlp.experts.up.lora_a"];
  EXPECT_GT(a.abs().min().item<double>(), 0);
  EXPECT_LE(a.abs().max().item<double>(), 1.0 / std::sqrt(static_cast<double>(a.size(-1))));
  EXPECT_EQ(params["layers.0.mlp.experts.up.lora_b"].abs().max().item<double>(), 0);
}

}  // namespace
}  // namespace tessera::trainer

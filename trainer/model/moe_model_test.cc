// CausalLM with mixture-of-experts blocks: the MoE layer replaces each block's MLP under the names
// HF import maps, the parameter count equals the planner's, the training loss is the
// cross-entropy plus router_aux_loss_coef times the reported router loss, and FULL activation
// checkpointing keeps the loss and every gradient (the router's through the load-balancing loss
// included) of the uncheckpointed model.

#include <cmath>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "planner/model_config.h"
#include "trainer/model/model.h"
#include "trainer/model/model_dims_fixture.h"
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

// Two pipeline stages in one process, one layer each, against the whole model: the stages'
// router losses add up to the whole model's, and with the first stage's term joined to its
// backward through its output (AttachAuxLoss, at the micro-batch's loss weight) every gradient,
// the first layer's router included, is the whole model's.
TEST(MoeModelTest, PipelineStagesSplitTheRouterLossAndItsGradients) {
  const v1::ModelDims dims = TinyMoeDims(0.5);
  ASSERT_EQ(dims.num_layers(), 2);
  torch::manual_seed(5);
  const torch::Tensor tokens = torch::randint(dims.vocab_size(), {2, 16}, torch::kLong);
  const torch::Tensor targets = torch::randint(dims.vocab_size(), {2, 16}, torch::kLong);
  const double weight = 0.25;  // the micro-batch's loss weight
  CausalLM whole = MakeModel(dims);
  const torch::Tensor whole_loss = whole->Loss(tokens, targets);
  (whole_loss * weight).backward();

  torch::manual_seed(11);
  CausalLM first(dims, 0.02, ModelPartition{.first_layer = 0, .num_layers = 1, .head = false});
  torch::manual_seed(11);
  CausalLM last(dims, 0.02, ModelPartition{.first_layer = 1, .num_layers = 1, .embedding = false});
  const torch::Tensor sent = first->StageForward(tokens, {});
  const torch::Tensor received = sent.detach().requires_grad_();
  const torch::Tensor last_loss = last->StageForward(received, targets);
  (last_loss * weight).backward();
  first->set_aux_loss_scale(weight);
  sent.backward(received.grad());

  const double first_aux = first->last_router_aux_loss().item<double>();
  const double last_aux = last->last_router_aux_loss().item<double>();
  EXPECT_GT(first_aux, 0);
  EXPECT_NEAR(first_aux + last_aux, whole->last_router_aux_loss().item<double>(), 1e-6);
  // The step's loss: the last stage's output plus the earlier stages' weighted router losses.
  EXPECT_NEAR(last_loss.item<double>() + 0.5 * first_aux, whole_loss.item<double>(), 1e-6);
  const auto expected = whole->named_parameters();
  // Tied embeddings: each end stage holds a copy, whose gradients the engine sums.
  ASSERT_TRUE(dims.tie_embeddings());
  const torch::Tensor embed_grad = first->named_parameters()["embed.weight"].grad() +
                                   last->named_parameters()["embed.weight"].grad();
  EXPECT_TRUE(torch::allclose(embed_grad, expected["embed.weight"].grad(), 1e-5, 1e-7));
  std::set<std::string> compared;
  for (CausalLM* stage : {&first, &last}) {
    for (const auto& item : (*stage)->named_parameters()) {
      if (item.key() == "embed.weight") continue;
      const torch::Tensor want = expected[item.key()].grad();
      ASSERT_TRUE(want.defined() && item.value().grad().defined()) << item.key();
      EXPECT_TRUE(torch::allclose(item.value().grad(), want, 1e-5, 1e-7)) << item.key();
      compared.insert(item.key());
    }
  }
  EXPECT_EQ(compared.size() + 1, expected.size());
  // Without the scale the first router's gradient misses its load-balancing term.
  torch::manual_seed(11);
  CausalLM unscaled(dims, 0.02, ModelPartition{.first_layer = 0, .num_layers = 1, .head = false});
  unscaled->set_aux_loss_scale(0);
  unscaled->StageForward(tokens, {}).backward(received.grad());
  EXPECT_FALSE(torch::allclose(unscaled->named_parameters()["layers.0.mlp.router.weight"].grad(),
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

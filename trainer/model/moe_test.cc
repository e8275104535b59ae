// MoeLayerImpl against a dense reference that loops over tokens and experts, reading the layer's
// weights under Hugging Face's per-expert names (through HfMoeParameterNames), in float64.
#include "trainer/model/moe.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "trainer/torch_pch.h"

namespace tessera::trainer {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

using HfWeights = std::map<std::string, torch::Tensor>;

constexpr double kTolerance = 1e-10;  // float64 agrees to rounding; well inside a 1e-6 bar

MoeOptions SmallOptions(int64_t top_k, bool norm_topk_prob, bool shared) {
  MoeOptions options;
  options.hidden_size = 8;
  options.num_experts = 4;
  options.top_k = top_k;
  options.expert_intermediate_size = 6;
  options.norm_topk_prob = norm_topk_prob;
  if (shared) {
    options.num_shared_experts = 1;
    options.shared_intermediate_size = 5;
  }
  options.aux_loss_coef = 0.7;
  options.init_std = 0.4;
  return options;
}

MoeLayer MakeLayer(const MoeOptions& options, uint64_t seed) {
  torch::manual_seed(seed);
  return MoeLayer(options, torch::kFloat64);
}

// The layer's parameters under HF's names, unstacked, as fresh leaves that require grad.
HfWeights ToHf(MoeLayer& layer, HfMoeFamily family) {
  const absl::StatusOr<std::vector<HfMoeTensor>> names =
      HfMoeParameterNames(layer->options(), family);
  EXPECT_TRUE(names.ok()) << names.status();
  const auto params = layer->named_parameters();
  HfWeights hf;
  for (const HfMoeTensor& tensor : *names) {
    const torch::Tensor value = params[tensor.name].detach();
    for (size_t i = 0; i < tensor.hf_names.size(); ++i) {
      const torch::Tensor part = tensor.stacked ? value[static_cast<int64_t>(i)] : value;
      hf[tensor.hf_names[i]] = part.clone().requires_grad_(true);
    }
  }
  return hf;
}

// The layer's parameters' gradients, each rebuilt from the HF tensors' gradients.
std::map<std::string, torch::Tensor> GradsFromHf(MoeLayer& layer, HfMoeFamily family,
                                                 const HfWeights& hf) {
  const absl::StatusOr<std::vector<HfMoeTensor>> names =
      HfMoeParameterNames(layer->options(), family);
  EXPECT_TRUE(names.ok()) << names.status();
  std::map<std::string, torch::Tensor> grads;
  for (const HfMoeTensor& tensor : *names) {
    std::vector<torch::Tensor> parts;
    for (const std::string& name : tensor.hf_names) {
      const torch::Tensor& grad = hf.at(name).grad();
      parts.push_back(grad.defined() ? grad : torch::zeros_like(hf.at(name)));
    }
    grads[tensor.name] = tensor.stacked ? torch::stack(parts) : parts[0];
  }
  return grads;
}

double Scalar(const torch::Tensor& t) { return t.item<double>(); }

struct Reference {
  torch::Tensor output;                       // [T, hidden]
  torch::Tensor aux_loss;                     // scalar
  std::vector<std::vector<int64_t>> choices;  // per token, by descending probability
  std::vector<int64_t> counts;                // per expert
};

torch::Tensor Silu(const torch::Tensor& x) { return x * torch::sigmoid(x); }

// One token at a time, one selected expert at a time, from HF-named weights: the MoE block as
// transformers writes it, with the softmax and the top-k done by hand.
Reference DenseReference(const HfWeights& w, const MoeOptions& options, HfMoeFamily family,
                         const torch::Tensor& tokens) {
  const bool mixtral = family == HfMoeFamily::kMixtral;
  auto expert = [&](int64_t e, const char* qwen, const char* mix) {
    return w.at(absl::StrCat("experts.", e, ".", mixtral ? mix : qwen, ".weight"));
  };
  const int64_t num_tokens = tokens.size(0), num_experts = options.num_experts;
  Reference ref;
  ref.counts.assign(num_experts, 0);
  std::vector<torch::Tensor> rows;
  torch::Tensor prob_sum = torch::zeros({num_experts}, tokens.options());
  for (int64_t t = 0; t < num_tokens; ++t) {
    const torch::Tensor x = tokens[t];
    std::vector<torch::Tensor> logits;
    for (int64_t e = 0; e < num_experts; ++e) logits.push_back((w.at("gate.weight")[e] * x).sum());
    const torch::Tensor logit = torch::stack(logits);
    const torch::Tensor exp = torch::exp(logit - logit.max().detach());
    const torch::Tensor probs = exp / exp.sum();
    prob_sum = prob_sum + probs;

    std::vector<int64_t> chosen;
    for (int64_t j = 0; j < options.top_k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < num_experts; ++e) {
        if (std::find(chosen.begin(), chosen.end(), e) != chosen.end()) continue;
        if (best < 0 || Scalar(probs[e]) > Scalar(probs[best])) best = e;
      }
      chosen.push_back(best);
      ++ref.counts[best];
    }
    torch::Tensor chosen_sum = torch::zeros({}, tokens.options());
    for (int64_t e : chosen) chosen_sum = chosen_sum + probs[e];

    torch::Tensor y = torch::zeros_like(x);
    for (int64_t e : chosen) {
      const torch::Tensor weight = options.norm_topk_prob ? probs[e] / chosen_sum : probs[e];
      const torch::Tensor h = Silu(torch::mv(expert(e, "gate_proj", "w1"), x)) *
                              torch::mv(expert(e, "up_proj", "w3"), x);
      y = y + weight * torch::mv(expert(e, "down_proj", "w2"), h);
    }
    if (options.num_shared_experts > 0) {
      const torch::Tensor h = Silu(torch::mv(w.at("shared_expert.gate_proj.weight"), x)) *
                              torch::mv(w.at("shared_expert.up_proj.weight"), x);
      const torch::Tensor gate = torch::sigmoid((w.at("shared_expert_gate.weight")[0] * x).sum());
      y = y + gate * torch::mv(w.at("shared_expert.down_proj.weight"), h);
    }
    rows.push_back(y);
    ref.choices.push_back(chosen);
  }
  ref.output = torch::stack(rows);
  const torch::Tensor mean_prob = prob_sum / static_cast<double>(num_tokens);
  ref.aux_loss = torch::zeros({}, tokens.options());
  for (int64_t e = 0; e < num_experts; ++e) {
    ref.aux_loss = ref.aux_loss + static_cast<double>(ref.counts[e]) /
                                      static_cast<double>(num_tokens) * mean_prob[e];
  }
  ref.aux_loss = ref.aux_loss * static_cast<double>(num_experts);
  return ref;
}

double MaxAbsDiff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

std::vector<int64_t> ToVector(const torch::Tensor& t) {
  const torch::Tensor c = t.to(torch::kCPU).to(torch::kInt64).contiguous();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

double GradNorm(MoeLayer& layer, const std::string& name) {
  return layer->named_parameters()[name].grad().norm().item<double>();
}

// Forward and backward through the layer and through the reference; outputs, routing, counts,
// the aux loss and every gradient agree.
void ExpectMatchesReference(const MoeOptions& options, HfMoeFamily family, MoeLayer& layer,
                            const torch::Tensor& x_value) {
  const HfWeights hf = ToHf(layer, family);
  const torch::Tensor x = x_value.clone().requires_grad_(true);
  const torch::Tensor x_ref = x_value.clone().requires_grad_(true);
  const MoeOutput out = layer->forward(x);
  const Reference ref =
      DenseReference(hf, options, family, x_ref.reshape({-1, options.hidden_size}));

  ASSERT_EQ(out.output.sizes(), x.sizes());
  EXPECT_LT(MaxAbsDiff(out.output.reshape({-1, options.hidden_size}), ref.output), kTolerance);
  EXPECT_LT(std::abs(Scalar(out.aux_loss) - Scalar(ref.aux_loss)), kTolerance);
  EXPECT_NEAR(Scalar(out.weighted_aux_loss), options.aux_loss_coef * Scalar(out.aux_loss),
              kTolerance);
  EXPECT_EQ(ToVector(out.tokens_per_expert), ref.counts);
  const int64_t num_tokens = static_cast<int64_t>(ref.choices.size());
  ASSERT_EQ(out.expert_indices.sizes(), (std::vector<int64_t>{num_tokens, options.top_k}));
  for (int64_t t = 0; t < num_tokens; ++t) {
    EXPECT_EQ(ToVector(out.expert_indices[t]), ref.choices[t]) << "token " << t;
  }

  // A loss that weighs every output element differently, plus the weighted aux loss.
  torch::manual_seed(99);
  const torch::Tensor probe = torch::randn(x.sizes(), x.options());
  (out.output * probe).sum().add(out.weighted_aux_loss).backward();
  (ref.output * probe.reshape({-1, options.hidden_size}))
      .sum()
      .add(ref.aux_loss * options.aux_loss_coef)
      .backward();
  EXPECT_LT(MaxAbsDiff(x.grad(), x_ref.grad()), kTolerance);
  const std::map<std::string, torch::Tensor> ref_grads = GradsFromHf(layer, family, hf);
  for (const auto& param : layer->named_parameters()) {
    ASSERT_TRUE(param.value().grad().defined()) << param.key();
    EXPECT_LT(MaxAbsDiff(param.value().grad(), ref_grads.at(param.key())), kTolerance)
        << param.key();
  }
  EXPECT_GT(GradNorm(layer, "router.weight"), 0) << "the router learns";
}

// top_k, norm_topk_prob, shared expert.
class MoeReferenceTest : public ::testing::TestWithParam<std::tuple<int64_t, bool, bool>> {};

TEST_P(MoeReferenceTest, OutputRoutingAuxLossAndGradientsMatchDenseReference) {
  const auto [top_k, norm, shared] = GetParam();
  const MoeOptions options = SmallOptions(top_k, norm, shared);
  MoeLayer layer = MakeLayer(options, 1);
  torch::manual_seed(2);
  ExpectMatchesReference(options, HfMoeFamily::kQwenMoe, layer,
                         torch::randn({3, 7, options.hidden_size}, torch::kFloat64));
}

INSTANTIATE_TEST_SUITE_P(Variants, MoeReferenceTest,
                         ::testing::Combine(::testing::Values(1, 2), ::testing::Bool(),
                                            ::testing::Bool()));

TEST(MoeLayerTest, MixtralNamesAndTopThreeMatchReference) {
  MoeOptions options = SmallOptions(3, /*norm_topk_prob=*/true, /*shared=*/false);
  MoeLayer layer = MakeLayer(options, 3);
  torch::manual_seed(4);
  ExpectMatchesReference(options, HfMoeFamily::kMixtral, layer,
                         torch::randn({16, options.hidden_size}, torch::kFloat64));
}

TEST(MoeLayerTest, UngatedSharedExpertAddsPlainSwiGlu) {
  MoeOptions options = SmallOptions(2, true, /*shared=*/true);
  options.num_shared_experts = 2;  // fused: width 2 * 5
  options.shared_expert_gate = false;
  MoeLayer layer = MakeLayer(options, 5);
  torch::manual_seed(6);
  const torch::Tensor x = torch::randn({9, options.hidden_size}, torch::kFloat64);
  const MoeOutput out = layer->forward(x);

  MoeOptions routed_only = options;
  routed_only.num_shared_experts = 0;
  routed_only.shared_intermediate_size = 0;
  MoeLayer routed = MakeLayer(routed_only, 7);
  const auto params = layer->named_parameters();
  {
    const torch::NoGradGuard no_grad;
    for (auto& p : routed->named_parameters()) p.value().copy_(params[p.key()]);
  }
  const torch::Tensor shared = torch::mm(
      Silu(torch::mm(x, params["shared.gate"].t())) * torch::mm(x, params["shared.up"].t()),
      params["shared.down"].t());
  EXPECT_LT(MaxAbsDiff(out.output, routed->forward(x).output + shared), kTolerance);
}

// Router weights under which every token prefers expert 2, then expert 0 (x > 0).
void RouteEverythingTo2Then0(MoeLayer& layer) {
  const torch::NoGradGuard no_grad;
  torch::Tensor router = layer->named_parameters()["router.weight"];
  router.fill_(-1.0);
  router[2].fill_(1.0);
  router[0].fill_(0.5);
}

TEST(MoeLayerTest, DroplessWhenEveryTokenPicksTheSameExperts) {
  for (int64_t top_k : {1, 2}) {
    SCOPED_TRACE(absl::StrCat("top_k ", top_k));
    const MoeOptions options = SmallOptions(top_k, /*norm_topk_prob=*/false, /*shared=*/false);
    MoeLayer layer = MakeLayer(options, 8);
    RouteEverythingTo2Then0(layer);
    torch::manual_seed(9);
    const int64_t num_tokens = 40;  // 10x the balanced share of one expert; no slot is dropped
    const torch::Tensor x = torch::rand({num_tokens, options.hidden_size}, torch::kFloat64) + 0.1;
    const MoeOutput out = layer->forward(x);
    const std::vector<int64_t> counts = {top_k == 2 ? num_tokens : 0, 0, num_tokens, 0};
    EXPECT_EQ(ToVector(out.tokens_per_expert), counts);
    const std::vector<int64_t> choice =
        top_k == 2 ? std::vector<int64_t>{2, 0} : std::vector<int64_t>{2};
    for (int64_t t = 0; t < num_tokens; ++t) EXPECT_EQ(ToVector(out.expert_indices[t]), choice);
    ExpectMatchesReference(options, HfMoeFamily::kQwenMoe, layer, x);
    // Experts nobody chose get a zero gradient, not an undefined one.
    const torch::Tensor gate_grad = layer->named_parameters()["experts.gate"].grad();
    EXPECT_EQ(gate_grad[1].abs().max().item<double>(), 0.0);
    EXPECT_EQ(gate_grad[3].abs().max().item<double>(), 0.0);
    EXPECT_GT(gate_grad[2].abs().max().item<double>(), 0.0);
  }
}

// Two experts, hidden size 1, router [[1], [-1]]: a token x has probabilities
// (1 / (1 + e^{-2x}), 1 / (1 + e^{2x})), so x = ln(3) / 2 gives (3/4, 1/4).
MoeLayer TwoExpertLayer(int64_t top_k) {
  MoeOptions options;
  options.hidden_size = 1;
  options.num_experts = 2;
  options.top_k = top_k;
  options.expert_intermediate_size = 2;
  MoeLayer layer = MakeLayer(options, 10);
  const torch::NoGradGuard no_grad;
  layer->named_parameters()["router.weight"].copy_(torch::tensor({{1.0}, {-1.0}}, torch::kFloat64));
  return layer;
}

TEST(MoeLayerTest, AuxLossHandComputed) {
  const double a = std::log(3.0) / 2;
  {
    // Both tokens pick expert 0: f = (1, 0), P = (3/4, 1/4): 2 * 3/4.
    MoeLayer layer = TwoExpertLayer(1);
    const MoeOutput out = layer->forward(torch::tensor({{a}, {a}}, torch::kFloat64));
    EXPECT_NEAR(Scalar(out.aux_loss), 1.5, 1e-12);
    EXPECT_THAT(ToVector(out.tokens_per_expert), ElementsAre(2, 0));
    EXPECT_NEAR(Scalar(out.router_prob_mean[0]), 0.75, 1e-12);
  }
  {
    // One token each: f = (1/2, 1/2), P = (1/2, 1/2): balanced, 2 * (1/4 + 1/4) = 1.
    MoeLayer layer = TwoExpertLayer(1);
    const MoeOutput out = layer->forward(torch::tensor({{a}, {-a}}, torch::kFloat64));
    EXPECT_NEAR(Scalar(out.aux_loss), 1.0, 1e-12);
    EXPECT_THAT(ToVector(out.tokens_per_expert), ElementsAre(1, 1));
  }
  {
    // top_k 2 of 2: f = (1, 1) whatever P is (HF's convention: top_k when balanced), so 2.
    MoeLayer layer = TwoExpertLayer(2);
    const MoeOutput out = layer->forward(torch::tensor({{a}, {a}, {0.3}}, torch::kFloat64));
    EXPECT_NEAR(Scalar(out.aux_loss), 2.0, 1e-12);
  }
}

// transformers' load_balancing_loss_func, written as it is there (one-hot mask, means over
// tokens, then over top-k positions and experts), on one layer's router logits.
torch::Tensor HfLoadBalancingLoss(const torch::Tensor& logits, int64_t num_experts, int64_t top_k) {
  const torch::Tensor routing_weights = torch::softmax(logits, -1);
  const torch::Tensor selected = std::get<1>(torch::topk(routing_weights, top_k, -1));
  const torch::Tensor expert_mask = torch::one_hot(selected, num_experts);
  const torch::Tensor tokens_per_expert = expert_mask.to(logits.scalar_type()).mean(0);
  const torch::Tensor router_prob_per_expert = routing_weights.mean(0);
  return (tokens_per_expert * router_prob_per_expert.unsqueeze(0)).sum() *
         static_cast<double>(num_experts);
}

TEST(MoeLayerTest, AuxLossEqualsHfFormulaOnRandomInputs) {
  for (int64_t top_k : {1, 2, 3}) {
    MoeOptions options = SmallOptions(top_k, true, false);
    options.num_experts = 6;
    MoeLayer layer = MakeLayer(options, 20 + top_k);
    torch::manual_seed(30 + top_k);
    const torch::Tensor x = torch::randn({4, 11, options.hidden_size}, torch::kFloat64);
    const MoeOutput out = layer->forward(x);
    const torch::Tensor logits = torch::mm(x.reshape({-1, options.hidden_size}),
                                           layer->named_parameters()["router.weight"].t());
    EXPECT_NEAR(Scalar(out.aux_loss), Scalar(HfLoadBalancingLoss(logits, 6, top_k)), 1e-12)
        << "top_k " << top_k;
  }
}

TEST(MoeLayerTest, ParameterNamesAndShapes) {
  MoeOptions options = SmallOptions(2, true, /*shared=*/true);
  options.num_shared_experts = 1;
  MoeLayer layer = MakeLayer(options, 11);
  std::vector<std::pair<std::string, std::vector<int64_t>>> params;
  for (const auto& p : layer->named_parameters()) {
    params.emplace_back(p.key(), p.value().sizes().vec());
  }
  using Shape = std::vector<int64_t>;
  EXPECT_THAT(params, ElementsAre(std::pair<std::string, Shape>{"router.weight", {4, 8}},
                                  std::pair<std::string, Shape>{"experts.gate", {4, 6, 8}},
                                  std::pair<std::string, Shape>{"experts.up", {4, 6, 8}},
                                  std::pair<std::string, Shape>{"experts.down", {4, 8, 6}},
                                  std::pair<std::string, Shape>{"shared.gate", {5, 8}},
                                  std::pair<std::string, Shape>{"shared.up", {5, 8}},
                                  std::pair<std::string, Shape>{"shared.down", {8, 5}},
                                  std::pair<std::string, Shape>{"shared.sigmoid_gate", {1, 8}}));

  // HfMoeParameterNames lists the same parameters in the same order.
  const auto names = HfMoeParameterNames(options, HfMoeFamily::kQwenMoe);
  ASSERT_TRUE(names.ok()) << names.status();
  ASSERT_EQ(names->size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) EXPECT_EQ((*names)[i].name, params[i].first);
  EXPECT_THAT((*names)[1].hf_names,
              ElementsAre("experts.0.gate_proj.weight", "experts.1.gate_proj.weight",
                          "experts.2.gate_proj.weight", "experts.3.gate_proj.weight"));
  EXPECT_TRUE((*names)[1].stacked);
  EXPECT_THAT((*names)[0].hf_names, ElementsAre("gate.weight"));
  EXPECT_FALSE((*names)[0].stacked);
  EXPECT_THAT((*names)[7].hf_names, ElementsAre("shared_expert_gate.weight"));
  EXPECT_EQ(HfMoeBlockName(HfMoeFamily::kQwenMoe), "mlp");
  EXPECT_EQ(HfMoeBlockName(HfMoeFamily::kMixtral), "block_sparse_moe");

  MoeOptions plain = SmallOptions(2, true, /*shared=*/false);
  plain.num_experts = 1;
  plain.top_k = 1;
  const auto mixtral = HfMoeParameterNames(plain, HfMoeFamily::kMixtral);
  ASSERT_TRUE(mixtral.ok()) << mixtral.status();
  ASSERT_EQ(mixtral->size(), 4u);
  EXPECT_THAT((*mixtral)[3].hf_names, ElementsAre("experts.0.w2.weight"));
  EXPECT_TRUE((*mixtral)[3].stacked) << "one expert is still a stack of one";
  EXPECT_EQ(MakeLayer(plain, 12)->named_parameters().size(), 4u);

  // Families that cannot hold the options.
  EXPECT_EQ(HfMoeParameterNames(options, HfMoeFamily::kMixtral).status().code(),
            absl::StatusCode::kInvalidArgument);
  MoeOptions ungated = options;
  ungated.shared_expert_gate = false;
  EXPECT_EQ(HfMoeParameterNames(ungated, HfMoeFamily::kQwenMoe).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(MoeLayerTest, MetaDeviceHasShapesOnly) {
  const MoeOptions options = SmallOptions(2, true, true);
  MoeLayer layer(options, torch::TensorOptions().device(torch::kMeta));
  const auto params = layer->named_parameters();
  EXPECT_TRUE(params["experts.down"].is_meta());
  EXPECT_EQ(params["experts.down"].sizes().vec(), (std::vector<int64_t>{4, 8, 6}));
}

TEST(MoeLayerTest, LowPrecisionRoutesInFloat32) {
  const MoeOptions options = SmallOptions(2, true, true);
  torch::manual_seed(13);
  MoeLayer layer(options, torch::kFloat32);
  torch::manual_seed(14);
  const torch::Tensor x = torch::randn({2, 5, options.hidden_size});
  const MoeOutput full = layer->forward(x);
  layer->to(torch::kBFloat16);
  const MoeOutput half = layer->forward(x.to(torch::kBFloat16));
  EXPECT_EQ(half.output.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(half.aux_loss.scalar_type(), torch::kFloat32);
  EXPECT_EQ(
      layer->Route(x.reshape({-1, options.hidden_size}).to(torch::kBFloat16)).probs.scalar_type(),
      torch::kFloat32);
  EXPECT_TRUE(torch::allclose(half.output.to(torch::kFloat32), full.output, 5e-2, 5e-2));
}

TEST(MoeLayerTest, ValidationNamesTheField) {
  MoeOptions options = SmallOptions(2, true, false);
  EXPECT_TRUE(ValidateMoeOptions(options).ok());
  options.top_k = 5;
  EXPECT_THAT(ValidateMoeOptions(options).message(), HasSubstr("moe.top_k"));
  options = SmallOptions(2, true, false);
  options.shared_intermediate_size = 4;
  EXPECT_THAT(ValidateMoeOptions(options).message(), HasSubstr("moe.num_shared_experts"));
  options = SmallOptions(2, true, false);
  options.expert_intermediate_size = 0;
  EXPECT_EQ(ValidateMoeOptions(options).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ValidateMoeOptions(options).message(), HasSubstr("moe.expert_intermediate_size"));
  EXPECT_THROW(MoeLayer(options, torch::kFloat64), c10::Error);
}

}  // namespace
}  // namespace tessera::trainer

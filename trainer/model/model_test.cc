// CausalLM against references computed another way: parameter counts from model_config, a
// hand-written double-precision forward pass, grouped-query attention against multi-head
// attention with repeated k/v weights, rotary relative-position invariance, and training steps;
// activation checkpointing against the uncheckpointed model (bitwise on CPU) and against the bytes
// a layer's input takes, and the layer hooks' calls.

#include "trainer/model/model.h"

#include <ATen/autocast_mode.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <map>
#include <numbers>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/model_config.h"
#include "trainer/kernels/device.h"
#include "trainer/kernels/fused_ops.h"
#include "trainer/model/model_dims_fixture.h"
#include "trainer/torch_pch.h"

namespace tessera::trainer {
namespace {

using ::tessera::testing::IsOk;
using Tensor = torch::Tensor;

using testing::PresetDims;
using testing::TinyQwenDims;

std::vector<std::pair<std::string, v1::ModelDims>> TinyModels() {
  return {{"tiny-gpt2", PresetDims("tiny-gpt2")},
          {"tiny-llama", PresetDims("tiny-llama")},
          {"tiny-qwen", TinyQwenDims()}};
}

CausalLM MakeModel(const v1::ModelDims& dims, uint64_t seed = 7) {
  torch::manual_seed(seed);
  return CausalLM(dims, 0.02);
}

Tensor RandomTokens(const v1::ModelDims& dims, int64_t batch, int64_t seq) {
  return torch::randint(dims.vocab_size(), {batch, seq}, torch::kLong);
}

int64_t NumelOf(const std::vector<Tensor>& tensors) {
  int64_t total = 0;
  for (const Tensor& t : tensors) total += t.numel();
  return total;
}

// ---- A reference forward pass in float64, written without the module's helpers. ----

class Reference {
 public:
  explicit Reference(CausalLM& model) : dims_(model->dims()) {
    for (const auto& item : model->named_parameters()) {
      params_[item.key()] = item.value().detach().to(torch::kFloat64);
    }
  }

  Tensor Logits(const Tensor& tokens) {
    const int64_t seq = tokens.size(1);
    const bool llama = dims_.architecture() == v1::ARCHITECTURE_LLAMA;
    Tensor h = P("embed.weight").index({tokens});
    if (!llama) h = h + P("pos_embed.weight").slice(0, 0, seq);
    for (int i = 0; i < dims_.num_layers(); ++i) {
      const std::string prefix = "layers." + std::to_string(i) + ".";
      h = h + Attention(Norm(h, prefix + "attn_norm"), prefix + "attn.", llama);
      Tensor x = Norm(h, prefix + "mlp_norm");
      if (llama) {
        Tensor gate = Linear(x, prefix + "mlp.gate", false);
        h = h + Linear(gate * torch::sigmoid(gate) * Linear(x, prefix + "mlp.up", false),
                       prefix + "mlp.down", false);
      } else {
        Tensor u = Linear(x, prefix + "mlp.fc", true);
        Tensor gelu =
            0.5 * u *
            (1 + torch::tanh(std::sqrt(2 / std::numbers::pi) * (u + 0.044715 * u.pow(3))));
        h = h + Linear(gelu, prefix + "mlp.proj", true);
      }
    }
    h = Norm(h, "final_norm");
    Tensor head = dims_.tie_embeddings() ? P("embed.weight") : P("lm_head");
    return torch::matmul(h, head.t());
  }

 private:
  Tensor P(const std::string& name) {
    auto it = params_.find(name);
    if (it == params_.end()) {
      ADD_FAILURE() << "no parameter " << name;
      return Tensor();
    }
    return it->second;
  }

  Tensor Linear(const Tensor& x, const std::string& name, bool bias) {
    Tensor y = torch::matmul(x, P(name + ".weight").t());
    return bias ? y + P(name + ".bias") : y;
  }

  Tensor Norm(const Tensor& x, const std::string& name) {
    if (dims_.architecture() == v1::ARCHITECTURE_LLAMA) {
      return x / torch::sqrt((x * x).mean(-1, true) + dims_.norm_eps()) * P(name + ".weight");
    }
    Tensor centered = x - x.mean(-1, true);
    Tensor variance = (centered * centered).mean(-1, true);
    return centered / torch::sqrt(variance + dims_.norm_eps()) * P(name + ".weight") +
           P(name + ".bias");
  }

  // x [batch, seq, heads, head_dim]: pairs (i, i + half) rotate by position * theta^(-2i/hd).
  Tensor Rotate(const Tensor& x) {
    const int64_t seq = x.size(1), hd = x.size(3), half = hd / 2;
    Tensor cos = torch::empty({seq, half}, torch::kFloat64);
    Tensor sin = torch::empty({seq, half}, torch::kFloat64);
    for (int64_t p = 0; p < seq; ++p) {
      for (int64_t i = 0; i < half; ++i) {
        double angle = p * std::pow(dims_.rope_theta(), -2.0 * i / hd);
        cos[p][i] = std::cos(angle);
        sin[p][i] = std::sin(angle);
      }
    }
    cos = cos.unsqueeze(1);
    sin = sin.unsqueeze(1);
    Tensor a = x.slice(3, 0, half), b = x.slice(3, half, hd);
    return torch::cat({a * cos - b * sin, b * cos + a * sin}, 3);
  }

  Tensor Attention(const Tensor& x, const std::string& prefix, bool llama) {
    const int64_t batch = x.size(0), seq = x.size(1);
    const int64_t heads = dims_.num_attention_heads(), kv_heads = dims_.num_kv_heads();
    const int64_t hd = dims_.head_dim();
    Tensor q, k, v;
    if (llama) {
      q = Linear(x, prefix + "q", false).view({batch, seq, heads, hd});
      k = Linear(x, prefix + "k", false).view({batch, seq, kv_heads, hd});
      v = Linear(x, prefix + "v", false).view({batch, seq, kv_heads, hd});
      if (dims_.qk_norm()) {
        auto rms = [&](const Tensor& t, const std::string& name) {
          return t / torch::sqrt((t * t).mean(-1, true) + dims_.norm_eps()) * P(name);
        };
        q = rms(q, prefix + "q_norm.weight");
        k = rms(k, prefix + "k_norm.weight");
      }
      q = Rotate(q);
      k = Rotate(k);
    } else {
      Tensor qkv = Linear(x, prefix + "qkv", true);
      q = qkv.slice(2, 0, heads * hd).view({batch, seq, heads, hd});
      k = qkv.slice(2, heads * hd, 2 * heads * hd).view({batch, seq, heads, hd});
      v = qkv.slice(2, 2 * heads * hd, 3 * heads * hd).view({batch, seq, heads, hd});
    }
    Tensor mask = torch::ones({seq, seq}, torch::kBool).triu(1);
    std::vector<Tensor> outputs;
    for (int64_t head = 0; head < heads; ++head) {
      const int64_t kv = head / (heads / kv_heads);  // query heads share kv heads in groups
      Tensor qh = q.select(2, head), kh = k.select(2, kv), vh = v.select(2, kv);
      Tensor scores = torch::matmul(qh, kh.transpose(1, 2)) / std::sqrt(static_cast<double>(hd));
      scores = scores.masked_fill(mask, -std::numeric_limits<double>::infinity());
      outputs.push_back(torch::matmul(torch::softmax(scores, -1), vh));
    }
    return Linear(torch::cat(outputs, 2), prefix + (llama ? "o" : "proj"), !llama);
  }

  v1::ModelDims dims_;
  std::map<std::string, Tensor> params_;
};

TEST(ModelTest, ParameterCountMatchesConfig) {
  auto models = TinyModels();
  models.emplace_back("gpt2-124m", PresetDims("gpt2-124m"));
  for (const auto& [name, dims] : models) {
    CausalLM model(dims, 0.02);
    std::vector<Tensor> params = model->parameters();
    EXPECT_EQ(NumelOf(params), planner::CountParameters(dims)) << name;
    std::set<const void*> storages;
    for (const Tensor& p : params) storages.insert(p.data_ptr());
    EXPECT_EQ(storages.size(), params.size()) << name << ": a tensor is listed twice";
    EXPECT_EQ(NumelOf(model->DecayParameters()) + NumelOf(model->NoDecayParameters()),
              NumelOf(params))
        << name;
    for (const Tensor& p : model->NoDecayParameters()) EXPECT_EQ(p.dim(), 1) << name;
    EXPECT_EQ(model->named_parameters().contains("lm_head"), !dims.tie_embeddings()) << name;
  }
  EXPECT_EQ(planner::CountParameters(PresetDims("gpt2-124m")), 124'439'808);
}

TEST(ModelTest, DecayGroupsSplitMatricesFromVectors) {
  CausalLM model = MakeModel(PresetDims("tiny-gpt2"));
  // Matrices: wte, wpe and 4 linears per layer. Vectors: 2 norms * 2 + 4 biases per layer, ln_f
  // * 2.
  EXPECT_EQ(model->DecayParameters().size(), 2u + 2 * 4);
  EXPECT_EQ(model->NoDecayParameters().size(), 2u * 8 + 2);
}

TEST(ModelTest, ForwardShapes) {
  for (const auto& [name, dims] : TinyModels()) {
    CausalLM model = MakeModel(dims);
    Tensor logits = model->forward(RandomTokens(dims, 3, 11));
    EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{3, 11, dims.vocab_size()})) << name;
    EXPECT_EQ(logits.scalar_type(), torch::kFloat32) << name;
    EXPECT_TRUE(logits.isfinite().all().item<bool>()) << name;
  }
}

TEST(ModelTest, MatchesReferenceForward) {
  for (const auto& [name, dims] : TinyModels()) {
    // A larger init than the default so that attention is far from uniform and every term matters.
    torch::manual_seed(3);
    CausalLM model(dims, 0.2);
    Tensor tokens = RandomTokens(dims, 2, 9);
    Tensor logits = model->forward(tokens).to(torch::kFloat64);
    Tensor expected = Reference(model).Logits(tokens);
    EXPECT_LT((logits - expected).abs().max().item<double>(),
              1e-4 * expected.abs().max().item<double>())
        << name;
  }
}

TEST(ModelTest, IsCausal) {
  for (const auto& [name, dims] : TinyModels()) {
    CausalLM model = MakeModel(dims);
    torch::NoGradGuard no_grad;
    Tensor tokens = RandomTokens(dims, 2, 12);
    const int64_t t = 7;
    Tensor changed = tokens.clone();
    changed.index_put_({torch::indexing::Slice(), t},
                       (tokens.index({torch::indexing::Slice(), t}) + 1) % dims.vocab_size());
    Tensor before = model->forward(tokens), after = model->forward(changed);
    using torch::indexing::Slice;
    EXPECT_TRUE(torch::allclose(before.index({Slice(), Slice(0, t)}),
                                after.index({Slice(), Slice(0, t)}), 0, 1e-6))
        << name << ": a later token changed earlier logits";
    for (int64_t pos = t; pos < 12; ++pos) {
      EXPECT_FALSE(torch::allclose(before.select(1, pos), after.select(1, pos)))
          << name << ": position " << pos << " ignores token " << t;
    }
  }
}

// Three records packed into samples in two orders: with each token's position in its record, a
// record's logits are those it gets alone in a sample; without them (the records attend to
// each other) they are not.
TEST(ModelTest, PackedRecordsGetTheLogitsTheyGetAlone) {
  using torch::indexing::Slice;
  for (const auto& [name, dims] : TinyModels()) {
    torch::manual_seed(3);
    CausalLM model(dims, 0.2);
    torch::NoGradGuard no_grad;
    const std::vector<Tensor> records = {RandomTokens(dims, 1, 5), RandomTokens(dims, 1, 7),
                                         RandomTokens(dims, 1, 4)};
    const std::vector<std::vector<int>> orders = {{0, 1, 2}, {2, 0, 1}};
    std::vector<Tensor> rows, row_positions;
    for (const auto& order : orders) {
      std::vector<Tensor> parts, positions;
      for (int r : order) {
        parts.push_back(records[r]);
        positions.push_back(torch::arange(records[r].size(1), torch::kLong).unsqueeze(0));
      }
      rows.push_back(torch::cat(parts, 1));
      row_positions.push_back(torch::cat(positions, 1));
    }
    const Tensor tokens = torch::cat(rows, 0), positions = torch::cat(row_positions, 0);
    const Tensor packed = model->forward(tokens, positions);
    const Tensor mixed = model->forward(tokens);
    for (size_t row = 0; row < orders.size(); ++row) {
      int64_t offset = 0;
      for (int r : orders[row]) {
        const int64_t size = records[r].size(1);
        const Tensor alone = model->forward(records[r])[0];
        const Tensor got = packed[row].index({Slice(offset, offset + size)});
        EXPECT_TRUE(torch::allclose(got, alone, 1e-5, 1e-5))
            << name << " row " << row << " record " << r << ": max difference "
            << (got - alone).abs().max().item<double>();
        if (offset > 0) {
          EXPECT_FALSE(
              torch::allclose(mixed[row].index({Slice(offset, offset + size)}), alone, 1e-5, 1e-5))
              << name << " row " << row << " record " << r << ": attending across changed nothing";
        }
        offset += size;
      }
    }
  }
}

// The same packed batch trains alike with and without activation checkpointing: the records' mask
// and positions reach the recomputed layers.
TEST(ModelCheckpointingTest, PackedRecordsLossAndGradientsEqualUncheckpointed) {
  for (const auto& [name, dims] : TinyModels()) {
    torch::manual_seed(5);
    const Tensor tokens = RandomTokens(dims, 2, 12);
    const Tensor targets = RandomTokens(dims, 2, 12);
    const Tensor positions =
        torch::tensor({0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4},
                      torch::kLong)
            .view({2, 12});
    std::map<std::string, Tensor> reference;
    Tensor reference_loss;
    for (auto mode : {v1::ACTIVATION_CHECKPOINTING_NONE, v1::ACTIVATION_CHECKPOINTING_SELECTIVE,
                      v1::ACTIVATION_CHECKPOINTING_FULL}) {
      const std::string label = absl::StrCat(name, " ", v1::ActivationCheckpointing_Name(mode));
      CausalLM model = MakeModel(dims);
      model->SetActivationCheckpointing(mode);
      const Tensor loss = model->Loss(tokens, targets, positions);
      loss.backward();
      if (mode == v1::ACTIVATION_CHECKPOINTING_NONE) {
        reference_loss = loss.detach();
        for (const auto& item : model->named_parameters()) {
          reference[item.key()] = item.value().grad().clone();
        }
        continue;
      }
      EXPECT_TRUE(torch::equal(loss.detach(), reference_loss)) << label;
      for (const auto& item : model->named_parameters()) {
        EXPECT_TRUE(torch::equal(item.value().grad(), reference.at(item.key())))
            << label << " " << item.key();
      }
    }
  }
}

TEST(ModelTest, GroupedQueryAttentionEqualsMultiHeadWithRepeatedKv) {
  for (int kv_heads : {1, 2}) {
    v1::ModelDims gqa = PresetDims("tiny-llama");
    gqa.set_num_kv_heads(kv_heads);
    v1::ModelDims mha = gqa;
    mha.set_num_kv_heads(gqa.num_attention_heads());
    torch::manual_seed(5);
    CausalLM grouped(gqa, 0.2), full(mha, 0.2);
    const int64_t group = gqa.num_attention_heads() / kv_heads, hd = gqa.head_dim();
    {
      torch::NoGradGuard no_grad;
      auto source = grouped->named_parameters();
      for (auto& item : full->named_parameters()) {
        Tensor from = source[item.key()];
        const std::string& key = item.key();
        const bool is_kv = key.ends_with("attn.k.weight") || key.ends_with("attn.v.weight");
        if (is_kv) {
          // Rows of kv head j serve query heads j*group .. j*group+group-1.
          from =
              from.view({kv_heads, hd, -1}).repeat_interleave(group, 0).reshape({-1, from.size(1)});
        }
        item.value().copy_(from);
      }
    }
    Tensor tokens = RandomTokens(gqa, 2, 10);
    EXPECT_TRUE(torch::allclose(grouped->forward(tokens), full->forward(tokens), 1e-5, 1e-5))
        << "kv_heads " << kv_heads;
  }
}

TEST(ModelTest, InitialLossIsNearLogVocab) {
  for (const auto& [name, dims] : TinyModels()) {
    CausalLM model = MakeModel(dims);
    Tensor inputs = RandomTokens(dims, 4, 32), targets = RandomTokens(dims, 4, 32);
    Tensor loss = model->Loss(inputs, targets);
    EXPECT_EQ(loss.dim(), 0);
    EXPECT_NEAR(loss.item<double>(), std::log(dims.vocab_size()), 0.5) << name;
    // Against log-softmax picked at the targets.
    Tensor log_probs = torch::log_softmax(model->forward(inputs).to(torch::kFloat64), -1);
    double expected = -log_probs.gather(-1, targets.unsqueeze(-1)).mean().item<double>();
    EXPECT_NEAR(loss.item<double>(), expected, 1e-5) << name;
  }
}

TEST(ModelTest, RotaryScoresDependOnlyOnRelativePosition) {
  const int64_t seq = 64, hd = 32;
  auto [cos, sin] = RotaryTables(seq, hd, 10000);
  ASSERT_EQ(cos.sizes(), (std::vector<int64_t>{seq, hd}));
  torch::manual_seed(11);
  // The same query and key vector at every position: rotation is the only thing that varies.
  Tensor q = ApplyRotary(torch::randn({hd}).expand({seq, hd}), cos, sin);
  Tensor k = ApplyRotary(torch::randn({hd}).expand({seq, hd}), cos, sin);
  Tensor scores = torch::matmul(q, k.t());
  for (auto [i, j] : std::vector<std::pair<int, int>>{{5, 2}, {9, 9}, {3, 17}, {40, 1}}) {
    for (int shift : {1, 7, 20}) {
      EXPECT_NEAR(scores[i][j].item<double>(), scores[i + shift][j + shift].item<double>(), 1e-4)
          << "(" << i << ", " << j << ") shifted by " << shift;
    }
  }
  // And they do depend on the relative position.
  EXPECT_GT(std::abs(scores[5][2].item<double>() - scores[5][4].item<double>()), 1e-3);
  // Position 0 is the identity; every rotation preserves length.
  Tensor x = torch::randn({seq, hd});
  Tensor rotated = ApplyRotary(x, cos, sin);
  EXPECT_TRUE(torch::allclose(rotated[0], x[0]));
  EXPECT_TRUE(torch::allclose(rotated.norm(2, -1), x.norm(2, -1), 1e-5, 1e-5));
  // Rotate-half layout: the first pair (0, hd/2) turns by exactly one radian at position 1.
  EXPECT_NEAR(cos[1][0].item<double>(), std::cos(1.0), 1e-7);
  EXPECT_NEAR(cos[1][hd / 2].item<double>(), std::cos(1.0), 1e-7);
  EXPECT_NEAR(sin[3][1].item<double>(), std::sin(3 * std::pow(10000.0, -2.0 / hd)), 1e-7);
}

TEST(ModelTest, RmsNormMatchesFormulaAndKeepsDtype) {
  torch::manual_seed(2);
  Tensor x = torch::randn({3, 5, 16}), w = torch::randn({16});
  Tensor x64 = x.to(torch::kFloat64);
  Tensor expected = x64 / torch::sqrt(x64.pow(2).mean(-1, true) + 1e-6) * w.to(torch::kFloat64);
  EXPECT_TRUE(torch::allclose(RmsNorm(x, w, 1e-6).to(torch::kFloat64), expected, 1e-5, 1e-6));
  EXPECT_EQ(RmsNorm(x.to(torch::kBFloat16), w, 1e-6).scalar_type(), torch::kBFloat16);
}

TEST(ModelTest, InitializationIsSeededAndScaled) {
  v1::ModelDims dims = PresetDims("tiny-gpt2");
  CausalLM a = MakeModel(dims, 1), b = MakeModel(dims, 1), c = MakeModel(dims, 2);
  auto pa = a->parameters(), pb = b->parameters(), pc = c->parameters();
  bool any_differs = false;
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_TRUE(torch::equal(pa[i], pb[i])) << "parameter " << i;
    any_differs |= !torch::equal(pa[i], pc[i]);
  }
  EXPECT_TRUE(any_differs) << "another seed gave the same model";

  // Larger tensors for stable statistics.
  v1::ModelDims wide = dims;
  wide.set_hidden_size(256);
  wide.set_ffn_hidden_size(1024);
  wide.set_head_dim(64);
  torch::manual_seed(3);
  CausalLM model(wide, 0.05);
  auto named = model->named_parameters();
  EXPECT_NEAR(named["embed.weight"].std().item<double>(), 0.05, 0.002);
  EXPECT_NEAR(named["layers.0.attn.qkv.weight"].std().item<double>(), 0.05, 0.002);
  EXPECT_NEAR(named["layers.1.mlp.proj.weight"].std().item<double>(), 0.05 / 2, 0.002);
  EXPECT_NEAR(named["layers.0.attn.proj.weight"].std().item<double>(), 0.05 / 2, 0.002);
  EXPECT_TRUE(torch::equal(named["layers.0.attn.qkv.bias"],
                           torch::zeros_like(named["layers.0.attn.qkv.bias"])));
  EXPECT_TRUE(torch::equal(named["final_norm.weight"], torch::ones({256})));
  EXPECT_TRUE(torch::equal(named["final_norm.bias"], torch::zeros({256})));
}

TEST(ModelTest, AdamWStepsOnARepeatedBatchLowerTheLoss) {
  for (const auto& [name, dims] : TinyModels()) {
    CausalLM model = MakeModel(dims);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(model->DecayParameters(),
                        std::make_unique<torch::optim::AdamWOptions>(
                            torch::optim::AdamWOptions(3e-3).weight_decay(0.1)));
    groups.emplace_back(model->NoDecayParameters(),
                        std::make_unique<torch::optim::AdamWOptions>(
                            torch::optim::AdamWOptions(3e-3).weight_decay(0.0)));
    torch::optim::AdamW optimizer(std::move(groups));
    Tensor tokens = RandomTokens(dims, 4, 33);
    using torch::indexing::Slice;
    Tensor inputs = tokens.index({Slice(), Slice(0, 32)}),
           targets = tokens.index({Slice(), Slice(1)});
    double first = 0, last = 0;
    for (int step = 0; step < 10; ++step) {
      optimizer.zero_grad();
      Tensor loss = model->Loss(inputs, targets);
      loss.backward();
      optimizer.step();
      (step == 0 ? first : last) = loss.item<double>();
    }
    EXPECT_LT(last, first - 0.3) << name;
    for (const Tensor& p : model->parameters()) ASSERT_TRUE(p.grad().defined()) << name;
  }
}

TEST(ModelTest, Bf16AutocastTracksFloat32) {
  for (const auto& [name, dims] : TinyModels()) {
    CausalLM model = MakeModel(dims);
    Tensor inputs = RandomTokens(dims, 2, 16), targets = RandomTokens(dims, 2, 16);
    const double reference = model->Loss(inputs, targets).item<double>();
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::autocast::set_autocast_enabled(at::kCPU, true);
    Tensor loss = model->Loss(inputs, targets);
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
    EXPECT_EQ(loss.scalar_type(), torch::kFloat32) << name;
    EXPECT_NEAR(loss.item<double>(), reference, 0.05) << name;
    loss.backward();
    for (const Tensor& p : model->parameters()) {
      ASSERT_TRUE(p.grad().defined()) << name;
      EXPECT_EQ(p.grad().scalar_type(), torch::kFloat32) << name;
    }
  }
}

TEST(ModelTest, RejectsTooLongSequence) {
  v1::ModelDims dims = PresetDims("tiny-llama");
  CausalLM model = MakeModel(dims);
  EXPECT_THROW(model->forward(RandomTokens(dims, 1, dims.max_seq_len() + 1)), c10::Error);
  EXPECT_NO_THROW(model->forward(RandomTokens(dims, 1, dims.max_seq_len())));
  EXPECT_THROW(CausalLM(v1::ModelDims(), 0.02), c10::Error);
}

TEST(ModelTest, CudaMatchesCpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible";
  for (const auto& [name, dims] : TinyModels()) {
    CausalLM model = MakeModel(dims);
    Tensor inputs = RandomTokens(dims, 2, 64), targets = RandomTokens(dims, 2, 64);
    const double cpu_loss = model->Loss(inputs, targets).item<double>();
    model->to(torch::kCUDA);
    Tensor gpu_inputs = inputs.to(torch::kCUDA), gpu_targets = targets.to(torch::kCUDA);
    EXPECT_NEAR(model->Loss(gpu_inputs, gpu_targets).item<double>(), cpu_loss, 1e-3) << name;
    at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
    at::autocast::set_autocast_enabled(at::kCUDA, true);
    Tensor loss = model->Loss(gpu_inputs, gpu_targets);
    at::autocast::set_autocast_enabled(at::kCUDA, false);
    at::autocast::clear_cache();
    EXPECT_NEAR(loss.item<double>(), cpu_loss, 0.05) << name;
    loss.backward();
    for (const Tensor& p : model->parameters()) ASSERT_TRUE(p.grad().defined()) << name;
  }
}

// ---- Activation checkpointing and layer hooks. ----

constexpr v1::ActivationCheckpointing kNone = v1::ACTIVATION_CHECKPOINTING_NONE;
constexpr v1::ActivationCheckpointing kSelective = v1::ACTIVATION_CHECKPOINTING_SELECTIVE;
constexpr v1::ActivationCheckpointing kFull = v1::ACTIVATION_CHECKPOINTING_FULL;

struct TrainingRecord {
  std::vector<Tensor> losses;
  std::vector<std::map<std::string, Tensor>> gradients;  // per step, by parameter name
};

// Two AdamW steps on one batch, recording each step's loss and gradients.
TrainingRecord TrainTwoSteps(const v1::ModelDims& dims, v1::ActivationCheckpointing mode,
                             torch::Device device = torch::kCPU, bool autocast = false) {
  CausalLM model = MakeModel(dims);
  model->SetActivationCheckpointing(mode);
  model->to(device);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::manual_seed(21);
  Tensor tokens = RandomTokens(dims, 3, 25).to(device);
  using torch::indexing::Slice;
  Tensor inputs = tokens.index({Slice(), Slice(0, 24)}),
         targets = tokens.index({Slice(), Slice(1)});
  TrainingRecord record;
  for (int step = 0; step < 2; ++step) {
    optimizer.zero_grad();
    if (autocast) {
      at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
      at::autocast::set_autocast_enabled(at::kCUDA, true);
    }
    Tensor loss = model->Loss(inputs, targets);
    if (autocast) {
      at::autocast::set_autocast_enabled(at::kCUDA, false);
      at::autocast::clear_cache();
    }
    loss.backward();
    record.losses.push_back(loss.detach().cpu());
    auto& grads = record.gradients.emplace_back();
    for (const auto& item : model->named_parameters()) {
      EXPECT_TRUE(item.value().grad().defined()) << item.key();
      if (item.value().grad().defined()) grads[item.key()] = item.value().grad().cpu().clone();
    }
    optimizer.step();
  }
  return record;
}

TEST(ModelCheckpointingTest, LossesAndGradientsEqualUncheckpointedBitwise) {
  for (const auto& [name, dims] : TinyModels()) {
    const TrainingRecord reference = TrainTwoSteps(dims, kNone);
    for (auto mode : {kSelective, kFull}) {
      const std::string label = absl::StrCat(name, " ", v1::ActivationCheckpointing_Name(mode));
      const TrainingRecord record = TrainTwoSteps(dims, mode);
      ASSERT_EQ(record.losses.size(), reference.losses.size()) << label;
      for (size_t step = 0; step < record.losses.size(); ++step) {
        EXPECT_TRUE(torch::equal(record.losses[step], reference.losses[step]))
            << label << " step " << step << ": " << record.losses[step].item<double>() << " vs "
            << reference.losses[step].item<double>();
        ASSERT_EQ(record.gradients[step].size(), reference.gradients[step].size()) << label;
        for (const auto& [param, grad] : reference.gradients[step]) {
          EXPECT_TRUE(torch::equal(record.gradients[step].at(param), grad))
              << label << " step " << step << " " << param;
        }
      }
    }
  }
}

// Counts the bytes held by tensors that the CPU allocator hands out while installed.
class CountingCpuAllocator final : public c10::Allocator {
 public:
  static CountingCpuAllocator& Instance() {
    static auto* allocator = new CountingCpuAllocator();  // outlives every tensor it allocated
    return *allocator;
  }

  c10::DataPtr allocate(size_t n) override {
    auto* block = new Block{base_->allocate(n), n};
    live_ += static_cast<int64_t>(n);
    void* data = block->inner.get();
    return {data, block, &Free, block->inner.device()};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  int64_t live() const { return live_.load(); }

  // Installs the counter as LibTorch's CPU allocator for the guard's lifetime.
  class Installed {
   public:
    Installed() : previous_(c10::GetCPUAllocator()) {
      c10::SetCPUAllocator(&Instance(), kPriority);
    }
    ~Installed() { c10::SetCPUAllocator(previous_, kPriority); }

   private:
    static constexpr uint8_t kPriority = 100;
    c10::Allocator* previous_;
  };

 private:
  struct Block {
    c10::DataPtr inner;
    size_t bytes;
  };
  static void Free(void* context) {
    auto* block = static_cast<Block*>(context);
    Instance().live_ -= static_cast<int64_t>(block->bytes);
    delete block;
  }

  c10::Allocator* base_ = c10::GetDefaultCPUAllocator();
  std::atomic<int64_t> live_{0};
};

constexpr int64_t kBatch = 4, kSeq = 32;

// Bytes of CPU tensors a forward pass (to the loss) leaves alive, i.e. that autograd keeps.
int64_t BytesKeptForBackward(v1::ModelDims dims, int layers, v1::ActivationCheckpointing mode) {
  dims.set_num_layers(layers);
  CausalLM model = MakeModel(dims);
  model->SetActivationCheckpointing(mode);
  Tensor inputs = RandomTokens(dims, kBatch, kSeq), targets = RandomTokens(dims, kBatch, kSeq);
  model->Loss(inputs, targets).backward();  // warm-up: lazily made buffers are not activations
  CountingCpuAllocator::Installed counting;
  const int64_t before = CountingCpuAllocator::Instance().live();
  Tensor loss = model->Loss(inputs, targets);
  return CountingCpuAllocator::Instance().live() - before;
}

TEST(ModelCheckpointingTest, FullKeepsOnlyEachLayersInputAndSelectiveDropsRecomputedTensors) {
  const int64_t rng_state_bytes =
      at::globalContext().defaultGenerator(c10::kCPU).get_state().nbytes();
  for (const auto& [name, dims] : TinyModels()) {
    // Two more layers isolate what one layer keeps from the embeddings' and the head's share.
    auto per_layer = [&](v1::ActivationCheckpointing mode) {
      return (BytesKeptForBackward(dims, 4, mode) - BytesKeptForBackward(dims, 2, mode)) / 2;
    };
    const int64_t none = per_layer(kNone), selective = per_layer(kSelective),
                  full = per_layer(kFull);
    const int64_t layer_input = kBatch * kSeq * dims.hidden_size() * 4;
    // The layer's float32 input and the CPU generator's state the recompute replays.
    EXPECT_EQ(full, layer_input + rng_state_bytes) << name;
    // SELECTIVE frees the MLP activation outputs (GELU's, or SwiGLU's product; ATen's composite
    // SwiGLU, with fused kernels off, also keeps silu(gate)) and what the attention kernel keeps
    // besides q, k, v (its output stays: the output projection reads the same storage), and adds
    // two generator states.
    const bool composite_swiglu =
        dims.architecture() == v1::ARCHITECTURE_LLAMA && !FusedKernelsEnabled();
    const int64_t mlp_recomputed =
        (composite_swiglu ? 2 : 1) * kBatch * kSeq * dims.ffn_hidden_size() * 4;
    EXPECT_LE(selective, none - mlp_recomputed + 2 * rng_state_bytes) << name;
    EXPECT_GT(selective, full) << name;
    EXPECT_GT(none, 4 * full) << name;
  }
}

// Records the layer hooks' calls and, through autograd hooks on the layer outputs, when backward
// reaches each layer.
class RecordingHooks : public LayerHooks {
 public:
  void BeforeLayer(int layer) override { events.push_back(absl::StrCat("before ", layer)); }
  Tensor AfterLayer(int layer, Tensor output) override {
    events.push_back(absl::StrCat("after ", layer));
    output.register_hook(
        [this, layer](const Tensor&) { events.push_back(absl::StrCat("backward ", layer)); });
    return output * scale;
  }

  double scale = 1.0;
  std::vector<std::string> events;
};

TEST(ModelCheckpointingTest, LayerHooksRunAroundEachLayerOnceAndNotInRecompute) {
  v1::ModelDims dims = PresetDims("tiny-llama");
  dims.set_num_layers(3);
  for (auto mode : {kNone, kSelective, kFull}) {
    CausalLM model = MakeModel(dims);
    model->SetActivationCheckpointing(mode);
    RecordingHooks hooks;
    model->SetLayerHooks(&hooks);
    Tensor inputs = RandomTokens(dims, 2, 8), targets = RandomTokens(dims, 2, 8);
    Tensor loss = model->Loss(inputs, targets);
    EXPECT_EQ(hooks.events, (std::vector<std::string>{"before 0", "after 0", "before 1", "after 1",
                                                      "before 2", "after 2"}))
        << v1::ActivationCheckpointing_Name(mode);
    hooks.events.clear();
    loss.backward();
    EXPECT_EQ(hooks.events, (std::vector<std::string>{"backward 2", "backward 1", "backward 0"}))
        << v1::ActivationCheckpointing_Name(mode);

    // The model continues with what AfterLayer returns.
    hooks.scale = 0.5;
    Tensor scaled = model->forward(inputs);
    model->SetLayerHooks(nullptr);
    hooks.events.clear();
    Tensor plain = model->forward(inputs);
    EXPECT_TRUE(hooks.events.empty());
    EXPECT_FALSE(torch::allclose(scaled, plain));
  }
}

TEST(ModelCheckpointingTest, LayerParametersPartitionNamedParameters) {
  for (const auto& [name, dims] : TinyModels()) {
    CausalLM model = MakeModel(dims);
    std::vector<std::pair<std::string, Tensor>> all;
    for (int layer = -1; layer < dims.num_layers(); ++layer) {
      auto params = model->LayerParameters(layer);
      EXPECT_FALSE(params.empty()) << name << " layer " << layer;
      for (const auto& [param, tensor] : params) {
        if (layer >= 0) {
          EXPECT_TRUE(param.starts_with(absl::StrCat("layers.", layer, "."))) << param;
        } else {
          EXPECT_FALSE(param.starts_with("layers.")) << param;
        }
      }
      all.insert(all.end(), params.begin(), params.end());
    }
    // Every parameter exactly once; within a part, in named_parameters() order.
    auto named = model->named_parameters();
    ASSERT_EQ(all.size(), named.size()) << name;
    std::map<std::string, size_t> position;
    for (size_t i = 0; i < named.size(); ++i) position[named[i].key()] = i;
    for (size_t i = 0; i < all.size(); ++i) {
      ASSERT_TRUE(position.contains(all[i].first)) << all[i].first;
      EXPECT_TRUE(all[i].second.is_same(named[all[i].first])) << all[i].first;
      if (i > 0 && all[i - 1].first.substr(0, 9) == all[i].first.substr(0, 9)) {
        EXPECT_LT(position[all[i - 1].first], position[all[i].first]) << all[i].first;
      }
    }
    EXPECT_TRUE(position.contains("embed.weight") && position.contains("final_norm.weight"))
        << name;
    EXPECT_THROW(model->LayerParameters(dims.num_layers()), c10::Error);
    EXPECT_THROW(model->LayerParameters(-2), c10::Error);
  }
}

TEST(ModelCheckpointingTest, CudaAutocastCheckpointingTracksUncheckpointed) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible";
  for (const auto& [name, dims] : TinyModels()) {
    const TrainingRecord reference = TrainTwoSteps(dims, kNone, torch::kCUDA, /*autocast=*/true);
    for (auto mode : {kSelective, kFull}) {
      const std::string label = absl::StrCat(name, " ", v1::ActivationCheckpointing_Name(mode));
      const TrainingRecord record = TrainTwoSteps(dims, mode, torch::kCUDA, /*autocast=*/true);
      // The first forward is the same computation; later ones start from parameters that GPU
      // reductions in backward may have rounded differently.
      EXPECT_TRUE(torch::equal(record.losses[0], reference.losses[0])) << label;
      EXPECT_NEAR(record.losses[1].item<double>(), reference.losses[1].item<double>(), 1e-3)
          << label;
      // A recompute outside bf16 autocast would differ by bf16's rounding (~1e-2).
      for (const auto& [param, grad] : reference.gradients[0]) {
        const double error = (record.gradients[0].at(param) - grad).norm().item<double>();
        EXPECT_LE(error, 1e-3 * grad.norm().item<double>() + 1e-7) << label << " " << param;
      }
    }
  }
}

}  // namespace
}  // namespace tessera::trainer

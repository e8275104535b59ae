#include "planner/model_config.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "planner/hf_config.h"

namespace tessera::planner {
namespace {

using v1::ARCHITECTURE_GPT2;
using v1::ARCHITECTURE_LLAMA;

struct Preset {
  const char* name;
  v1::ModelDims dims;
};

// Published GPT-2 family shape: byte-pair vocabulary of 50257, tied embeddings, learned positions.
v1::ModelDims Gpt2Dims(int layers, int hidden, int heads, int max_seq_len) {
  v1::ModelDims dims;
  dims.set_architecture(ARCHITECTURE_GPT2);
  dims.set_num_layers(layers);
  dims.set_hidden_size(hidden);
  dims.set_num_attention_heads(heads);
  dims.set_vocab_size(50257);
  dims.set_max_seq_len(max_seq_len);
  dims.set_tie_embeddings(true);
  return dims;
}

v1::ModelDims LlamaDims(int layers, int hidden, int heads, int kv_heads, int ffn, int vocab,
                        int max_seq_len, double rope_theta, double norm_eps, bool tied) {
  v1::ModelDims dims;
  dims.set_architecture(ARCHITECTURE_LLAMA);
  dims.set_num_layers(layers);
  dims.set_hidden_size(hidden);
  dims.set_num_attention_heads(heads);
  dims.set_num_kv_heads(kv_heads);
  dims.set_ffn_hidden_size(ffn);
  dims.set_vocab_size(vocab);
  dims.set_max_seq_len(max_seq_len);
  dims.set_rope_theta(rope_theta);
  dims.set_norm_eps(norm_eps);
  dims.set_tie_embeddings(tied);
  return dims;
}

// Qwen3 dense models: Llama layout plus per-head qk_norm and head_dim 128 independent of width.
v1::ModelDims Qwen3Dims(int layers, int hidden, int heads, int ffn, bool tied) {
  v1::ModelDims dims =
      LlamaDims(layers, hidden, heads, /*kv_heads=*/8, ffn, /*vocab=*/151936,
                /*max_seq_len=*/40960, /*rope_theta=*/1e6, /*norm_eps=*/1e-6, tied);
  dims.set_head_dim(128);
  dims.set_qk_norm(true);
  return dims;
}

// Qwen3-30B-A3B (its config.json): 48 layers of 32 query and 4 key/value heads, every MLP a
// mixture of 128 experts 768 wide, 8 per token (norm_topk_prob), no shared expert; 30.5B
// parameters of which 3.3B active.
v1::ModelDims Qwen3MoeDims() {
  v1::ModelDims dims =
      LlamaDims(/*layers=*/48, /*hidden=*/2048, /*heads=*/32, /*kv_heads=*/4, /*ffn=*/6144,
                /*vocab=*/151936, /*max_seq_len=*/40960, /*rope_theta=*/1e6, /*norm_eps=*/1e-6,
                /*tied=*/false);
  dims.set_head_dim(128);
  dims.set_qk_norm(true);
  dims.set_num_experts(128);
  dims.set_num_experts_per_token(8);
  dims.set_moe_intermediate_size(768);
  dims.set_norm_topk_prob(true);
  dims.set_router_aux_loss_coef(0.001);
  return dims;
}

// Sorted by name, so PresetNames() and the error listing need no sort.
const std::vector<Preset>& Presets() {
  static const auto* presets = [] {
    auto* list = new std::vector<Preset>{
        {"gpt2-1.5b", Gpt2Dims(48, 1600, 25, 1024)},
        {"gpt2-124m", Gpt2Dims(12, 768, 12, 1024)},
        {"gpt2-350m", Gpt2Dims(24, 1024, 16, 1024)},
        {"gpt2-774m", Gpt2Dims(36, 1280, 20, 1024)},
        {"gpt3-175b", Gpt2Dims(96, 12288, 96, 2048)},
        {"llama3-70b", LlamaDims(80, 8192, 64, 8, 28672, 128256, 8192, 500000, 1e-5, false)},
        {"llama3-8b", LlamaDims(32, 4096, 32, 8, 14336, 128256, 8192, 500000, 1e-5, false)},
        {"qwen3-0.6b", Qwen3Dims(28, 1024, 16, 3072, true)},
        {"qwen3-1.7b", Qwen3Dims(28, 2048, 16, 6144, true)},
        {"qwen3-14b", Qwen3Dims(40, 5120, 40, 17408, false)},
        {"qwen3-30b-a3b", Qwen3MoeDims()},
        {"qwen3-32b", Qwen3Dims(64, 5120, 64, 25600, false)},
        {"qwen3-8b", Qwen3Dims(36, 4096, 32, 12288, false)},
    };
    // Byte-level test models (256 bytes + end-of-text) that train in seconds on a CPU.
    v1::ModelDims tiny_gpt2;
    tiny_gpt2.set_architecture(ARCHITECTURE_GPT2);
    tiny_gpt2.set_num_layers(2);
    tiny_gpt2.set_hidden_size(64);
    tiny_gpt2.set_num_attention_heads(4);
    tiny_gpt2.set_vocab_size(257);
    tiny_gpt2.set_max_seq_len(256);
    tiny_gpt2.set_tie_embeddings(true);
    list->push_back({"tiny-gpt2", tiny_gpt2});
    list->push_back(
        {"tiny-llama", LlamaDims(2, 64, 4, 2, /*ffn=*/0, 257, 256, 0, 0, /*tied=*/false)});
    std::sort(list->begin(), list->end(), [](const Preset& a, const Preset& b) {
      return std::string_view(a.name) < std::string_view(b.name);
    });
    return list;
  }();
  return *presets;
}

absl::Status Invalid(absl::string_view field, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", problem));
}

absl::Status CheckPositive(absl::string_view field, int64_t value) {
  if (value > 0) return absl::OkStatus();
  return Invalid(field, absl::StrCat("must be > 0, got ", value));
}

absl::Status CheckNonNegative(absl::string_view field, double value) {
  if (std::isfinite(value) && value >= 0) return absl::OkStatus();
  return Invalid(field,
                 absl::StrCat("must be a finite number >= 0 (0 for the default), got ", value));
}

// Default Llama MLP width: 2/3 of 4 * hidden, rounded up to a multiple of 256 (Llama 1/2's rule,
// 11008 for hidden 4096).
int64_t DefaultLlamaFfn(int64_t hidden) {
  const int64_t two_thirds = (8 * hidden + 2) / 3;
  return (two_thirds + 255) / 256 * 256;
}

// The mixture-of-experts fields: all unset for a dense model; else a Llama-family model with
// top-k in [1, num_experts]. Fills moe_intermediate_size's default (ffn_hidden_size, already
// filled). `field` maps a field name to its path for messages.
template <typename FieldPath>
absl::Status ValidateMoe(v1::ModelDims& dims, const FieldPath& field) {
  if (dims.num_experts() < 0) {
    return Invalid(field("num_experts"), absl::StrCat("must be >= 0, got ", dims.num_experts()));
  }
  if (dims.num_experts() == 0) {
    const std::pair<const char*, bool> moe_only[] = {
        {"num_experts_per_token", dims.num_experts_per_token() != 0},
        {"moe_intermediate_size", dims.moe_intermediate_size() != 0},
        {"norm_topk_prob", dims.norm_topk_prob()},
        {"shared_expert_intermediate_size", dims.shared_expert_intermediate_size() != 0},
        {"router_aux_loss_coef", dims.router_aux_loss_coef() != 0},
    };
    for (const auto& [name, set] : moe_only) {
      if (set) return Invalid(field(name), "is set but num_experts is 0 (a dense model)");
    }
    return absl::OkStatus();
  }
  if (dims.architecture() != ARCHITECTURE_LLAMA) {
    return Invalid(field("num_experts"), "mixture of experts needs ARCHITECTURE_LLAMA");
  }
  if (dims.num_experts_per_token() < 1 || dims.num_experts_per_token() > dims.num_experts()) {
    return Invalid(field("num_experts_per_token"),
                   absl::StrCat("must be in [1, num_experts ", dims.num_experts(), "], got ",
                                dims.num_experts_per_token()));
  }
  if (dims.moe_intermediate_size() < 0) {
    return Invalid(field("moe_intermediate_size"), "must be >= 0");
  }
  if (dims.shared_expert_intermediate_size() < 0) {
    return Invalid(field("shared_expert_intermediate_size"), "must be >= 0");
  }
  if (auto s = CheckNonNegative(field("router_aux_loss_coef"), dims.router_aux_loss_coef());
      !s.ok()) {
    return s;
  }
  if (dims.moe_intermediate_size() == 0) dims.set_moe_intermediate_size(dims.ffn_hidden_size());
  return absl::OkStatus();
}

// Fills defaults into `dims` and checks it; `prefix` is the field path for messages.
absl::Status FillAndValidate(v1::ModelDims& dims, absl::string_view prefix) {
  auto field = [&](absl::string_view name) { return absl::StrCat(prefix, ".", name); };
  const bool llama = dims.architecture() == ARCHITECTURE_LLAMA;
  if (dims.architecture() != ARCHITECTURE_GPT2 && !llama) {
    return Invalid(field("architecture"),
                   absl::StrCat("must be ARCHITECTURE_GPT2 or ARCHITECTURE_LLAMA, got ",
                                v1::Architecture_Name(dims.architecture())));
  }
  if (auto s = CheckPositive(field("num_layers"), dims.num_layers()); !s.ok()) return s;
  if (auto s = CheckPositive(field("hidden_size"), dims.hidden_size()); !s.ok()) return s;
  if (auto s = CheckPositive(field("num_attention_heads"), dims.num_attention_heads()); !s.ok()) {
    return s;
  }
  if (auto s = CheckPositive(field("vocab_size"), dims.vocab_size()); !s.ok()) return s;
  if (auto s = CheckPositive(field("max_seq_len"), dims.max_seq_len()); !s.ok()) return s;
  if (dims.num_kv_heads() < 0) return Invalid(field("num_kv_heads"), "must be >= 0");
  if (dims.head_dim() < 0) return Invalid(field("head_dim"), "must be >= 0");
  if (dims.ffn_hidden_size() < 0) return Invalid(field("ffn_hidden_size"), "must be >= 0");
  if (auto s = CheckNonNegative(field("rope_theta"), dims.rope_theta()); !s.ok()) return s;
  if (auto s = CheckNonNegative(field("norm_eps"), dims.norm_eps()); !s.ok()) return s;

  const int heads = dims.num_attention_heads();
  if (dims.num_kv_heads() == 0) dims.set_num_kv_heads(heads);
  if (heads % dims.num_kv_heads() != 0) {
    return Invalid(
        field("num_kv_heads"),
        absl::StrCat(dims.num_kv_heads(), " does not divide num_attention_heads ", heads));
  }
  if (dims.head_dim() == 0) {
    if (dims.hidden_size() % heads != 0) {
      return Invalid(
          field("head_dim"),
          absl::StrCat("is 0 (hidden_size / num_attention_heads) but hidden_size ",
                       dims.hidden_size(), " is not divisible by num_attention_heads ", heads));
    }
    dims.set_head_dim(dims.hidden_size() / heads);
  }
  if (dims.ffn_hidden_size() == 0) {
    const int64_t ffn = llama ? DefaultLlamaFfn(dims.hidden_size()) : 4LL * dims.hidden_size();
    if (ffn > INT32_MAX) {
      return Invalid(field("ffn_hidden_size"),
                     absl::StrCat("default ", ffn, " for hidden_size ", dims.hidden_size(),
                                  " does not fit in int32"));
    }
    dims.set_ffn_hidden_size(static_cast<int32_t>(ffn));
  }
  if (dims.rope_theta() == 0) dims.set_rope_theta(10000);
  if (dims.norm_eps() == 0) dims.set_norm_eps(1e-5);

  if (auto s = ValidateMoe(dims, field); !s.ok()) return s;

  if (llama) {
    // Rotate-half RoPE pairs the two halves of each head.
    if (dims.head_dim() % 2 != 0) {
      return Invalid(field("head_dim"),
                     absl::StrCat("must be even for rotary positions, got ", dims.head_dim()));
    }
  } else {
    // The GPT-2 block is multi-head attention over a fused [d, 3d] projection.
    if (dims.num_kv_heads() != heads) {
      return Invalid(field("num_kv_heads"),
                     absl::StrCat("ARCHITECTURE_GPT2 has no grouped-query attention: must be 0 or ",
                                  heads, ", got ", dims.num_kv_heads()));
    }
    if (static_cast<int64_t>(dims.head_dim()) * heads != dims.hidden_size()) {
      return Invalid(field("head_dim"),
                     absl::StrCat("ARCHITECTURE_GPT2 needs head_dim * num_attention_heads == "
                                  "hidden_size ",
                                  dims.hidden_size(), ", got ", dims.head_dim(), " * ", heads));
    }
    if (dims.qk_norm()) {
      return Invalid(field("qk_norm"), "is only supported for ARCHITECTURE_LLAMA");
    }
  }
  return absl::OkStatus();
}

// Parameter count in floating point, to reject sizes whose exact count would overflow int64.
long double ApproximateParameters(const v1::ModelDims& dims) {
  const long double d = dims.hidden_size(), f = dims.ffn_hidden_size(), v = dims.vocab_size();
  const long double q = static_cast<long double>(dims.num_attention_heads()) * dims.head_dim();
  const long double kv = static_cast<long double>(dims.num_kv_heads()) * dims.head_dim();
  const long double experts = dims.num_experts(), m = dims.moe_intermediate_size();
  const long double mlp =
      experts > 0 ? experts * (d + 3 * d * m) + 3 * d * dims.shared_expert_intermediate_size()
                  : 3 * d * f;
  const long double per_layer = d * (q + 2 * kv) + q * d + mlp + 8 * (d + f + q);
  return dims.num_layers() * per_layer + 2 * v * d +
         static_cast<long double>(dims.max_seq_len()) * d;
}

// One block's MLP parameters: the dense SwiGLU, or the router, `experts` routed experts and the
// gated shared expert.
int64_t LlamaMlpParameters(const v1::ModelDims& dims, int64_t experts) {
  const int64_t d = dims.hidden_size();
  if (dims.num_experts() == 0) return 3 * d * dims.ffn_hidden_size();
  const int64_t shared = dims.shared_expert_intermediate_size();
  return dims.num_experts() * d                            // router
         + experts * 3 * d * dims.moe_intermediate_size()  // routed experts
         + (shared > 0 ? 3 * d * shared + d : 0);          // shared expert and its gate
}

// CountParameters with `experts` of each MoE layer's routed experts.
int64_t CountParametersWithExperts(const v1::ModelDims& dims, int64_t experts) {
  const int64_t d = dims.hidden_size(), f = dims.ffn_hidden_size(), v = dims.vocab_size();
  const int64_t layers = dims.num_layers();
  const int64_t untied_head = dims.tie_embeddings() ? 0 : v * d;
  if (dims.architecture() == ARCHITECTURE_GPT2) {
    const int64_t per_layer = 2 * d                // ln_1
                              + d * 3 * d + 3 * d  // fused qkv
                              + d * d + d          // attention output
                              + 2 * d              // ln_2
                              + d * f + f          // fc
                              + f * d + d;         // fc projection
    return v * d + dims.max_seq_len() * d + layers * per_layer + 2 * d + untied_head;
  }
  const int64_t hd = dims.head_dim();
  const int64_t q = dims.num_attention_heads() * hd, kv = dims.num_kv_heads() * hd;
  const int64_t per_layer = d                                // attention norm
                            + d * q + 2 * d * kv + q * d     // q, k, v, o
                            + (dims.qk_norm() ? 2 * hd : 0)  // q_norm, k_norm
                            + d                              // mlp norm
                            + LlamaMlpParameters(dims, experts);
  return v * d + layers * per_layer + d + untied_head;
}

}  // namespace

int64_t CountParameters(const v1::ModelDims& dims) {
  return CountParametersWithExperts(dims, dims.num_experts());
}

int64_t CountActiveParameters(const v1::ModelDims& dims) {
  return CountParametersWithExperts(dims, dims.num_experts_per_token());
}

double AttentionFlopsPerToken(const v1::ModelDims& dims, int seq_len) {
  return 12.0 * dims.num_layers() * dims.hidden_size() * seq_len;
}

double FlopsPerToken(const v1::ModelDims& dims, int seq_len) {
  return 6.0 * static_cast<double>(CountActiveParameters(dims)) +
         AttentionFlopsPerToken(dims, seq_len);
}

std::vector<std::string> PresetNames() {
  std::vector<std::string> names;
  for (const Preset& preset : Presets()) names.emplace_back(preset.name);
  return names;
}

absl::Status CheckSeqLen(const v1::ModelDims& dims, int seq_len) {
  if (seq_len <= 0) return Invalid("data.seq_len", absl::StrCat("must be > 0, got ", seq_len));
  if (dims.architecture() != ARCHITECTURE_LLAMA && seq_len > dims.max_seq_len()) {
    return Invalid("data.seq_len",
                   absl::StrCat(seq_len, " exceeds model max_seq_len ", dims.max_seq_len(),
                                " (learned position embeddings have no rows beyond it)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::ModelSummary> ResolveModel(const v1::ModelSpec& spec, int seq_len) {
  v1::ModelSummary summary;
  switch (spec.source_case()) {
    case v1::ModelSpec::kPreset: {
      const auto& presets = Presets();
      auto it = std::find_if(presets.begin(), presets.end(),
                             [&](const Preset& p) { return spec.preset() == p.name; });
      if (it == presets.end()) {
        return Invalid("model.preset", absl::StrCat("unknown preset '", spec.preset(), "'; known: ",
                                                    absl::StrJoin(PresetNames(), ", ")));
      }
      summary.set_preset(spec.preset());
      *summary.mutable_dims() = it->dims;
      if (auto s = FillAndValidate(*summary.mutable_dims(), "model.preset"); !s.ok()) return s;
      break;
    }
    case v1::ModelSpec::kDims:
      *summary.mutable_dims() = spec.dims();
      if (auto s = FillAndValidate(*summary.mutable_dims(), "model.dims"); !s.ok()) return s;
      break;
    case v1::ModelSpec::kFromPretrained: {
      if (spec.from_pretrained().empty()) return Invalid("model.from_pretrained", "is empty");
      auto dims = ReadHfConfig(spec.from_pretrained());
      if (!dims.ok()) return Invalid("model.from_pretrained", dims.status().message());
      *summary.mutable_dims() = *dims;
      if (auto s = FillAndValidate(*summary.mutable_dims(), "model.from_pretrained"); !s.ok()) {
        return s;
      }
      break;
    }
    default:
      return Invalid("model", "set one of preset or dims, or from_pretrained");
  }
  if (auto s = CheckNonNegative("model.init_std", spec.init_std()); !s.ok()) return s;
  // 2^62 leaves headroom for the sums in CountParameters; no trainable model comes near it. (A
  // longer max_seq_len, below, adds no parameters: only learned position embeddings have rows,
  // and those are never extended.)
  if (ApproximateParameters(summary.dims()) > static_cast<long double>(int64_t{1} << 62)) {
    return Invalid(spec.has_dims()     ? "model.dims"
                   : spec.has_preset() ? "model.preset"
                                       : "model.from_pretrained",
                   "parameter count overflows int64");
  }
  return ModelForSeqLen(std::move(summary), seq_len);
}

absl::StatusOr<v1::ModelSummary> ModelForSeqLen(v1::ModelSummary summary, int seq_len) {
  if (auto s = CheckSeqLen(summary.dims(), seq_len); !s.ok()) return s;
  // Rotary positions extend past the preset's context: the trainer sizes its rotary tables from
  // max_seq_len, so it must cover the training sequence.
  if (seq_len > summary.dims().max_seq_len()) summary.mutable_dims()->set_max_seq_len(seq_len);
  summary.set_num_parameters(CountParameters(summary.dims()));
  summary.set_num_active_parameters(CountActiveParameters(summary.dims()));
  summary.set_flops_per_token(FlopsPerToken(summary.dims(), seq_len));
  return summary;
}

int64_t LossChunkRows(int64_t vocab_columns) {
  return std::max<int64_t>(1, kLossChunkBytes / (4 * std::max<int64_t>(1, vocab_columns)));
}

int64_t GpuLossChunkRows(int64_t vocab, int64_t element_bytes) {
  const int64_t row_bytes =
      std::max<int64_t>(1, element_bytes) * LossPaddedVocab(std::max<int64_t>(1, vocab));
  return std::max<int64_t>(1, kGpuLossChunkBytes / row_bytes);
}

}  // namespace tessera::planner

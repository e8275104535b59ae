// ResolveModel, CountParameters and the presets: parameter counts checked against published
// figures and hand-derived sums, defaults, FLOPs, and validation messages that name the field.

#include "planner/model_config.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::planner {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

v1::ModelSpec PresetSpec(const std::string& name) {
  v1::ModelSpec spec;
  spec.set_preset(name);
  return spec;
}

v1::ModelSummary Resolve(const std::string& name, int seq_len = 128) {
  auto summary = ResolveModel(PresetSpec(name), seq_len);
  EXPECT_THAT(summary, IsOk()) << name;
  return summary.ok() ? *summary : v1::ModelSummary();
}

// A valid explicit Llama spec that the validation tests break one field at a time.
v1::ModelSpec LlamaSpec() {
  v1::ModelSpec spec;
  v1::ModelDims* dims = spec.mutable_dims();
  dims->set_architecture(v1::ARCHITECTURE_LLAMA);
  dims->set_num_layers(2);
  dims->set_hidden_size(4096);
  dims->set_num_attention_heads(32);
  dims->set_vocab_size(1000);
  dims->set_max_seq_len(1024);
  return spec;
}

struct PresetCount {
  const char* name;
  int64_t parameters;
};

// GPT-2: the published counts (the 124M figure is nanoGPT's, with tied embeddings). The rest were
// summed by hand from the dimensions and agree with the published sizes (Llama 3 8B: 8.03B,
// 70B: 70.55B; Qwen3 0.6B: 0.60B of which 0.44B non-embedding, 1.7B: 1.72B, 8B: 8.19B,
// 14B: 14.77B, 32B: 32.76B; GPT-3: 174.6B).
constexpr PresetCount kPresetCounts[] = {
    {"gpt2-124m", 124'439'808},     {"gpt2-350m", 354'823'168},     {"gpt2-774m", 774'030'080},
    {"gpt2-1.5b", 1'557'611'200},   {"gpt3-175b", 174'604'259'328}, {"llama3-8b", 8'030'261'248},
    {"llama3-70b", 70'553'706'496}, {"qwen3-0.6b", 596'049'920},    {"qwen3-1.7b", 1'720'574'976},
    {"qwen3-8b", 8'190'735'360},    {"qwen3-14b", 14'768'307'200},  {"qwen3-32b", 32'762'123'264},
    {"tiny-gpt2", 132'928},         {"tiny-llama", 156'096},
    // Qwen3-30B-A3B: 30.53B as its model card states (3.35B active, below).
    {"qwen3-30b-a3b", 30'532'122'624},
};

TEST(ModelConfigTest, PresetParameterCountsMatchPublishedFigures) {
  for (const PresetCount& expected : kPresetCounts) {
    v1::ModelSummary summary = Resolve(expected.name);
    EXPECT_EQ(summary.num_parameters(), expected.parameters) << expected.name;
    EXPECT_EQ(CountParameters(summary.dims()), expected.parameters) << expected.name;
    EXPECT_EQ(summary.preset(), expected.name);
  }
}

TEST(ModelConfigTest, Qwen3MoePresetCountsItsActiveParameters) {
  // Per layer: attention 18,874,368 + norms and qk_norm 4,352 + router 262,144, and 8 of the 128
  // experts (3 x 2048 x 768 each); plus the untied embedding and head and the final norm.
  const int64_t layer = 18'874'368 + 4'352 + 262'144 + 8 * 3 * 2048 * 768;
  const v1::ModelSummary summary = Resolve("qwen3-30b-a3b");
  EXPECT_EQ(summary.num_active_parameters(), 48 * layer + 2 * 151'936 * 2048 + 2048);
  EXPECT_EQ(summary.num_active_parameters(), 3'353'032'704);
}

TEST(ModelConfigTest, PresetNamesAreSortedAndAllCovered) {
  std::vector<std::string> names = PresetNames();
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  std::vector<std::string> expected;
  for (const PresetCount& preset : kPresetCounts) expected.push_back(preset.name);
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(names, expected);
}

TEST(ModelConfigTest, TinyCountsAddUpByHand) {
  // tiny-gpt2: wte 257*64 + wpe 256*64 + 2 layers * (ln 128 + qkv 64*192+192 + proj 64*64+64 +
  // ln 128 + fc 64*256+256 + fc_proj 256*64+64) + ln_f 128.
  const int64_t gpt2_layer =
      128 + (64 * 192 + 192) + (64 * 64 + 64) + 128 + (64 * 256 + 256) + (256 * 64 + 64);
  EXPECT_EQ(gpt2_layer, 49'984);
  EXPECT_EQ(Resolve("tiny-gpt2").num_parameters(), 257 * 64 + 256 * 64 + 2 * gpt2_layer + 128);
  // tiny-llama: head_dim 16, 2 kv heads (k and v 64*32), ffn ceil(8*64/3) = 171 -> 256; untied.
  const int64_t llama_layer = 64 + 64 * 64 + 2 * 64 * 32 + 64 * 64 + 64 + 3 * 64 * 256;
  EXPECT_EQ(llama_layer, 61'568);
  EXPECT_EQ(Resolve("tiny-llama").num_parameters(), 2 * 257 * 64 + 2 * llama_layer + 64);
}

TEST(ModelConfigTest, Gpt2DefaultsAreFilledIn) {
  v1::ModelSummary summary = Resolve("gpt2-124m");
  const v1::ModelDims& dims = summary.dims();
  EXPECT_EQ(dims.architecture(), v1::ARCHITECTURE_GPT2);
  EXPECT_EQ(dims.num_layers(), 12);
  EXPECT_EQ(dims.hidden_size(), 768);
  EXPECT_EQ(dims.num_attention_heads(), 12);
  EXPECT_EQ(dims.num_kv_heads(), 12);
  EXPECT_EQ(dims.head_dim(), 64);
  EXPECT_EQ(dims.ffn_hidden_size(), 3072);
  EXPECT_EQ(dims.vocab_size(), 50257);
  EXPECT_EQ(dims.max_seq_len(), 1024);
  EXPECT_DOUBLE_EQ(dims.norm_eps(), 1e-5);
  EXPECT_DOUBLE_EQ(dims.rope_theta(), 10000);
  EXPECT_TRUE(dims.tie_embeddings());
  EXPECT_FALSE(dims.qk_norm());
}

TEST(ModelConfigTest, LlamaAndQwenPresetsKeepPublishedDimensions) {
  const v1::ModelDims llama = Resolve("llama3-8b").dims();
  EXPECT_EQ(llama.num_kv_heads(), 8);
  EXPECT_EQ(llama.head_dim(), 128);
  EXPECT_EQ(llama.ffn_hidden_size(), 14336);
  EXPECT_EQ(llama.vocab_size(), 128256);
  EXPECT_EQ(llama.max_seq_len(), 8192);
  EXPECT_DOUBLE_EQ(llama.rope_theta(), 500000);
  EXPECT_FALSE(llama.tie_embeddings());

  const v1::ModelDims qwen = Resolve("qwen3-0.6b").dims();
  EXPECT_EQ(qwen.head_dim(), 128);  // not hidden / heads = 64
  EXPECT_EQ(qwen.num_attention_heads() * qwen.head_dim(), 2048);
  EXPECT_TRUE(qwen.qk_norm());
  EXPECT_TRUE(qwen.tie_embeddings());
  EXPECT_EQ(qwen.max_seq_len(), 40960);
  EXPECT_DOUBLE_EQ(qwen.rope_theta(), 1e6);
  EXPECT_DOUBLE_EQ(qwen.norm_eps(), 1e-6);
  EXPECT_FALSE(Resolve("qwen3-8b").dims().tie_embeddings());
}

TEST(ModelConfigTest, LlamaDefaultFfnRoundsTwoThirdsOfFourHiddenUpTo256) {
  auto summary = ResolveModel(LlamaSpec(), 128);
  ASSERT_THAT(summary, IsOk());
  EXPECT_EQ(summary->dims().ffn_hidden_size(), 11008);  // Llama 2 7B's width
  EXPECT_EQ(Resolve("tiny-llama").dims().ffn_hidden_size(), 256);
  EXPECT_EQ(summary->dims().num_kv_heads(), 32);
  EXPECT_EQ(summary->preset(), "");
}

TEST(ModelConfigTest, FlopsPerTokenAddsAttentionTerm) {
  // 6 * 124,439,808 + 12 * 12 layers * 768 * 1024.
  EXPECT_DOUBLE_EQ(Resolve("gpt2-124m", 1024).flops_per_token(), 859'885'056.0);
  EXPECT_DOUBLE_EQ(Resolve("gpt2-124m", 512).flops_per_token(), 803'261'952.0);
}

TEST(ModelConfigTest, UnknownPresetListsKnownOnes) {
  EXPECT_THAT(ResolveModel(PresetSpec("gpt5"), 128),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("model.preset: unknown preset 'gpt5'"),
                             HasSubstr("known: gpt2-1.5b, gpt2-124m"), HasSubstr("tiny-llama"))));
}

TEST(ModelConfigTest, EmptySpecIsAnError) {
  EXPECT_THAT(ResolveModel(v1::ModelSpec(), 128),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("model: set one of")));
}

TEST(ModelConfigTest, SeqLenMustFitTheModel) {
  EXPECT_THAT(ResolveModel(PresetSpec("gpt2-124m"), 2048),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("data.seq_len: 2048 exceeds model max_seq_len 1024")));
  EXPECT_THAT(ResolveModel(PresetSpec("gpt2-124m"), 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("data.seq_len: must be > 0")));
  EXPECT_THAT(ResolveModel(PresetSpec("gpt2-124m"), 1024), IsOk());
}

TEST(ModelConfigTest, AResolvedModelIsMovedToAnotherSeqLenWithoutResolvingAgain) {
  // What the coordinator does at submission: the model's fields are checked first (at seq_len 1),
  // then moved to the spec's seq_len once that is known to be valid.
  for (const char* preset : {"gpt2-124m", "llama3-8b"}) {
    for (int seq_len : {512, 1024, 32768}) {
      const absl::StatusOr<v1::ModelSummary> direct = ResolveModel(PresetSpec(preset), seq_len);
      const absl::StatusOr<v1::ModelSummary> moved = ModelForSeqLen(Resolve(preset, 1), seq_len);
      ASSERT_EQ(direct.ok(), moved.ok()) << preset << " " << seq_len;
      if (!direct.ok()) {
        EXPECT_EQ(direct.status(), moved.status());
        continue;
      }
      EXPECT_EQ(moved->SerializeAsString(), direct->SerializeAsString()) << preset << " " << seq_len;
    }
  }
  EXPECT_THAT(ModelForSeqLen(Resolve("gpt2-124m", 1), 2048),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("data.seq_len: 2048 exceeds model max_seq_len 1024")));
}

TEST(ModelConfigTest, RotaryModelsTrainPastTheirMaxSeqLen) {
  // Long-context extension: the resolved max_seq_len grows to the training length, since the
  // trainer sizes its rotary tables from it; nothing else about the model changes.
  const v1::ModelSummary at_preset = Resolve("llama3-8b", 8192);
  EXPECT_EQ(at_preset.dims().max_seq_len(), 8192);
  const v1::ModelSummary extended = Resolve("llama3-8b", 32768);
  EXPECT_EQ(extended.dims().max_seq_len(), 32768);
  EXPECT_EQ(extended.num_parameters(), at_preset.num_parameters());
  EXPECT_DOUBLE_EQ(extended.flops_per_token(), FlopsPerToken(extended.dims(), 32768));
  // A shorter sequence keeps the preset's context.
  EXPECT_EQ(Resolve("llama3-8b", 1024).dims().max_seq_len(), 8192);
  EXPECT_EQ(Resolve("qwen3-0.6b", 65536).dims().max_seq_len(), 65536);
  EXPECT_EQ(Resolve("tiny-llama", 1024).dims().max_seq_len(), 1024);
  // Learned positions have no rows past max_seq_len: GPT-2 (and GPT-3) keep the limit.
  EXPECT_THAT(ResolveModel(PresetSpec("gpt3-175b"), 4096),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("data.seq_len: 4096 exceeds model max_seq_len 2048")));
  EXPECT_THAT(CheckSeqLen(Resolve("tiny-gpt2").dims(), 257),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("data.seq_len: 257 exceeds model max_seq_len 256")));
  EXPECT_THAT(CheckSeqLen(Resolve("tiny-llama").dims(), 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("data.seq_len: must be > 0")));
}

TEST(ModelConfigTest, ExplicitDimsErrorsNameTheField) {
  struct Case {
    void (*mutate)(v1::ModelSpec&);
    const char* message;
  };
  const Case cases[] = {
      {[](v1::ModelSpec& s) { s.mutable_dims()->set_hidden_size(0); },
       "model.dims.hidden_size: must be > 0"},
      {[](v1::ModelSpec& s) { s.mutable_dims()->set_num_layers(-1); },
       "model.dims.num_layers: must be > 0"},
      {[](v1::ModelSpec& s) { s.mutable_dims()->set_num_attention_heads(0); },
       "model.dims.num_attention_heads: must be > 0"},
      {[](v1::ModelSpec& s) { s.mutable_dims()->set_vocab_size(0); },
       "model.dims.vocab_size: must be > 0"},
      {[](v1::ModelSpec& s) { s.mutable_dims()->set_max_seq_len(0); },
       "model.dims.max_seq_len: must be > 0"},
      {[](v1::ModelSpec& s) { s.mutable_dims()->set_num_kv_heads(3); },
       "model.dims.num_kv_heads: 3 does not divide num_attention_heads 32"},
      {[](v1::ModelSpec& s) { s.mutable_dims()->set_num_kv_heads(-2); },
       "model.dims.num_kv_heads: must be >= 0"},
      {[](v1::ModelSpec& s) { s.mutable_dims()->set_ffn_hidden_size(-1); },
       "model.dims.ffn_hidden_size: must be >= 0"},
      {[](v1::ModelSpec& s) { s.mutable_dims()->set_architecture(v1::ARCHITECTURE_UNSPECIFIED); },
       "model.dims.architecture: must be ARCHITECTURE_GPT2 or ARCHITECTURE_LLAMA"},
      {[](v1::ModelSpec& s) { s.mutable_dims()->set_num_attention_heads(30); },
       "model.dims.head_dim: is 0 (hidden_size / num_attention_heads) but hidden_size 4096"},
      {[](v1::ModelSpec& s) { s.mutable_dims()->set_head_dim(63); },
       "model.dims.head_dim: must be even"},
      {[](v1::ModelSpec& s) { s.mutable_dims()->set_norm_eps(-1e-6); },
       "model.dims.norm_eps: must be a finite number >= 0"},
      {[](v1::ModelSpec& s) { s.mutable_dims()->set_rope_theta(-1); },
       "model.dims.rope_theta: must be a finite number >= 0"},
      {[](v1::ModelSpec& s) { s.set_init_std(-0.1); }, "model.init_std: must be"},
      {[](v1::ModelSpec& s) {
         s.mutable_dims()->set_architecture(v1::ARCHITECTURE_GPT2);
         s.mutable_dims()->set_num_kv_heads(8);
       },
       "model.dims.num_kv_heads: ARCHITECTURE_GPT2 has no grouped-query attention"},
      {[](v1::ModelSpec& s) {
         s.mutable_dims()->set_architecture(v1::ARCHITECTURE_GPT2);
         s.mutable_dims()->set_head_dim(64);
       },
       "model.dims.head_dim: ARCHITECTURE_GPT2 needs head_dim * num_attention_heads =="},
      {[](v1::ModelSpec& s) {
         s.mutable_dims()->set_architecture(v1::ARCHITECTURE_GPT2);
         s.mutable_dims()->set_qk_norm(true);
       },
       "model.dims.qk_norm: is only supported for ARCHITECTURE_LLAMA"},
      {[](v1::ModelSpec& s) {
         s.mutable_dims()->set_hidden_size(2'000'000'000);
         s.mutable_dims()->set_num_attention_heads(1);
         s.mutable_dims()->set_ffn_hidden_size(1);
       },
       "model.dims: parameter count overflows int64"},
  };
  for (const Case& c : cases) {
    v1::ModelSpec spec = LlamaSpec();
    ASSERT_THAT(ResolveModel(spec, 128), IsOk());
    c.mutate(spec);
    EXPECT_THAT(ResolveModel(spec, 128),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message)));
  }
}

TEST(ModelConfigTest, ExplicitDimsKeepWhatIsSet) {
  v1::ModelSpec spec = LlamaSpec();
  spec.mutable_dims()->set_num_kv_heads(8);
  spec.mutable_dims()->set_head_dim(64);  // 32 * 64 = 2048 != hidden 4096: allowed for Llama
  spec.mutable_dims()->set_ffn_hidden_size(1000);
  spec.mutable_dims()->set_qk_norm(true);
  auto summary = ResolveModel(spec, 1024);
  ASSERT_THAT(summary, IsOk());
  EXPECT_EQ(summary->dims().head_dim(), 64);
  EXPECT_EQ(summary->dims().ffn_hidden_size(), 1000);
  // embed 1000*4096 + 2 layers * (norms 2*4096 + q 4096*2048 + k,v 2*4096*512 + o 2048*4096 +
  // qk_norm 2*64 + mlp 3*4096*1000) + final 4096 + untied head 1000*4096.
  const int64_t layer =
      2 * 4096 + 4096LL * 2048 + 2 * 4096LL * 512 + 2048LL * 4096 + 128 + 3 * 4096LL * 1000;
  EXPECT_EQ(summary->num_parameters(), 2 * 1000LL * 4096 + 2 * layer + 4096);
}

// A small mixture of experts: LlamaSpec's attention, 8 experts of width 512, 2 per token.
v1::ModelSpec MoeSpec() {
  v1::ModelSpec spec = LlamaSpec();
  v1::ModelDims* dims = spec.mutable_dims();
  dims->set_hidden_size(256);
  dims->set_num_attention_heads(4);
  dims->set_num_experts(8);
  dims->set_num_experts_per_token(2);
  dims->set_moe_intermediate_size(512);
  dims->set_router_aux_loss_coef(0.01);
  return spec;
}

TEST(ModelConfigTest, MoeCountsEveryExpertAndActivatesTopK) {
  auto summary = ResolveModel(MoeSpec(), 128);
  ASSERT_THAT(summary, IsOk());
  const int64_t d = 256, attention = 2 * d + 4 * d * d;  // two norms; q, k, v, o
  const int64_t router = 8 * d, expert = 3 * d * 512;
  const int64_t outside = 2 * 1000LL * d + d;  // embeddings, lm_head, final norm
  EXPECT_EQ(summary->num_parameters(), outside + 2 * (attention + router + 8 * expert));
  EXPECT_EQ(summary->num_active_parameters(), outside + 2 * (attention + router + 2 * expert));
  EXPECT_DOUBLE_EQ(summary->flops_per_token(),
                   6.0 * summary->num_active_parameters() + 12.0 * 2 * d * 128);
  // A dense model's active parameters are all of them.
  const v1::ModelSummary dense = Resolve("tiny-llama");
  EXPECT_EQ(dense.num_active_parameters(), dense.num_parameters());
}

TEST(ModelConfigTest, MoeSharedExpertAndDefaultWidth) {
  v1::ModelSpec spec = MoeSpec();
  spec.mutable_dims()->set_moe_intermediate_size(0);
  spec.mutable_dims()->set_ffn_hidden_size(384);
  spec.mutable_dims()->set_shared_expert_intermediate_size(128);
  auto summary = ResolveModel(spec, 128);
  ASSERT_THAT(summary, IsOk());
  EXPECT_EQ(summary->dims().moe_intermediate_size(), 384);
  const int64_t d = 256, shared = 3 * d * 128 + d;  // and its sigmoid gate [1, hidden]
  EXPECT_EQ(summary->num_parameters() - summary->num_active_parameters(),
            2 * (8 - 2) * 3 * d * 384);
  spec.mutable_dims()->set_shared_expert_intermediate_size(0);
  auto without = ResolveModel(spec, 128);
  ASSERT_THAT(without, IsOk());
  EXPECT_EQ(summary->num_parameters() - without->num_parameters(), 2 * shared);
}

TEST(ModelConfigTest, MoeFieldsAreValidatedByName) {
  v1::ModelSpec spec = MoeSpec();
  spec.mutable_dims()->set_num_experts_per_token(9);
  EXPECT_THAT(ResolveModel(spec, 128),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("model.dims.num_experts_per_token: must be in [1, num_experts "
                                 "8], got 9")));
  spec = MoeSpec();
  spec.mutable_dims()->set_num_experts_per_token(0);
  EXPECT_THAT(ResolveModel(spec, 128), StatusIs(absl::StatusCode::kInvalidArgument,
                                                HasSubstr("model.dims.num_experts_per_token")));
  spec = MoeSpec();
  spec.mutable_dims()->set_router_aux_loss_coef(-1);
  EXPECT_THAT(ResolveModel(spec, 128), StatusIs(absl::StatusCode::kInvalidArgument,
                                                HasSubstr("model.dims.router_aux_loss_coef")));
  spec = MoeSpec();
  spec.mutable_dims()->set_num_experts(-2);
  EXPECT_THAT(ResolveModel(spec, 128),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("model.dims.num_experts")));
  spec = MoeSpec();
  spec.mutable_dims()->set_num_experts(0);
  EXPECT_THAT(ResolveModel(spec, 128),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("model.dims.num_experts_per_token: is set but num_experts is 0")));
  spec = MoeSpec();
  spec.mutable_dims()->set_architecture(v1::ARCHITECTURE_GPT2);
  spec.mutable_dims()->set_max_seq_len(128);
  EXPECT_THAT(ResolveModel(spec, 128),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("model.dims.num_experts: mixture of experts needs "
                                 "ARCHITECTURE_LLAMA")));
}

}  // namespace
}  // namespace tessera::planner

// ParseHfConfig and HfConfigJson: the published config.json files of Llama 3 8B, Qwen3 0.6B and
// GPT-2 resolve to the dimensions of the presets written from the papers, a config written back
// parses to the same dimensions, and refused configs name the file and the field.

#include "planner/hf_config.h"

#include <filesystem>
#include <fstream>
#include <string>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "planner/model_config.h"

namespace tessera::planner {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

// As published on the Hugging Face hub (fields Tessera ignores trimmed only where noted).
constexpr char kLlama3_8b[] = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
  "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192,
  "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
  "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": null,
  "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.40.0.dev0", "use_cache": true, "vocab_size": 128256})";

constexpr char kQwen3_0_6b[] = R"({
  "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
  "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
  "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
  "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null,
  "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
  "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})";

constexpr char kGpt2[] = R"({
  "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
  "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
  "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12,
  "n_layer": 12, "n_positions": 1024, "resid_pdrop": 0.1, "summary_activation": null,
  "summary_first_dropout": 0.1, "summary_proj_to_labels": true, "summary_type": "cls_index",
  "summary_use_proj": true, "vocab_size": 50257})";

v1::ModelDims ResolvedDims(const v1::ModelDims& dims) {
  v1::ModelSpec spec;
  *spec.mutable_dims() = dims;
  auto summary = ResolveModel(spec, 128);
  EXPECT_THAT(summary, IsOk());
  return summary.ok() ? summary->dims() : v1::ModelDims();
}

v1::ModelDims PresetDims(const std::string& name) {
  v1::ModelSpec spec;
  spec.set_preset(name);
  auto summary = ResolveModel(spec, 128);
  EXPECT_THAT(summary, IsOk());
  return summary.ok() ? summary->dims() : v1::ModelDims();
}

void ExpectSameDims(const v1::ModelDims& a, const v1::ModelDims& b) {
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(a, b))
      << a.ShortDebugString() << "\nvs\n"
      << b.ShortDebugString();
}

TEST(HfConfigTest, PublishedConfigsMatchThePresets) {
  for (const auto& [json, preset] :
       {std::pair{kLlama3_8b, "llama3-8b"}, std::pair{kQwen3_0_6b, "qwen3-0.6b"},
        std::pair{kGpt2, "gpt2-124m"}}) {
    auto dims = ParseHfConfig(json, "config.json");
    ASSERT_THAT(dims, IsOk()) << preset;
    ExpectSameDims(ResolvedDims(*dims), PresetDims(preset));
  }
}

TEST(HfConfigTest, WrittenConfigParsesBack) {
  for (const char* preset : {"llama3-8b", "qwen3-0.6b", "gpt2-124m", "tiny-llama"}) {
    const v1::ModelDims dims = PresetDims(preset);
    auto json = HfConfigJson(dims, "");
    ASSERT_THAT(json, IsOk());
    auto parsed = ParseHfConfig(*json, "config.json");
    ASSERT_THAT(parsed, IsOk()) << preset << "\n" << *json;
    ExpectSameDims(ResolvedDims(*parsed), dims);
    EXPECT_THAT(*json, HasSubstr(HfArchitectureOf(dims))) << preset;
  }
}

TEST(HfConfigTest, WrittenConfigKeepsTheSourceTokenIds) {
  auto json = HfConfigJson(PresetDims("llama3-8b"), kLlama3_8b);
  ASSERT_THAT(json, IsOk());
  EXPECT_THAT(*json, HasSubstr("\"eos_token_id\": 128001"));
  EXPECT_THAT(*json, HasSubstr("\"torch_dtype\": \"float32\""));
}

// A model trained from scratch names no token id outside its vocabulary: the byte tokenizer's eos
// (256) for its 257 tokens, none for a vocabulary whose tokenizer the exporter does not know (not
// transformers' GPT-2 default 50256, nor Llama's 1 and 2).
TEST(HfConfigTest, AModelFromScratchNamesOnlyTokenIdsOfItsVocabulary) {
  for (const char* preset : {"tiny-gpt2", "tiny-llama"}) {
    v1::ModelDims dims = PresetDims(preset);
    ASSERT_EQ(dims.vocab_size(), kByteTokenizerVocabSize) << preset;
    auto json = HfConfigJson(dims, "");
    ASSERT_THAT(json, IsOk());
    EXPECT_THAT(*json, HasSubstr("\"bos_token_id\": 256")) << preset;
    EXPECT_THAT(*json, HasSubstr("\"eos_token_id\": 256")) << preset;
  }
  auto json = HfConfigJson(PresetDims("gpt2-124m"), "");
  ASSERT_THAT(json, IsOk());
  EXPECT_THAT(*json, HasSubstr("\"bos_token_id\": null"));
  EXPECT_THAT(*json, HasSubstr("\"eos_token_id\": null"));
  EXPECT_THAT(*json, ::testing::Not(HasSubstr("50256")));
}

TEST(HfConfigTest, RefusesWhatTesseraDoesNotCompute) {
  auto with = [](std::string json, const std::string& from, const std::string& to) {
    json.replace(json.find(from), from.size(), to);
    return json;
  };
  EXPECT_THAT(ParseHfConfig(with(kLlama3_8b, "LlamaForCausalLM", "MistralForCausalLM"), "d/c.json"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("d/c.json: architectures"),
                             HasSubstr("'MistralForCausalLM' is not supported"))));
  EXPECT_THAT(ParseHfConfig(with(kLlama3_8b, "\"rope_scaling\": null",
                                 R"("rope_scaling": {"rope_type": "llama3", "factor": 8.0})"),
                            "d/c.json"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("d/c.json: rope_scaling"), HasSubstr("'llama3'"))));
  EXPECT_THAT(
      ParseHfConfig(with(kLlama3_8b, "\"attention_bias\": false", "\"attention_bias\": true"),
                    "c.json"),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("c.json: attention_bias")));
  EXPECT_THAT(ParseHfConfig(with(kGpt2, "\"gelu_new\"", "\"relu\""), "c.json"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("c.json: activation_function: 'relu'")));
  EXPECT_THAT(ParseHfConfig(with(kGpt2, "\"n_embd\": 768,", ""), "c.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("c.json: n_embd: missing")));
  EXPECT_THAT(ParseHfConfig("{not json", "c.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("c.json: not a JSON object")));
}

// Qwen3-30B-A3B's and Mixtral-8x7B-v0.1's config.json as published (token ids and fields
// Tessera ignores trimmed).
constexpr char kQwen3_30bA3b[] = R"({
  "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false, "decoder_sparse_step": 1,
  "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144,
  "max_position_embeddings": 40960, "mlp_only_layers": [], "model_type": "qwen3_moe",
  "moe_intermediate_size": 768, "norm_topk_prob": true, "num_attention_heads": 32,
  "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
  "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_scaling": null,
  "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "tie_word_embeddings": false,
  "use_sliding_window": false, "vocab_size": 151936})";
constexpr char kMixtral8x7b[] = R"({
  "architectures": ["MixtralForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
  "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
  "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
  "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": false,
  "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
  "sliding_window": null, "tie_word_embeddings": false, "vocab_size": 32000})";

TEST(HfConfigTest, MixtureOfExpertsConfigsGiveTheirExperts) {
  auto qwen = ParseHfConfig(kQwen3_30bA3b, "q.json");
  ASSERT_THAT(qwen, IsOk());
  EXPECT_TRUE(qwen->qk_norm());
  EXPECT_EQ(qwen->num_experts(), 128);
  EXPECT_EQ(qwen->num_experts_per_token(), 8);
  EXPECT_EQ(qwen->moe_intermediate_size(), 768);
  EXPECT_TRUE(qwen->norm_topk_prob());
  EXPECT_DOUBLE_EQ(qwen->router_aux_loss_coef(), 0.001);
  EXPECT_EQ(HfArchitectureOf(*qwen), kHfQwen3Moe);
  v1::ModelSpec spec;
  *spec.mutable_dims() = *qwen;
  auto summary = ResolveModel(spec, 4096);
  ASSERT_THAT(summary, IsOk());
  // Qwen's model card: 30.5B parameters, 3.3B activated (summed by hand: 30,532,122,624 and
  // 3,353,032,704).
  EXPECT_EQ(summary->num_parameters(), 30'532'122'624);
  EXPECT_EQ(summary->num_active_parameters(), 3'353'032'704);

  auto mixtral = ParseHfConfig(kMixtral8x7b, "m.json");
  ASSERT_THAT(mixtral, IsOk());
  EXPECT_FALSE(mixtral->qk_norm());
  EXPECT_EQ(mixtral->num_experts(), 8);
  EXPECT_EQ(mixtral->num_experts_per_token(), 2);
  EXPECT_EQ(mixtral->moe_intermediate_size(), 14336);
  EXPECT_TRUE(mixtral->norm_topk_prob());
  EXPECT_EQ(HfArchitectureOf(*mixtral), kHfMixtral);
  *spec.mutable_dims() = *mixtral;
  summary = ResolveModel(spec, 4096);
  ASSERT_THAT(summary, IsOk());
  // Mistral's figures: 46.7B parameters, 12.9B active (by hand: 46,702,792,704 and
  // 12,879,925,248).
  EXPECT_EQ(summary->num_parameters(), 46'702'792'704);
  EXPECT_EQ(summary->num_active_parameters(), 12'879'925'248);
}

// The exported config.json of each MoE family reads back to the same dimensions.
TEST(HfConfigTest, MixtureOfExpertsConfigsRoundTrip) {
  for (const char* json : {kQwen3_30bA3b, kMixtral8x7b}) {
    auto dims = ParseHfConfig(json, "in.json");
    ASSERT_THAT(dims, IsOk());
    v1::ModelSpec spec;
    *spec.mutable_dims() = *dims;
    auto summary = ResolveModel(spec, 4096);
    ASSERT_THAT(summary, IsOk());
    auto exported = HfConfigJson(summary->dims(), "");
    ASSERT_THAT(exported, IsOk());
    auto back = ParseHfConfig(*exported, "out.json");
    ASSERT_THAT(back, IsOk()) << *exported;
    EXPECT_EQ(HfArchitectureOf(*back), HfArchitectureOf(*dims));
    EXPECT_EQ(back->num_experts(), dims->num_experts());
    EXPECT_EQ(back->num_experts_per_token(), dims->num_experts_per_token());
    EXPECT_EQ(back->moe_intermediate_size(), dims->moe_intermediate_size());
    EXPECT_EQ(back->norm_topk_prob(), dims->norm_topk_prob());
    EXPECT_DOUBLE_EQ(back->router_aux_loss_coef(), dims->router_aux_loss_coef());
    EXPECT_EQ(back->hidden_size(), dims->hidden_size());
  }
}

TEST(HfConfigTest, MixtureOfExpertsWithoutAnExportIsRefused) {
  auto mixtral = ParseHfConfig(kMixtral8x7b, "m.json");
  ASSERT_THAT(mixtral, IsOk());
  v1::ModelDims dims = *mixtral;
  dims.set_norm_topk_prob(false);
  EXPECT_THAT(HfConfigJson(dims, ""),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("model.norm_topk_prob")));
  dims = *mixtral;
  dims.set_qk_norm(true);
  dims.set_shared_expert_intermediate_size(256);
  EXPECT_THAT(CheckHfExportable(dims),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("model.shared_expert_intermediate_size")));
}

TEST(HfConfigTest, MixtureOfExpertsWithDenseLayersIsRefused) {
  auto with = [](std::string json, const std::string& from, const std::string& to) {
    json.replace(json.find(from), from.size(), to);
    return json;
  };
  EXPECT_THAT(
      ParseHfConfig(with(kQwen3_30bA3b, "\"decoder_sparse_step\": 1", "\"decoder_sparse_step\": 2"),
                    "q.json"),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("q.json: decoder_sparse_step: must be 1")));
  EXPECT_THAT(
      ParseHfConfig(with(kQwen3_30bA3b, "\"mlp_only_layers\": []", "\"mlp_only_layers\": [0]"),
                    "q.json"),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("q.json: mlp_only_layers")));
  EXPECT_THAT(
      ParseHfConfig(with(kMixtral8x7b, "\"sliding_window\": null", "\"sliding_window\": 4096"),
                    "m.json"),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("m.json: sliding_window")));
}

TEST(HfConfigTest, ResolveModelReadsFromPretrained) {
  const std::string dir = ::testing::TempDir() + "/hf_config_test_qwen3";
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/config.json") << kQwen3_0_6b;
  v1::ModelSpec spec;
  spec.set_from_pretrained(dir);
  auto summary = ResolveModel(spec, 128);
  ASSERT_THAT(summary, IsOk());
  ExpectSameDims(summary->dims(), PresetDims("qwen3-0.6b"));
  EXPECT_EQ(summary->num_parameters(), 596049920);  // Qwen3-0.6B's published 0.6B, tied

  spec.set_from_pretrained(dir + "/missing");
  EXPECT_THAT(ResolveModel(spec, 128),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("model.from_pretrained"),
                             HasSubstr("missing/config.json: cannot open"))));
}

TEST(HfConfigTest, ExportPolicyNamesTheFieldItRefuses) {
  auto mixtral = ParseHfConfig(kMixtral8x7b, "m.json");
  ASSERT_THAT(mixtral, IsOk());
  v1::JobSpec spec;
  spec.mutable_checkpoint()->set_export_format(v1::EXPORT_FORMAT_HF);
  EXPECT_THAT(CheckExportPolicy(spec, *mixtral), IsOk());
  v1::ModelDims shared = *mixtral;
  shared.set_qk_norm(true);
  shared.set_shared_expert_intermediate_size(256);
  EXPECT_THAT(CheckExportPolicy(spec, shared),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("checkpoint.export_format"),
                             HasSubstr("model.shared_expert_intermediate_size"))));
  // Nothing to merge without adapters, and no merged directory without the HF format.
  spec.mutable_checkpoint()->set_export_merged(true);
  EXPECT_THAT(CheckExportPolicy(spec, *mixtral),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("checkpoint.export_merged")));
  spec.mutable_lora()->set_rank(4);
  EXPECT_THAT(CheckExportPolicy(spec, *mixtral), IsOk());
  spec.mutable_checkpoint()->set_export_format(v1::EXPORT_FORMAT_TESSERA);
  EXPECT_THAT(CheckExportPolicy(spec, *mixtral),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("checkpoint.export_merged")));
  // The merged model is gathered from the ep (and tp) ranks for the export.
  spec.mutable_checkpoint()->set_export_format(v1::EXPORT_FORMAT_HF);
  spec.mutable_parallelism()->mutable_layout()->set_expert_parallel(2);
  spec.mutable_parallelism()->mutable_layout()->set_tensor_parallel(2);
  EXPECT_THAT(CheckExportPolicy(spec, *mixtral), IsOk());
  spec.mutable_checkpoint()->set_export_merged(false);
  EXPECT_THAT(CheckExportPolicy(spec, *mixtral), IsOk());
}

}  // namespace
}  // namespace tessera::planner

// Model shapes the trainer's tests build: presets as the planner resolves them, and a tiny
// Qwen3-shaped model. For tests only (a shape that does not resolve fails the running test).
#pragma once

#include <string>

#include "gtest/gtest.h"
#include "planner/model_config.h"

namespace tessera::trainer::testing {

// `spec` resolved for sequences of `seq_len`; empty dims when it does not resolve.
inline v1::ModelDims ResolvedDims(const v1::ModelSpec& spec, int seq_len = 16) {
  auto summary = planner::ResolveModel(spec, seq_len);
  EXPECT_TRUE(summary.ok()) << summary.status();
  return summary.ok() ? summary->dims() : v1::ModelDims();
}

// A preset's dims; with `num_layers` (not 0) that many layers instead of the preset's.
inline v1::ModelDims PresetDims(const std::string& preset, int num_layers = 0) {
  v1::ModelSpec spec;
  spec.set_preset(preset);
  v1::ModelDims dims = ResolvedDims(spec);
  if (num_layers == 0) return dims;
  // A spec names a preset or dims, not both: the preset's dims with a different depth.
  v1::ModelSpec deeper;
  *deeper.mutable_dims() = dims;
  deeper.mutable_dims()->set_num_layers(num_layers);
  return ResolvedDims(deeper);
}

// Qwen3-shaped: RMSNorm on q and k, tied embeddings, 2 kv heads for 4 heads, and head_dim (32)
// != hidden / heads (16); 2 layers, vocabulary 257, up to 64 positions.
inline v1::ModelDims TinyQwenDims(int ffn_hidden_size = 128, int seq_len = 16) {
  v1::ModelSpec spec;
  v1::ModelDims* dims = spec.mutable_dims();
  dims->set_architecture(v1::ARCHITECTURE_LLAMA);
  dims->set_num_layers(2);
  dims->set_hidden_size(64);
  dims->set_num_attention_heads(4);
  dims->set_num_kv_heads(2);
  dims->set_head_dim(32);
  dims->set_ffn_hidden_size(ffn_hidden_size);
  dims->set_vocab_size(257);
  dims->set_max_seq_len(64);
  dims->set_rope_theta(1e6);
  dims->set_norm_eps(1e-6);
  dims->set_tie_embeddings(true);
  dims->set_qk_norm(true);
  return ResolvedDims(spec, seq_len);
}

}  // namespace tessera::trainer::testing

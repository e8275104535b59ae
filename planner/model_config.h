// Model configuration: turns a ModelSpec (a named preset or explicit dimensions) into a
// ModelSummary with every default filled in, validated, and sized (parameters, training FLOPs
// per token). The coordinator plans memory and MFU from it and the trainer builds its module from
// the resolved dimensions, so both agree on one model. Plain C++: no LibTorch here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tessera/v1/model.pb.h"

namespace tessera::planner {

// init_std used when ModelSpec.init_std is 0.
inline constexpr double kDefaultInitStd = 0.02;

// Resolves a spec to full dimensions: a preset by name, explicit dims with defaults filled in, or
// a Hugging Face directory's config.json (from_pretrained; see hf_config.h).
// Validates; every error is INVALID_ARGUMENT and names the field, e.g.
// "model.preset: unknown preset 'gpt5'; known: gpt2-124m, ...",
// "model.dims.num_kv_heads: 3 does not divide num_attention_heads 32",
// "model.dims.hidden_size: must be > 0". seq_len is the training sequence length, checked by
// CheckSeqLen and used for flops_per_token. A Llama-family model (rotary positions) trained past
// its max_seq_len (long-context extension) gets dims.max_seq_len raised to seq_len, since the
// trainer builds its rotary tables from dims.max_seq_len.
absl::StatusOr<v1::ModelSummary> ResolveModel(const v1::ModelSpec& spec, int seq_len);

// A model resolved (ResolveModel) at some sequence length, for sequences of `seq_len` instead:
// CheckSeqLen, the Llama family's max_seq_len raised to seq_len when it is shorter, and
// flops_per_token recomputed. Reads nothing (a from_pretrained config.json is read once, by
// ResolveModel).
absl::StatusOr<v1::ModelSummary> ModelForSeqLen(v1::ModelSummary summary, int seq_len);

// Whether a model of resolved `dims` trains at `seq_len`: > 0, and for GPT-2 (learned position
// embeddings, one row per position) <= max_seq_len ("data.seq_len: 2048 exceeds model max_seq_len
// 1024 (...)"); rotary (ARCHITECTURE_LLAMA) models take any length. INVALID_ARGUMENT otherwise.
absl::Status CheckSeqLen(const v1::ModelDims& dims, int seq_len);

// Exact parameter count of resolved dims (tied embeddings counted once; every expert).
int64_t CountParameters(const v1::ModelDims& dims);

// Parameters one token's forward uses: CountParameters, but of each MoE layer's routed experts
// only num_experts_per_token.
int64_t CountActiveParameters(const v1::ModelDims& dims);

// FLOPs of the attention score and value matmuls per token, forward and backward, at `seq_len`:
// 12 x layers x hidden x seq_len (the term MFU adds to 6 x parameters).
double AttentionFlopsPerToken(const v1::ModelDims& dims, int seq_len);

// Model FLOPs per trained token: 6 x active parameters + AttentionFlopsPerToken (the PaLM
// convention MFU uses).
double FlopsPerToken(const v1::ModelDims& dims, int seq_len);

// Names of all presets, sorted.
std::vector<std::string> PresetNames();

// The trainer's language-model head computes its logits and cross-entropy this many rows
// (tokens) at a time (trainer/model/linear_cross_entropy.h), so that one chunk's float32 logits,
// about kLossChunkBytes, exist at once however many tokens a micro-batch holds. The planner
// counts the same chunk.
inline constexpr int64_t kLossChunkBytes = int64_t{256} << 20;
int64_t LossChunkRows(int64_t vocab_columns);
// On a GPU (the fused cross-entropy path) a chunk holds its logits in the compute precision
// (`element_bytes` each, over the padded vocabulary), about kGpuLossChunkBytes. The chunks are
// larger than the CPU's because each one adds its product into the head's float32 weight
// gradient, a pass over that whole gradient: at qwen3-0.6b's 151,936-entry vocabulary and the
// CPU's chunk size, 38 passes of 1.2 GB for every 16,384 tokens.
inline constexpr int64_t kGpuLossChunkBytes = int64_t{1} << 30;
int64_t GpuLossChunkRows(int64_t vocab, int64_t element_bytes);
// On a GPU (the fused cross-entropy path) the head's weight is padded with zero rows to a
// multiple of this, so that the logits' rows are 16-byte aligned for the matrix products.
inline constexpr int64_t kLossVocabAlignment = 64;
inline int64_t LossPaddedVocab(int64_t vocab) {
  return (vocab + kLossVocabAlignment - 1) / kLossVocabAlignment * kLossVocabAlignment;
}

}  // namespace tessera::planner

// QLoRA in the trainer (Dettmers et al. 2023; LoraSpec.base_quantization = NF4): the frozen base's
// linear layers of every transformer block (attention and MLP projections; not the embeddings,
// norms, biases or the LM head, as QLoRA keeps them) hold their weights in NF4 with double
// quantization (nf4.h), dequantized on the fly in forward and again in backward; the LoRA
// adapters above them train in the job's precision. In a mixture-of-experts block the routed
// experts' stacked weights are quantized expert by expert (each its own 64-value blocks, as a
// dense weight; moe_lora.h QuantizeStackedNf4); the router and any shared experts stay in float32
// (the router is small, and rounding it could change which experts tokens pick). The base is
// quantized one tensor at a time as its values are read (Hugging Face files or the seeded
// initialisation), so its full-precision weights are never resident at once, and the same values
// always give the same NF4 state: a resumed job rebuilds an identical base (its checkpoints hold
// only the adapters).
//
// Thread safety: plain functions over a model that one thread builds.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "trainer/model/model.h"

namespace tessera::trainer {

// True for the names of the frozen NF4 parameters DenseImpl::QuantizeWeightNf4 registers
// ("layers.0.attn.q.weight_nf4_codes", ...).
bool IsNf4Parameter(const std::string& name);

// True for a parameter QLoRA stores in NF4: the weight of a transformer block's linear layer
// ("layers.N.attn.q.weight", "layers.N.mlp.fc.weight"; not the norms' weights).
bool IsNf4QuantizedWeight(const std::string& name);

// Gives every parameter of `model` (built ParameterStorage::kDeferred) its value from `values`,
// one parameter at a time: a block linear weight or a stacked expert weight (this rank's experts
// under expert parallelism, this rank's shard under tensor parallelism: a shard is quantized on
// its own, so its 64-value blocks are not the whole weight's where tp splits rows' columns, a
// difference within NF4's error) goes straight into NF4 (its float32 value freed
// before the next is read), every other
// parameter is kept in float32 on the CPU. The model is kInitialized afterwards, ready for
// AddLora. FAILED_PRECONDITION for a model that is not so built; `values`' errors pass through;
// LibTorch's errors become INTERNAL.
absl::Status MaterializeNf4Base(CausalLMImpl& model, const ParameterValues& values);

// x W^T for `linear`'s NF4 weight W, without its bias: a row-parallel layer's partial product,
// whose bias is added once after the tp reduction. In autocast's dtype where autocast is on.
torch::Tensor Nf4ProductWithoutBias(DenseImpl& linear, const torch::Tensor& x);

// Bytes of the model's NF4 state (codes, 8-bit absmaxes, their scales and offsets).
int64_t Nf4BaseBytes(CausalLMImpl& model);

}  // namespace tessera::trainer

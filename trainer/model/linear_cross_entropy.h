// The language-model head and its cross-entropy as one operation that never holds the whole
// [tokens, vocab] logits. Rows (tokens) are taken a chunk at a time (planner::LossChunkRows of
// the vocabulary: about 256 MiB of float32 logits): the chunk's logits h W^T are computed (in
// the autocast dtype when autocast is on, as a linear layer would), their log-softmax and the
// target's log-probability give the chunk's losses, and while they are at hand the chunk's
// gradients with respect to h and W are computed too (through the backward kernels of
// log_softmax and of the two matrix products, in the order autograd runs them, so that one chunk
// gives bitwise the unchunked linear + cross_entropy's numbers). Backward then only scales the
// saved gradients by the incoming one: no logits are kept or recomputed. Per chunk about 12
// bytes per logit exist at the peak (logits' log-probabilities, their gradient and its input).
// On a GPU with fused kernels on (fused_ops.h FusedCrossEntropyRows) one kernel replaces the
// log-softmax and its backward: it reads the chunk's logits twice and writes their gradient over
// them, in the compute dtype; its numbers match the composite's to float32 rounding, not bitwise.
// There the weight is multiplied padded with zero rows to a multiple of 64, so that the products
// run aligned whatever the vocabulary (GPT-2's 50,257 is odd); dW is accumulated as grad^T h, in
// its own layout, by the product itself (float32 output and accumulator, no 16-bit product and
// no separate add), and the chunks are larger (planner::GpuLossChunkRows: about 1 GiB of logits
// in the compute dtype), since each chunk is one pass over the float32 dW.
#pragma once

#include <cstdint>

#include "trainer/torch_pch.h"

namespace tessera::trainer {

// Mean over the counted targets of -log softmax(h W^T)[row, target]: h is [rows, hidden]
// (float32, or any floating dtype), weight [vocab, hidden], targets int64 [rows] with
// kIgnoreTarget (data_loader.h) for rows whose loss is not taken. When no target counts the
// loss is 0 and so are the gradients (not 0 / 0). Gradients flow to h and weight where they
// require them (a frozen head, as under LoRA, gets none and costs no weight-gradient product).
// `chunk_rows` 0 means planner::GpuLossChunkRows on the fused GPU path, else
// planner::LossChunkRows(vocab).
torch::Tensor LinearCrossEntropy(const torch::Tensor& h, const torch::Tensor& weight,
                                 const torch::Tensor& targets, int64_t chunk_rows = 0);

// False once this process's LibTorch refused to take a 16-bit matrix product into a float32
// output (the fused path then adds each chunk's product separately, as before, and says so once
// on stderr); the GPU tests check that it does not.
bool LinearCrossEntropyProductsIntoFloat32();

}  // namespace tessera::trainer

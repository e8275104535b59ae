// The model's RMSNorm, LayerNorm, rotary position embedding, SwiGLU and residual add as single
// CUDA kernels (forward and backward, as autograd Functions) instead of chains of ATen kernels;
// RMSNorm, rotary, SwiGLU and GELU (tanh) as CPU kernels (fused_ops_cpu.h); ATen's composite as
// the fallback. A fused path runs when fused kernels are enabled (the default; the trainer's
// --fused_kernels) and the operands suit it: for the CUDA kernels, a build with CUDA and CUDA
// tensors of a supported dtype (float32, bfloat16, float16) and shape; for the CPU kernels,
// float32 CPU tensors. Everything else runs the composite exactly as before, so with fused
// kernels off CPU results are bit-for-bit those of the composite (and of eager PyTorch). The
// fused kernels compute in float32 and round once to the output dtype; their results match the
// composite's to float32 rounding, not bitwise (except the CPU rotary kernel and the residual
// add, which round as the composite does and match it bitwise). Their backward is not itself
// differentiable (no double backward).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "trainer/torch_pch.h"

namespace tessera::trainer {

// Process-wide switch of the fused kernels (default on); thread-safe. Off, every op runs its
// composite.
void SetFusedKernelsEnabled(bool enabled);
bool FusedKernelsEnabled();
// Whether this build has the CUDA kernels at all (TESSERA_WITH_CUDA).
bool FusedKernelsBuilt();

// RMSNorm over the last dimension: (x * rsqrt(mean(x^2, -1) + eps) * weight) computed in float32
// and returned in out_dtype (default x's dtype). weight is [x.size(-1)], of any floating dtype.
// An out_dtype other than x's saves the cast after it: under autocast the model asks for the
// layers' 16-bit dtype straight from its float32 residual stream, and the gradient then comes
// back in that dtype too (the CUDA kernel takes it so; the composite casts).
torch::Tensor FusedRmsNorm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                           std::optional<at::ScalarType> out_dtype = std::nullopt);

// LayerNorm over the last dimension (at::layer_norm of x in float32, weight [x.size(-1)], bias
// [x.size(-1)] or undefined) returned in out_dtype (default x's dtype), as FusedRmsNorm. On CUDA
// one kernel each way plus a deterministic weight/bias gradient (per-partition column sums);
// elsewhere ATen's layer_norm, which on the CPU is already one pass.
torch::Tensor FusedLayerNorm(const torch::Tensor& x, const torch::Tensor& weight,
                             const torch::Tensor& bias, double eps,
                             std::optional<at::ScalarType> out_dtype = std::nullopt);

// A norm's output y and its input x for the residual connection around the layer y feeds:
// x + layer(y). x_kept has x's values (it is x, or a view of it, never a copy). Where the norm
// runs on a kernel of ours, x_kept's gradient reaches the norm's backward with y's and is added
// to x's gradient there, in the same pass (bit for bit the separate add autograd would make of
// the two; fused_ops_test checks it). Elsewhere x_kept is x and autograd adds them.
struct NormAndInput {
  torch::Tensor y;
  torch::Tensor x_kept;
};
NormAndInput FusedRmsNormKeepingInput(const torch::Tensor& x, const torch::Tensor& weight,
                                      double eps,
                                      std::optional<at::ScalarType> out_dtype = std::nullopt);
NormAndInput FusedLayerNormKeepingInput(const torch::Tensor& x, const torch::Tensor& weight,
                                        const torch::Tensor& bias, double eps,
                                        std::optional<at::ScalarType> out_dtype = std::nullopt);

// Rotary embedding of x's last dimension (x cos + rotate_half(x) sin, in float32, returned in x's
// dtype), with rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2]). cos and sin broadcast against x
// (the model's: float32 [seq, head_dim] against x [batch, heads, seq, head_dim], which may be a
// transposed view). No gradient flows to cos and sin.
torch::Tensor FusedRotary(const torch::Tensor& x, const torch::Tensor& cos,
                          const torch::Tensor& sin);

// SwiGLU's activation: silu(gate) * up, elementwise over tensors of one shape.
torch::Tensor FusedSwiGlu(const torch::Tensor& gate, const torch::Tensor& up);

// GELU with the tanh approximation (torch::gelu(x, "tanh")). On float32 CPU tensors one pass
// forward and one backward (cpu_kernels::GeluTanhForward / GeluTanhBackward, fused_ops_cpu.h):
// ATen's CPU GELU evaluates tanh through a slower path in both directions. It saves x for the
// backward, as ATen's does. Elsewhere (CUDA, other dtypes) ATen's gelu, whose CUDA kernels are
// already one pass each way.
torch::Tensor FusedGeluTanh(const torch::Tensor& x);

// residual + branch for the blocks' residual stream: under autocast a float32 residual and the
// 16-bit output of an attention or MLP branch, whose ATen add takes one element at a time (it
// casts as it loads). On CUDA with fused kernels on, a float32 residual and a float32, bfloat16
// or float16 branch of the same shape, both contiguous, on one device: one kernel with 16-byte
// accesses. The result is float32 and bit for bit ATen's residual + branch (the branch upcast
// exactly, one float32 add); the gradient flows to the residual as it comes and to the branch
// cast to the branch's dtype, as autograd does for ATen's add. Anything else is residual +
// branch itself.
torch::Tensor ResidualAdd(const torch::Tensor& residual, const torch::Tensor& branch);

// GPT-2's fused projection qkv [batch, seq, 3 * heads * head_dim] as three views q, k, v
// [batch, heads, seq, head_dim] (no copy). Its backward writes the three gradients straight into
// one [batch, seq, 3 * heads * head_dim] gradient, one pass of copies (an undefined one as
// zeros), where unbind's backward stacks them into [3, batch, heads, seq, head_dim] and the
// permute and view before it then need a second, reordering copy. The same values either way.
// With fused kernels off, or without autograd, the view, permute and unbind of before.
std::vector<torch::Tensor> SplitQkv(const torch::Tensor& qkv, int64_t heads, int64_t head_dim);

// Whether FusedCrossEntropyRows runs for LinearCrossEntropy's rows h (and so logits) in the
// `compute` dtype with these targets: fused kernels on, a CUDA build, h and targets on one CUDA
// device, compute float32 / bfloat16 / float16, int64 targets.
bool FusedCrossEntropyApplies(const torch::Tensor& h, at::ScalarType compute,
                              const torch::Tensor& targets);

// One chunk of LinearCrossEntropy (linear_cross_entropy.h) in one kernel, no autograd: for
// logits [rows, width] (contiguous CUDA, float32 / bfloat16 / float16) of which the first
// `vocab` columns count (0: all; the others pad the rows) and int64 targets [rows] (ignore: the
// target of a row that does not count), returns each row's loss (float32 [rows]: logsumexp -
// the target's logit; 0 for an ignored row) and, with write_grad, overwrites the logits with the
// gradient of sum(losses) / count ((softmax - onehot) / count; 0 on ignored rows and in the
// padding), count being a float32 scalar on the device. Returns std::nullopt, touching nothing,
// where it does not apply (FusedCrossEntropyApplies false, or another shape): the caller then
// runs log_softmax and its backward.
std::optional<torch::Tensor> FusedCrossEntropyRows(torch::Tensor& logits,
                                                   const torch::Tensor& targets,
                                                   const torch::Tensor& count, int64_t ignore,
                                                   bool write_grad, int64_t vocab = 0);

}  // namespace tessera::trainer

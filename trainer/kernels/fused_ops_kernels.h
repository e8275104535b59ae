// Plain CUDA kernels behind trainer/kernels/fused_ops.h: RMSNorm and LayerNorm, rotary embedding and
// SwiGLU, forward and backward, the residual add, and the cross-entropy rows of
// trainer/linear_cross_entropy.cc. Launchers take raw device pointers, element counts and the
// stream to run on, and return the launch's cudaError_t (cudaGetLastError right after the
// launch); they never synchronize and never allocate. No LibTorch here, so that nvcc compiles
// fused_ops_kernels.cu and norm_kernels.cu without the LibTorch headers. Every kernel computes in
// float32 whatever the storage dtype, and indexes with 64 bits wherever a count can pass 2^31.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace tessera::trainer::kernels {

// Storage dtype of a tensor argument.
enum class Dtype { kFloat32, kBFloat16, kFloat16 };

// Which norm: RMSNorm (Llama) or LayerNorm with an optional bias (GPT-2).
enum class NormKind { kRms, kLayer };

// Whether the norm kernels are built for input x_dtype and output y_dtype: the same dtype, or
// float32 in and any out (a float32 residual stream normalised straight into the 16-bit dtype of
// the layers after it under autocast).
bool NormDtypesSupported(Dtype x_dtype, Dtype y_dtype);

// Over rows of `hidden` contiguous elements, in float32, rounded once to y_dtype:
//   kRms:   y = x * rstd * weight,                 rstd = rsqrt(mean(x^2) + eps)
//   kLayer: y = (x - mean) * rstd * weight + bias, rstd = rsqrt(mean((x - mean)^2) + eps)
// x: x_dtype and y: y_dtype, [rows, hidden]; weight and bias (kLayer; may be null): weight_dtype,
// [hidden]. rstd[row] and, for kLayer, mean[row] (float32; mean may be null for kRms) receive the
// row's statistics. Rows whose width is a whole number of 16-byte chunks of x, of at most 8,192
// elements, with x, weight and bias aligned for 16-byte loads, are held in registers (one warp
// or one block per row) and read once; other rows run one block per row. The choice depends on
// neither y's dtype nor its alignment, so a 16-bit y is exactly the cast of the float32 one.
cudaError_t LaunchNormForward(NormKind kind, const void* x, const void* weight, const void* bias,
                              void* y, float* mean, float* rstd, int64_t rows, int64_t hidden,
                              float eps, Dtype x_dtype, Dtype y_dtype, Dtype weight_dtype,
                              cudaStream_t stream);

// How LaunchNormBackward splits its work, from PlanNormBackward for the operands it will get.
struct NormBackwardPlan {
  // Rows of the weight and bias gradients' partial sums (float32 [partitions, hidden]): each
  // gradient is the sum of its partials over the partitions. 0 for no rows.
  int64_t partitions = 0;
  // The kernels' geometry, LaunchNormBackward's business: the row kernel's threads per row and
  // chunks per thread (threads_per_row 0: the block kernels, whose weight gradient takes a
  // second pass over rows_per_partition rows per partition).
  int threads_per_row = 0;
  int chunks = 0;
  int64_t rows_per_partition = 0;
};

// The plan of LaunchNormBackward for these operands (x and weight as they will be passed; the
// plan depends on their alignment). The row kernel (as LaunchNormForward's) computes grad_x and
// the weight and bias partials in one pass over grad_y and x, with as many partitions as the
// device runs its blocks at once; otherwise the block kernels compute grad_x and then, in a
// second pass, partitions of at least 128 rows. Neither choice depends on y_dtype, so a 16-bit
// grad_y gives bit for bit the gradients that its values in float32 give. Calls the CUDA runtime
// (the current device's multiprocessor count and the kernel's occupancy), enqueues nothing.
NormBackwardPlan PlanNormBackward(NormKind kind, const void* x, const void* weight, int64_t rows,
                                  int64_t hidden, Dtype x_dtype, Dtype y_dtype, Dtype weight_dtype);

// The gradients of LaunchNormForward, with n = the normalised x ((x - mean) * rstd, or x * rstd)
// and g = grad_y * weight, per row:
//   kRms:   grad_x = rstd * (g - n * mean(g n))
//   kLayer: grad_x = rstd * (g - mean(g) - n * mean(g n)),
// and over rows, in partials: weight_partials[p, j] = the sum of grad_y[row, j] * n[row, j] and,
// for kLayer, bias_partials[p, j] = the sum of grad_y[row, j] over the rows of partition p. No
// atomics: the same plan and inputs give the same partials, bit for bit. grad_y: y_dtype, grad_x:
// x_dtype, [rows, hidden]; weight_partials and bias_partials: float32 [plan.partitions, hidden].
// grad_x, weight_partials and bias_partials may be null (not wanted); bias_partials only with
// weight_partials. grad_residual (x_dtype, [rows, hidden]; null: none, and only with grad_x) is
// added to grad_x: bit for bit grad_x + grad_residual as ATen adds them (the gradient x also gets
// through a residual connection, which autograd would otherwise add in a pass of its own).
// `plan` comes from PlanNormBackward for the same kind, x, weight, rows, hidden and dtypes
// (cudaErrorInvalidValue otherwise, where that can be seen).
cudaError_t LaunchNormBackward(NormKind kind, const NormBackwardPlan& plan, const void* grad_y,
                               const void* x, const void* weight, const float* mean,
                               const float* rstd, const void* grad_residual, void* grad_x,
                               float* weight_partials, float* bias_partials, int64_t rows,
                               int64_t hidden, Dtype x_dtype, Dtype y_dtype, Dtype weight_dtype,
                               cudaStream_t stream);

// Element strides of a rotary operand seen as [n0, n1, n2, head_dim]; the last dimension is the
// one rotated. Tables (cos, sin) are addressed with their own strides, 0 where they broadcast.
struct RotaryGeometry {
  int64_t sizes[3] = {0, 0, 0};
  int64_t head_dim = 0;  // even
  int64_t in_strides[4] = {0, 0, 0, 0};
  int64_t out_strides[4] = {0, 0, 0, 0};
  int64_t table_strides[4] = {0, 0, 0, 0};  // shared by cos and sin
};

// With h = head_dim / 2 and i < h, per row:
//   forward (transpose false): out[i] = in[i] cos[i] - in[i+h] sin[i],
//                              out[i+h] = in[i+h] cos[i+h] + in[i] sin[i+h]
//   (x cos + rotate_half(x) sin), and its transpose, the backward (transpose true):
//                              out[i] = in[i] cos[i] + in[i+h] sin[i+h],
//                              out[i+h] = in[i+h] cos[i+h] - in[i] sin[i].
// in and out: dtype; cos and sin: float32. out must not overlap in.
cudaError_t LaunchRotary(const void* in, const float* cos, const float* sin, void* out,
                         const RotaryGeometry& geometry, bool transpose, Dtype dtype,
                         cudaStream_t stream);

// y = silu(gate) * up over n contiguous elements of one dtype.
cudaError_t LaunchSwiGluForward(const void* gate, const void* up, void* y, int64_t n, Dtype dtype,
                                cudaStream_t stream);

// grad_gate = grad_y * up * silu'(gate), grad_up = grad_y * silu(gate); all of one dtype.
cudaError_t LaunchSwiGluBackward(const void* grad_y, const void* gate, const void* up,
                                 void* grad_gate, void* grad_up, int64_t n, Dtype dtype,
                                 cudaStream_t stream);

// out = residual + branch over n contiguous elements: residual and out float32, branch of
// branch_dtype upcast to float32 (exactly) and added once, so bit for bit what ATen's
// residual + branch gives. 16-byte loads and stores where residual, branch and out are 16-byte
// aligned (ATen's add of a float32 and a 16-bit tensor takes one element at a time). out must
// not overlap branch.
cudaError_t LaunchResidualAdd(const float* residual, const void* branch, float* out, int64_t n,
                              Dtype branch_dtype, cudaStream_t stream);

// Cross-entropy over rows of logits [rows, stride] (dtype, contiguous) of which the first `vocab`
// columns count (stride >= vocab; the rest pad each row), with int64 targets [rows]:
// row_loss[row] (float32) = logsumexp(logits[row, :vocab]) - logits[row, target] for a counted
// row (target != ignore), 0 for an ignored one, NaN for a target outside [0, vocab). With
// write_grad the logits are overwritten in place by the gradient of sum(row_loss) / *count
// (count: one float32 on the device): (softmax(row) - onehot(target)) / count, 0 on ignored rows
// and in the padding. Reads the logits twice and writes them once, where log_softmax in float32
// and its backward move about six times as many bytes.
cudaError_t LaunchCrossEntropyRows(void* logits, const int64_t* targets, const float* count,
                                   float* row_loss, int64_t rows, int64_t vocab, int64_t stride,
                                   int64_t ignore, bool write_grad, Dtype dtype,
                                   cudaStream_t stream);

}  // namespace tessera::trainer::kernels

// The norm kernels of fused_ops_kernels.h: RMSNorm and LayerNorm, forward and backward, and the
// partial sums of the weight and bias gradients. One thread block per row (rows taken in a
// grid-stride loop); all arithmetic float32. Products and sums are written with __fmul_rn /
// __fadd_rn where ATen's composite computes them as separate rounded operations, so that nvcc
// does not contract them into fused multiply-adds (this keeps float32 results at or next to
// ATen's).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "trainer/fused_kernels_common.cuh"
#include "trainer/fused_ops_kernels.h"

namespace tessera::trainer::kernels {
namespace {

constexpr int kMaxRowThreads = 256;
constexpr int64_t kMaxGridY = 65535;
constexpr int64_t kMinRowsPerPartition = 128;

// Threads per row block: a whole number of warps, at most kMaxRowThreads.
int RowThreads(int64_t hidden) {
  return static_cast<int>(std::min<int64_t>(
      kMaxRowThreads, CeilDiv(std::max<int64_t>(hidden, 1), kWarpSize) * kWarpSize));
}

// One block per row (grid-stride over rows) of x [rows, hidden] (X), normalised in float32 and
// rounded once to y's dtype Y:
//   RMSNorm:   y = x * rstd * weight,                rstd = rsqrt(mean(x^2) + eps)
//   LayerNorm: y = (x - mean) * rstd * weight + bias, rstd = rsqrt(mean((x - mean)^2) + eps)
// (LayerNorm's variance from the mean-centred values, a second pass over the row, which stays in
// L1 at model widths). mean (LayerNorm only) and rstd are kept per row for the backward.
template <bool kLayer, typename X, typename Y, typename W>
__global__ void NormForwardKernel(const X* __restrict__ x, const W* __restrict__ weight,
                                  const W* __restrict__ bias, Y* __restrict__ y,
                                  float* __restrict__ mean_out, float* __restrict__ rstd_out,
                                  int64_t rows, int64_t hidden, float eps) {
  __shared__ float scratch[kMaxRowThreads / kWarpSize];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const X* x_row = x + row * hidden;
    Y* y_row = y + row * hidden;
    float mean = 0.0f;
    if constexpr (kLayer) {
      float sum = 0.0f;
      for (int64_t j = threadIdx.x; j < hidden; j += blockDim.x) sum += ToFloat(x_row[j]);
      mean = BlockSum(sum, scratch) / static_cast<float>(hidden);
    }
    float sum_sq = 0.0f;
    for (int64_t j = threadIdx.x; j < hidden; j += blockDim.x) {
      const float v = kLayer ? ToFloat(x_row[j]) - mean : ToFloat(x_row[j]);
      sum_sq += v * v;
    }
    sum_sq = BlockSum(sum_sq, scratch);
    const float r = rsqrtf(sum_sq / static_cast<float>(hidden) + eps);
    if (threadIdx.x == 0) {
      rstd_out[row] = r;
      if constexpr (kLayer) mean_out[row] = mean;
    }
    for (int64_t j = threadIdx.x; j < hidden; j += blockDim.x) {
      const float v = kLayer ? __fsub_rn(ToFloat(x_row[j]), mean) : ToFloat(x_row[j]);
      float out = __fmul_rn(__fmul_rn(v, r), ToFloat(weight[j]));
      if (kLayer && bias != nullptr) out = __fadd_rn(out, ToFloat(bias[j]));
      y_row[j] = FromFloat<Y>(out);
    }
  }
}

// grad_x of the norms above, one block per row, from grad_y (Y) and the saved mean and rstd:
// with n = the normalised x and g = grad_y * weight,
//   RMSNorm:   grad_x = rstd * (g - n * mean(g n))
//   LayerNorm: grad_x = rstd * (g - mean(g) - n * mean(g n)).
// g is rounded the same way in both passes (no FMA contraction of its product into g - mean(g)),
// so that a row whose g are all equal (hidden 1, say) gets g - mean(g) = 0 exactly.
template <bool kLayer, typename X, typename Y, typename W>
__global__ void NormBackwardKernel(const Y* __restrict__ grad_y, const X* __restrict__ x,
                                   const W* __restrict__ weight, const float* __restrict__ mean,
                                   const float* __restrict__ rstd, X* __restrict__ grad_x,
                                   int64_t rows, int64_t hidden) {
  __shared__ float scratch[kMaxRowThreads / kWarpSize];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = row * hidden;
    const float r = rstd[row];
    const float mu = kLayer ? mean[row] : 0.0f;
    float dot = 0.0f, sum_g = 0.0f;
    for (int64_t j = threadIdx.x; j < hidden; j += blockDim.x) {
      const float g = __fmul_rn(ToFloat(grad_y[base + j]), ToFloat(weight[j]));
      const float n = (ToFloat(x[base + j]) - mu) * r;
      dot += g * n;
      if constexpr (kLayer) sum_g += g;
    }
    const float mean_dot = BlockSum(dot, scratch) / static_cast<float>(hidden);
    float mean_g = 0.0f;
    if constexpr (kLayer) mean_g = BlockSum(sum_g, scratch) / static_cast<float>(hidden);
    for (int64_t j = threadIdx.x; j < hidden; j += blockDim.x) {
      const float g = __fmul_rn(ToFloat(grad_y[base + j]), ToFloat(weight[j]));
      const float n = (ToFloat(x[base + j]) - mu) * r;
      grad_x[base + j] = FromFloat<X>(r * (g - mean_g - n * mean_dot));
    }
  }
}

// One thread per (column, partition): coalesced across columns, deterministic (no atomics).
// weight_partials[p, j] sums grad_y * n over partition p's rows; bias_partials (LayerNorm, may be
// null) sums grad_y.
template <bool kLayer, typename X, typename Y>
__global__ void NormWeightGradPartialKernel(const Y* __restrict__ grad_y, const X* __restrict__ x,
                                            const float* __restrict__ mean,
                                            const float* __restrict__ rstd,
                                            float* __restrict__ weight_partials,
                                            float* __restrict__ bias_partials, int64_t rows,
                                            int64_t hidden, int64_t rows_per_partition) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= hidden) return;
  const int64_t partition = blockIdx.y;
  const int64_t first = partition * rows_per_partition;
  const int64_t end = first + rows_per_partition;
  const int64_t last = end < rows ? end : rows;
  float sum = 0.0f, sum_dy = 0.0f;
  for (int64_t row = first; row < last; ++row) {
    const float v =
        kLayer ? __fsub_rn(ToFloat(x[row * hidden + j]), mean[row]) : ToFloat(x[row * hidden + j]);
    const float dy = ToFloat(grad_y[row * hidden + j]);
    sum += dy * __fmul_rn(v, rstd[row]);
    if constexpr (kLayer) sum_dy += dy;
  }
  weight_partials[partition * hidden + j] = sum;
  if (kLayer && bias_partials != nullptr) bias_partials[partition * hidden + j] = sum_dy;
}

// Calls fn(Tag<X>{}, Tag<Y>{}) for a norm's input and output dtypes: the same dtype, or float32
// in and a 16-bit dtype out (the norm of a float32 residual stream feeding layers under
// autocast). Other pairs are not built.
template <typename Fn>
cudaError_t DispatchNormDtypes(Dtype x_dtype, Dtype y_dtype, Fn&& fn) {
  if (x_dtype == y_dtype) return DispatchDtype(x_dtype, [&](auto tag) { return fn(tag, tag); });
  if (x_dtype != Dtype::kFloat32) return cudaErrorInvalidValue;
  return DispatchDtype(y_dtype, [&](auto y_tag) { return fn(Tag<float>{}, y_tag); });
}

// Calls fn(std::bool_constant<kind == kLayer>{}).
template <typename Fn>
cudaError_t DispatchNormKind(NormKind kind, Fn&& fn) {
  return kind == NormKind::kLayer ? fn(std::true_type{}) : fn(std::false_type{});
}

// Calls fn(layer, Tag<X>, Tag<Y>, Tag<W>) for a norm's kind and its input, output and weight
// dtypes.
template <typename Fn>
cudaError_t DispatchNorm(NormKind kind, Dtype x_dtype, Dtype y_dtype, Dtype weight_dtype, Fn&& fn) {
  return DispatchNormKind(kind, [&](auto layer) {
    return DispatchNormDtypes(x_dtype, y_dtype, [&](auto x_tag, auto y_tag) {
      return DispatchDtype(weight_dtype,
                           [&](auto weight_tag) { return fn(layer, x_tag, y_tag, weight_tag); });
    });
  });
}

}  // namespace

bool NormDtypesSupported(Dtype x_dtype, Dtype y_dtype) {
  return x_dtype == y_dtype || x_dtype == Dtype::kFloat32;
}

cudaError_t LaunchNormForward(NormKind kind, const void* x, const void* weight, const void* bias,
                              void* y, float* mean, float* rstd, int64_t rows, int64_t hidden,
                              float eps, Dtype x_dtype, Dtype y_dtype, Dtype weight_dtype,
                              cudaStream_t stream) {
  if (rows <= 0 || hidden <= 0) return cudaSuccess;
  if (kind == NormKind::kLayer && mean == nullptr) return cudaErrorInvalidValue;
  return DispatchNorm(kind, x_dtype, y_dtype, weight_dtype,
                      [&](auto layer, auto x_tag, auto y_tag, auto weight_tag) {
                        using X = typename decltype(x_tag)::type;
                        using Y = typename decltype(y_tag)::type;
                        using W = typename decltype(weight_tag)::type;
                        NormForwardKernel<decltype(layer)::value, X, Y, W>
                            <<<RowBlocks(rows), RowThreads(hidden), 0, stream>>>(
                                static_cast<const X*>(x), static_cast<const W*>(weight),
                                static_cast<const W*>(bias), static_cast<Y*>(y), mean, rstd, rows,
                                hidden, eps);
                        return cudaGetLastError();
                      });
}

cudaError_t LaunchNormBackward(NormKind kind, const void* grad_y, const void* x, const void* weight,
                               const float* mean, const float* rstd, void* grad_x, int64_t rows,
                               int64_t hidden, Dtype x_dtype, Dtype y_dtype, Dtype weight_dtype,
                               cudaStream_t stream) {
  if (rows <= 0 || hidden <= 0) return cudaSuccess;
  if (kind == NormKind::kLayer && mean == nullptr) return cudaErrorInvalidValue;
  return DispatchNorm(kind, x_dtype, y_dtype, weight_dtype,
                      [&](auto layer, auto x_tag, auto y_tag, auto weight_tag) {
                        using X = typename decltype(x_tag)::type;
                        using Y = typename decltype(y_tag)::type;
                        using W = typename decltype(weight_tag)::type;
                        NormBackwardKernel<decltype(layer)::value, X, Y, W>
                            <<<RowBlocks(rows), RowThreads(hidden), 0, stream>>>(
                                static_cast<const Y*>(grad_y), static_cast<const X*>(x),
                                static_cast<const W*>(weight), mean, rstd, static_cast<X*>(grad_x),
                                rows, hidden);
                        return cudaGetLastError();
                      });
}

NormWeightGradPlan PlanNormWeightGrad(int64_t rows) {
  NormWeightGradPlan plan;
  if (rows <= 0) return plan;
  plan.rows_per_partition = std::max(kMinRowsPerPartition, CeilDiv(rows, kMaxGridY));
  plan.partitions = CeilDiv(rows, plan.rows_per_partition);
  return plan;
}

cudaError_t LaunchNormWeightGradPartial(NormKind kind, const void* grad_y, const void* x,
                                        const float* mean, const float* rstd,
                                        float* weight_partials, float* bias_partials, int64_t rows,
                                        int64_t hidden, const NormWeightGradPlan& plan,
                                        Dtype x_dtype, Dtype y_dtype, cudaStream_t stream) {
  if (rows <= 0 || hidden <= 0) return cudaSuccess;
  if (plan.partitions <= 0 || plan.partitions > kMaxGridY ||
      plan.partitions * plan.rows_per_partition < rows ||
      (kind == NormKind::kLayer && mean == nullptr)) {
    return cudaErrorInvalidValue;
  }
  return DispatchNormKind(kind, [&](auto layer) {
    constexpr bool kLayer = decltype(layer)::value;
    return DispatchNormDtypes(x_dtype, y_dtype, [&](auto x_tag, auto y_tag) {
      using X = typename decltype(x_tag)::type;
      using Y = typename decltype(y_tag)::type;
      const dim3 grid(static_cast<unsigned>(CeilDiv(hidden, kElementwiseThreads)),
                      static_cast<unsigned>(plan.partitions));
      NormWeightGradPartialKernel<kLayer, X, Y><<<grid, kElementwiseThreads, 0, stream>>>(
          static_cast<const Y*>(grad_y), static_cast<const X*>(x), mean, rstd, weight_partials,
          bias_partials, rows, hidden, plan.rows_per_partition);
      return cudaGetLastError();
    });
  });
}

}  // namespace tessera::trainer::kernels

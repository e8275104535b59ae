// The kernels of fused_ops_kernels.h. Deliberately plain: the norms run one thread block per row
// (rows taken in a grid-stride loop), the rest are grid-stride elementwise loops (SwiGLU's on
// 16-byte packs where the tensors are aligned, after gpu-check measured its one-element loads
// slower than ATen's vectorised composite at Llama-3-8B's shape); all arithmetic is
// float32. Products and sums are written with __fmul_rn / __fadd_rn where ATen's composite computes
// them as separate rounded operations, so that nvcc does not contract them into fused
// multiply-adds (this keeps float32 results at or next to ATen's).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "trainer/fused_ops_kernels.h"

namespace tessera::trainer::kernels {
namespace {

constexpr int kWarpSize = 32;
constexpr int kElementwiseThreads = 256;
constexpr int64_t kMaxElementwiseBlocks = 65536;
// Grid-stride over rows beyond this many blocks (also keeps grid.x well inside its limit).
constexpr int64_t kMaxRowBlocks = 65535;
constexpr int kMaxRowThreads = 256;
constexpr int64_t kMaxGridY = 65535;
constexpr int64_t kMinRowsPerPartition = 128;

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float v) {
  return __float2half_rn(v);
}

template <typename T>
struct Tag {
  using type = T;
};

// Calls fn(Tag<T>{}) with T the C++ type of `dtype`.
template <typename Fn>
cudaError_t DispatchDtype(Dtype dtype, Fn&& fn) {
  switch (dtype) {
    case Dtype::kFloat32:
      return fn(Tag<float>{});
    case Dtype::kBFloat16:
      return fn(Tag<__nv_bfloat16>{});
    case Dtype::kFloat16:
      return fn(Tag<__half>{});
  }
  return cudaErrorInvalidValue;
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

int ElementwiseBlocks(int64_t n) {
  return static_cast<int>(std::min(CeilDiv(n, kElementwiseThreads), kMaxElementwiseBlocks));
}

// Threads per RMSNorm row block: a whole number of warps, at most kMaxRowThreads.
int RowThreads(int64_t hidden) {
  return static_cast<int>(std::min<int64_t>(
      kMaxRowThreads, CeilDiv(std::max<int64_t>(hidden, 1), kWarpSize) * kWarpSize));
}

int RowBlocks(int64_t rows) { return static_cast<int>(std::min(rows, kMaxRowBlocks)); }

__device__ __forceinline__ float WarpSum(float v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}

// The sum of v over the block, returned to every thread (each thread adds the per-warp sums in
// the same order, so all get the same value). blockDim.x must be a multiple of 32; `scratch` holds
// one float per warp. Every thread of the block must call it (it synchronizes twice, the second
// time so that a following call may reuse `scratch`).
__device__ float BlockSum(float v, float* scratch) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  v = WarpSum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < static_cast<int>(blockDim.x) / kWarpSize; ++w) total += scratch[w];
  __syncthreads();
  return total;
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

template <typename T>
__global__ void RotaryKernel(const T* __restrict__ in, const float* __restrict__ cos,
                             const float* __restrict__ sin, T* __restrict__ out, RotaryGeometry g,
                             bool transpose) {
  const int64_t half = g.head_dim / 2;
  const int64_t pairs = g.sizes[0] * g.sizes[1] * g.sizes[2] * half;
  for (int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; index < pairs;
       index += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = index % half;
    int64_t rest = index / half;
    const int64_t c2 = rest % g.sizes[2];
    rest /= g.sizes[2];
    const int64_t c1 = rest % g.sizes[1];
    const int64_t c0 = rest / g.sizes[1];
    const int64_t in_row = c0 * g.in_strides[0] + c1 * g.in_strides[1] + c2 * g.in_strides[2];
    const int64_t out_row = c0 * g.out_strides[0] + c1 * g.out_strides[1] + c2 * g.out_strides[2];
    const int64_t table_row =
        c0 * g.table_strides[0] + c1 * g.table_strides[1] + c2 * g.table_strides[2];
    const int64_t lo = i, hi = i + half;
    const float a = ToFloat(in[in_row + lo * g.in_strides[3]]);
    const float b = ToFloat(in[in_row + hi * g.in_strides[3]]);
    const float cos_lo = cos[table_row + lo * g.table_strides[3]];
    const float cos_hi = cos[table_row + hi * g.table_strides[3]];
    const float sin_lo = sin[table_row + lo * g.table_strides[3]];
    const float sin_hi = sin[table_row + hi * g.table_strides[3]];
    float out_lo, out_hi;
    if (!transpose) {
      out_lo = __fsub_rn(__fmul_rn(a, cos_lo), __fmul_rn(b, sin_lo));
      out_hi = __fadd_rn(__fmul_rn(b, cos_hi), __fmul_rn(a, sin_hi));
    } else {
      out_lo = __fadd_rn(__fmul_rn(a, cos_lo), __fmul_rn(b, sin_hi));
      out_hi = __fsub_rn(__fmul_rn(b, cos_hi), __fmul_rn(a, sin_lo));
    }
    out[out_row + lo * g.out_strides[3]] = FromFloat<T>(out_lo);
    out[out_row + hi * g.out_strides[3]] = FromFloat<T>(out_hi);
  }
}

__device__ __forceinline__ float Sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

// One element of SwiGLU, forward: silu(g) * u.
__device__ __forceinline__ float SwiGluValue(float g, float u) {
  const float silu = g / (1.0f + expf(-g));
  return __fmul_rn(silu, u);
}

// One element of SwiGLU, backward: d silu(g) / dg = s (1 + g (1 - s)) with s = sigmoid(g), as
// ATen's silu_backward.
__device__ __forceinline__ void SwiGluGrads(float dy, float g, float u, float& dg, float& du) {
  const float s = Sigmoid(g);
  dg = dy * u * (s * (1.0f + g * (1.0f - s)));
  du = dy * (g * s);
}

template <typename T>
__global__ void SwiGluForwardKernel(const T* __restrict__ gate, const T* __restrict__ up,
                                    T* __restrict__ y, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] = FromFloat<T>(SwiGluValue(ToFloat(gate[i]), ToFloat(up[i])));
  }
}

template <typename T>
__global__ void SwiGluBackwardKernel(const T* __restrict__ grad_y, const T* __restrict__ gate,
                                     const T* __restrict__ up, T* __restrict__ grad_gate,
                                     T* __restrict__ grad_up, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float dg, du;
    SwiGluGrads(ToFloat(grad_y[i]), ToFloat(gate[i]), ToFloat(up[i]), dg, du);
    grad_gate[i] = FromFloat<T>(dg);
    grad_up[i] = FromFloat<T>(du);
  }
}

// kVec elements of T in one 16-byte load or store (8 bf16 or fp16, 4 float). Memory-bound
// elementwise kernels reach the card's bandwidth only with such wide accesses.
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

template <typename T>
constexpr int kVecOf = 16 / static_cast<int>(sizeof(T));

// The SwiGLU kernels on whole packs: elements [0, packs * kVec), the same arithmetic per
// element as the scalar kernels above (which take the remaining tail).
template <typename T, int kVec>
__global__ void SwiGluForwardVecKernel(const T* __restrict__ gate, const T* __restrict__ up,
                                       T* __restrict__ y, int64_t packs) {
  using P = Pack<T, kVec>;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < packs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const P g = reinterpret_cast<const P*>(gate)[i];
    const P u = reinterpret_cast<const P*>(up)[i];
    P out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      out.v[j] = FromFloat<T>(SwiGluValue(ToFloat(g.v[j]), ToFloat(u.v[j])));
    }
    reinterpret_cast<P*>(y)[i] = out;
  }
}

template <typename T, int kVec>
__global__ void SwiGluBackwardVecKernel(const T* __restrict__ grad_y, const T* __restrict__ gate,
                                        const T* __restrict__ up, T* __restrict__ grad_gate,
                                        T* __restrict__ grad_up, int64_t packs) {
  using P = Pack<T, kVec>;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < packs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const P dy = reinterpret_cast<const P*>(grad_y)[i];
    const P g = reinterpret_cast<const P*>(gate)[i];
    const P u = reinterpret_cast<const P*>(up)[i];
    P dg, du;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      float dgf, duf;
      SwiGluGrads(ToFloat(dy.v[j]), ToFloat(g.v[j]), ToFloat(u.v[j]), dgf, duf);
      dg.v[j] = FromFloat<T>(dgf);
      du.v[j] = FromFloat<T>(duf);
    }
    reinterpret_cast<P*>(grad_gate)[i] = dg;
    reinterpret_cast<P*>(grad_up)[i] = du;
  }
}

// Online softmax statistics: m the largest value seen, s the sum of exp(value - m). A state with
// no finite value yet has m = -inf and s = 0; a NaN anywhere makes s NaN.
__device__ __forceinline__ void AddToMaxSum(float v, float& m, float& s) {
  if (v > m) {
    s = (m == -INFINITY ? 0.0f : s * expf(m - v)) + 1.0f;
    m = v;
  } else if (!(v == -INFINITY)) {
    s += expf(v - m);
  }
}

__device__ __forceinline__ void CombineMaxSum(float m2, float s2, float& m, float& s) {
  const float top = fmaxf(m, m2);
  if (top == -INFINITY) {
    s = s + s2;  // both empty (0), or NaN carried
    return;
  }
  s = (m == -INFINITY ? 0.0f : s * expf(m - top)) + (m2 == -INFINITY ? 0.0f : s2 * expf(m2 - top));
  m = top;
}

constexpr int kCrossEntropyThreads = 512;

// One block per row (grid-stride over rows) of logits [rows, stride] whose first `vocab` columns
// count (the rest pad the rows to an aligned length for the matrix products): the row's
// log-sum-exp in one pass (online softmax), then row_loss = lse - logits[target] for a counted
// row (target != ignore, 0 otherwise; NaN for a target outside [0, vocab)), and, with
// write_grad, the gradient of sum(row_loss) / count with respect to the logits written over them
// in place: (softmax - onehot(target)) / count for a counted row, 0 for an ignored one and in
// the padding columns. All float32. Each thread reads and writes kVec elements at a time (one
// 16-byte access where the rows allow it: stride a multiple of kVec and 16-byte aligned logits,
// which the padded head gives; the first gpu-check measured the one-element version at a third
// of the card's bandwidth); kVec 1 is the general case.
template <typename T, int kVec>
__global__ void CrossEntropyRowsKernel(T* __restrict__ logits, const int64_t* __restrict__ targets,
                                       const float* __restrict__ count,
                                       float* __restrict__ row_loss, int64_t rows, int64_t vocab,
                                       int64_t stride, int64_t ignore, bool write_grad) {
  using P = Pack<T, kVec>;
  __shared__ float warp_m[kCrossEntropyThreads / kWarpSize];
  __shared__ float warp_s[kCrossEntropyThreads / kWarpSize];
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int warps = static_cast<int>(blockDim.x) / kWarpSize;
  const int64_t vocab_packs = (vocab + kVec - 1) / kVec, packs = stride / kVec;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    T* x = logits + row * stride;
    P* x_packs = reinterpret_cast<P*>(x);
    float m = -INFINITY, s = 0.0f;
    for (int64_t p = threadIdx.x; p < vocab_packs; p += blockDim.x) {
      const P v = x_packs[p];
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        if (p * kVec + j < vocab) AddToMaxSum(ToFloat(v.v[j]), m, s);
      }
    }
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m, offset);
      const float s2 = __shfl_xor_sync(0xffffffffu, s, offset);
      CombineMaxSum(m2, s2, m, s);
    }
    if (lane == 0) {
      warp_m[warp] = m;
      warp_s[warp] = s;
    }
    __syncthreads();
    // Every thread combines the warps in the same order, so all hold the same lse.
    float top = warp_m[0], sum = warp_s[0];
    for (int w = 1; w < warps; ++w) CombineMaxSum(warp_m[w], warp_s[w], top, sum);
    const float lse = top + logf(sum);
    const int64_t target = targets[row];
    const bool counted = target != ignore;
    const bool in_range = target >= 0 && target < vocab;
    if (threadIdx.x == 0) {
      row_loss[row] = !counted ? 0.0f : in_range ? lse - ToFloat(x[target]) : NAN;
    }
    // Every thread has read the row's target logit above before any overwrites it below.
    __syncthreads();
    if (write_grad) {
      const float scale = counted ? 1.0f / count[0] : 0.0f;
      for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
        const P v = x_packs[p];
        P out;
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const int64_t col = p * kVec + j;
          float g = 0.0f;
          if (col < vocab) g = scale * expf(ToFloat(v.v[j]) - lse) - (col == target ? scale : 0.0f);
          out.v[j] = FromFloat<T>(g);
        }
        x_packs[p] = out;
      }
    }
    __syncthreads();  // warp_m / warp_s are reused by the next row
  }
}

// Whole packs of kVec elements can be read and written at every pointer when all of them are
// 16-byte aligned; the elements past the last whole pack go to the scalar kernel.
template <typename... Ptr>
bool AllAligned16(Ptr... pointers) {
  return ((reinterpret_cast<uintptr_t>(pointers) % 16 == 0) && ...);
}

}  // namespace

namespace {

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

cudaError_t LaunchRotary(const void* in, const float* cos, const float* sin, void* out,
                         const RotaryGeometry& geometry, bool transpose, Dtype dtype,
                         cudaStream_t stream) {
  if (geometry.head_dim % 2 != 0) return cudaErrorInvalidValue;
  const int64_t pairs =
      geometry.sizes[0] * geometry.sizes[1] * geometry.sizes[2] * (geometry.head_dim / 2);
  if (pairs <= 0) return cudaSuccess;
  return DispatchDtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    RotaryKernel<T><<<ElementwiseBlocks(pairs), kElementwiseThreads, 0, stream>>>(
        static_cast<const T*>(in), cos, sin, static_cast<T*>(out), geometry, transpose);
    return cudaGetLastError();
  });
}

cudaError_t LaunchSwiGluForward(const void* gate, const void* up, void* y, int64_t n, Dtype dtype,
                                cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  return DispatchDtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = kVecOf<T>;
    const auto* g = static_cast<const T*>(gate);
    const auto* u = static_cast<const T*>(up);
    auto* out = static_cast<T*>(y);
    const int64_t packs = AllAligned16(g, u, out) ? n / kVec : 0;
    if (packs > 0) {
      SwiGluForwardVecKernel<T, kVec>
          <<<ElementwiseBlocks(packs), kElementwiseThreads, 0, stream>>>(g, u, out, packs);
    }
    const int64_t done = packs * kVec;
    if (done < n) {
      SwiGluForwardKernel<T><<<ElementwiseBlocks(n - done), kElementwiseThreads, 0, stream>>>(
          g + done, u + done, out + done, n - done);
    }
    return cudaGetLastError();
  });
}

cudaError_t LaunchSwiGluBackward(const void* grad_y, const void* gate, const void* up,
                                 void* grad_gate, void* grad_up, int64_t n, Dtype dtype,
                                 cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  return DispatchDtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = kVecOf<T>;
    const auto* dy = static_cast<const T*>(grad_y);
    const auto* g = static_cast<const T*>(gate);
    const auto* u = static_cast<const T*>(up);
    auto* dg = static_cast<T*>(grad_gate);
    auto* du = static_cast<T*>(grad_up);
    const int64_t packs = AllAligned16(dy, g, u, dg, du) ? n / kVec : 0;
    if (packs > 0) {
      SwiGluBackwardVecKernel<T, kVec>
          <<<ElementwiseBlocks(packs), kElementwiseThreads, 0, stream>>>(dy, g, u, dg, du, packs);
    }
    const int64_t done = packs * kVec;
    if (done < n) {
      SwiGluBackwardKernel<T><<<ElementwiseBlocks(n - done), kElementwiseThreads, 0, stream>>>(
          dy + done, g + done, u + done, dg + done, du + done, n - done);
    }
    return cudaGetLastError();
  });
}

cudaError_t LaunchCrossEntropyRows(void* logits, const int64_t* targets, const float* count,
                                   float* row_loss, int64_t rows, int64_t vocab, int64_t stride,
                                   int64_t ignore, bool write_grad, Dtype dtype,
                                   cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (vocab <= 0 || stride < vocab) return cudaErrorInvalidValue;
  return DispatchDtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = kVecOf<T>;
    T* x = static_cast<T*>(logits);
    if (stride % kVec == 0 && AllAligned16(x)) {
      CrossEntropyRowsKernel<T, kVec><<<RowBlocks(rows), kCrossEntropyThreads, 0, stream>>>(
          x, targets, count, row_loss, rows, vocab, stride, ignore, write_grad);
    } else {
      CrossEntropyRowsKernel<T, 1><<<RowBlocks(rows), kCrossEntropyThreads, 0, stream>>>(
          x, targets, count, row_loss, rows, vocab, stride, ignore, write_grad);
    }
    return cudaGetLastError();
  });
}

}  // namespace tessera::trainer::kernels

// The kernels of fused_ops_kernels.h other than the norms (norm_kernels.cu): rotary embedding,
// SwiGLU, the residual add and the cross-entropy rows. Grid-stride elementwise loops (SwiGLU's on
// 16-byte packs where the tensors are aligned, after gpu-check measured its one-element loads
// slower than ATen's vectorised composite at Llama-3-8B's shape; the residual add's likewise) and
// one block per cross-entropy row; all arithmetic is float32. Products and sums are written with
// __fmul_rn / __fadd_rn where ATen's composite computes them as separate rounded operations, so
// that nvcc does not contract them into fused multiply-adds (this keeps float32 results at or next
// to ATen's).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "trainer/kernels/fused_kernels_common.cuh"
#include "trainer/kernels/fused_ops_kernels.h"

namespace tessera::trainer::kernels {
namespace {

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

// out = residual + branch, one element at a time: float32 residual and out, branch upcast to
// float32 (exact) and added once, as ATen's mixed-dtype add computes it.
template <typename B>
__global__ void ResidualAddKernel(const float* __restrict__ residual, const B* __restrict__ branch,
                                  float* __restrict__ out, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = __fadd_rn(residual[i], ToFloat(branch[i]));
  }
}

// ResidualAddKernel on whole packs of kVec = 16 / sizeof(B) elements: one 16-byte load of the
// branch and kVec / 4 16-byte loads and stores of the residual and out per pack (elements
// [0, packs * kVec); the scalar kernel takes the tail). All three 16-byte aligned.
template <typename B, int kVec>
__global__ void ResidualAddVecKernel(const float* __restrict__ residual,
                                     const B* __restrict__ branch, float* __restrict__ out,
                                     int64_t packs) {
  using BranchPack = Pack<B, kVec>;
  using FloatPack = Pack<float, 4>;
  constexpr int kFloatPacks = kVec / 4;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < packs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const BranchPack b = reinterpret_cast<const BranchPack*>(branch)[i];
    FloatPack r[kFloatPacks];
#pragma unroll
    for (int j = 0; j < kFloatPacks; ++j) {
      r[j] = reinterpret_cast<const FloatPack*>(residual)[i * kFloatPacks + j];
    }
#pragma unroll
    for (int j = 0; j < kFloatPacks; ++j) {
#pragma unroll
      for (int k = 0; k < 4; ++k) r[j].v[k] = __fadd_rn(r[j].v[k], ToFloat(b.v[j * 4 + k]));
      reinterpret_cast<FloatPack*>(out)[i * kFloatPacks + j] = r[j];
    }
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

}  // namespace

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

cudaError_t LaunchResidualAdd(const float* residual, const void* branch, float* out, int64_t n,
                              Dtype branch_dtype, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  return DispatchDtype(branch_dtype, [&](auto tag) {
    using B = typename decltype(tag)::type;
    constexpr int kVec = kVecOf<B>;
    const auto* b = static_cast<const B*>(branch);
    const int64_t packs = AllAligned16(residual, b, out) ? n / kVec : 0;
    if (packs > 0) {
      ResidualAddVecKernel<B, kVec>
          <<<ElementwiseBlocks(packs), kElementwiseThreads, 0, stream>>>(residual, b, out, packs);
    }
    const int64_t done = packs * kVec;
    if (done < n) {
      ResidualAddKernel<B><<<ElementwiseBlocks(n - done), kElementwiseThreads, 0, stream>>>(
          residual + done, b + done, out + done, n - done);
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

// Device helpers shared by the fused CUDA kernels (fused_ops_kernels.cu, norm_kernels.cu): the
// conversions between the storage dtypes and float32, dispatch from a Dtype to its C++ type,
// 16-byte packs, and warp and block sums. Included by .cu files only (nvcc, no LibTorch).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "trainer/kernels/fused_ops_kernels.h"

namespace tessera::trainer::kernels {

constexpr int kWarpSize = 32;
constexpr int kElementwiseThreads = 256;
constexpr int64_t kMaxElementwiseBlocks = 65536;
// Grid-stride over rows beyond this many blocks (also keeps grid.x well inside its limit).
constexpr int64_t kMaxRowBlocks = 65535;

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

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int ElementwiseBlocks(int64_t n) {
  return static_cast<int>(std::min(CeilDiv(n, kElementwiseThreads), kMaxElementwiseBlocks));
}

inline int RowBlocks(int64_t rows) { return static_cast<int>(std::min(rows, kMaxRowBlocks)); }

// kVec elements of T in one 16-byte load or store (8 bf16 or fp16, 4 float). Memory-bound
// elementwise kernels reach the card's bandwidth only with such wide accesses.
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

template <typename T>
constexpr int kVecOf = 16 / static_cast<int>(sizeof(T));

// Whole packs of kVec elements can be read and written at every pointer when all of them are
// 16-byte aligned.
template <typename... Ptr>
bool AllAligned16(Ptr... pointers) {
  return ((reinterpret_cast<uintptr_t>(pointers) % 16 == 0) && ...);
}

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
__device__ __forceinline__ float BlockSum(float v, float* scratch) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  v = WarpSum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < static_cast<int>(blockDim.x) / kWarpSize; ++w) total += scratch[w];
  __syncthreads();
  return total;
}

}  // namespace tessera::trainer::kernels

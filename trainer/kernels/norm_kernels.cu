// The norm kernels of fused_ops_kernels.h: RMSNorm and LayerNorm, forward and backward, and the
// partial sums of the weight and bias gradients. Two implementations of the forward and the
// backward: the row kernels (the fast path; rows held in registers, one 16-byte load per chunk of
// x, read once and written once) where they apply, which is most model widths, and the block
// kernels (one thread block per row, one-element accesses, rows taken in a grid-stride loop) for
// the rest. All arithmetic is float32. Products and sums are written with __fmul_rn / __fadd_rn
// where ATen's composite computes them as separate rounded operations, so that nvcc does not
// contract them into fused multiply-adds (this keeps float32 results at or next to ATen's); both
// implementations compute each element with the same operations and differ only in the order in
// which they add up a row's sums.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "trainer/kernels/fused_kernels_common.cuh"
#include "trainer/kernels/fused_ops_kernels.h"

namespace tessera::trainer::kernels {
namespace {

// grad_x (float32, before rounding to X) plus the gradient x gets through a residual
// connection, as autograd adds the two: grad_x rounded to X first, then a float32 sum (rounded to
// X by the caller). __fadd_rn: no contraction with grad_x's last product.
template <typename X>
__device__ __forceinline__ float AddResidualGrad(float grad_x, float grad_residual) {
  return __fadd_rn(ToFloat(FromFloat<X>(grad_x)), grad_residual);
}

// ---- The block kernels: the fallback, one block per row. ----

constexpr int kMaxBlockKernelThreads = 256;
constexpr int64_t kMaxGridY = 65535;
constexpr int64_t kMinRowsPerPartition = 128;

// Threads per block of a block kernel: a whole number of warps, at most kMaxBlockKernelThreads.
int BlockKernelThreads(int64_t hidden) {
  return static_cast<int>(std::min<int64_t>(
      kMaxBlockKernelThreads, CeilDiv(std::max<int64_t>(hidden, 1), kWarpSize) * kWarpSize));
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
  __shared__ float scratch[kMaxBlockKernelThreads / kWarpSize];
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
// so that a row whose g are all equal (hidden 1, say) gets g - mean(g) = 0 exactly. grad_residual
// (may be null) is added to grad_x as AddResidualGrad does.
template <bool kLayer, typename X, typename Y, typename W>
__global__ void NormBackwardKernel(const Y* __restrict__ grad_y, const X* __restrict__ x,
                                   const W* __restrict__ weight, const float* __restrict__ mean,
                                   const float* __restrict__ rstd,
                                   const X* __restrict__ grad_residual, X* __restrict__ grad_x,
                                   int64_t rows, int64_t hidden) {
  __shared__ float scratch[kMaxBlockKernelThreads / kWarpSize];
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
      const float dx = r * (g - mean_g - n * mean_dot);
      grad_x[base + j] = FromFloat<X>(
          grad_residual != nullptr ? AddResidualGrad<X>(dx, ToFloat(grad_residual[base + j])) : dx);
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

// ---- The row kernels: the fast path. ----
//
// A row of `hidden` elements is cut into chunks of kVec = 16 / sizeof(X) elements, one 16-byte
// load of x each. A team of threads (one warp, or a block of up to kRowBlockThreads) holds a row
// in registers: its thread `rank` holds chunks rank, rank + team size, rank + 2 x team size, ...,
// at most kChunks of them (a compile-time count, so that the row stays in registers; at most
// kMaxRowElements elements, which bounds the registers a thread needs). The row is
// read once and written once; its sums go through warp shuffles (and shared memory between the
// warps of a team of several). With one warp per row, a block of kRowBlockThreads runs one row
// per warp and never synchronises the block inside the row loop, so its warps may take different
// numbers of rows.
//
// Whether the row kernels run depends on hidden, x's dtype and the alignment of x, weight and bias
// only, never on y, grad_y or grad_x (these take one-element accesses where they are not aligned):
// a float32 result and its 16-bit cast come from the same arithmetic in the same order.

constexpr int kRowBlockThreads = 256;  // also the most threads a team may have
constexpr int kMaxRowElements = 32;    // per thread: 8 chunks of float32, 4 of a 16-bit dtype

// How the row kernels split a row: threads_per_row 0 when they do not cover it.
struct RowLayout {
  int threads_per_row = 0;  // a team: a whole number of warps, at most kRowBlockThreads
  int chunks = 0;           // chunks per thread: 1, 2, 4, 6 or 8 (DispatchChunks' counts)
};

// Calls fn(std::integral_constant<int, chunks>{}) for a chunk count that RowLayoutFor<X> gives
// (1, 2, 4, 6 or 8, at most kMaxRowElements / kVec): only those kernels are compiled.
template <int kVec, typename Fn>
cudaError_t DispatchChunks(int chunks, Fn&& fn) {
  auto call = [&](auto count) -> cudaError_t {
    if constexpr (decltype(count)::value * kVec <= kMaxRowElements) {
      return fn(count);
    } else {
      return cudaErrorInvalidValue;
    }
  };
  switch (chunks) {
    case 1:
      return call(std::integral_constant<int, 1>{});
    case 2:
      return call(std::integral_constant<int, 2>{});
    case 4:
      return call(std::integral_constant<int, 4>{});
    case 6:
      return call(std::integral_constant<int, 6>{});
    case 8:
      return call(std::integral_constant<int, 8>{});
  }
  return cudaErrorInvalidValue;
}

// The byte alignment that LoadChunk and StoreChunk's packed accesses need of a pointer to chunks
// of kVec elements of T (each access is at most 16 bytes).
template <typename T, int kVec>
constexpr int kChunkAlignment = sizeof(T) * kVec > 16 ? 16 : static_cast<int>(sizeof(T)) * kVec;

bool Aligned(const void* p, int alignment) {
  return reinterpret_cast<uintptr_t>(p) % alignment == 0;
}

// The team and chunk count for rows of `hidden` elements of X at x with this weight and bias
// (bias may be null), or threads_per_row 0 when the row kernels do not cover them: a width that
// is not a whole number of chunks, a pointer not aligned for packed loads, or a row wider than
// kRowBlockThreads x kMaxRowElements (8,192) elements.
template <typename X, typename W>
RowLayout RowLayoutFor(const void* x, const void* weight, const void* bias, int64_t hidden) {
  constexpr int kVec = kVecOf<X>;
  if (hidden % kVec != 0 || !Aligned(x, 16) || !Aligned(weight, kChunkAlignment<W, kVec>) ||
      !Aligned(bias, kChunkAlignment<W, kVec>)) {
    return {};
  }
  constexpr int kMaxChunks = kMaxRowElements / kVec;
  const int64_t row_chunks = hidden / kVec;
  const int64_t warps = CeilDiv(row_chunks, static_cast<int64_t>(kWarpSize) * kMaxChunks);
  if (warps * kWarpSize > kRowBlockThreads) return {};
  RowLayout layout;
  layout.threads_per_row = static_cast<int>(warps) * kWarpSize;
  const int64_t per_thread = CeilDiv(row_chunks, layout.threads_per_row);
  // Rounded up to a compiled count (per_thread <= kMaxChunks).
  layout.chunks = per_thread <= 2   ? static_cast<int>(per_thread)
                  : per_thread <= 4 ? 4
                  : per_thread <= 6 ? 6
                                    : 8;
  return layout;
}

// Threads per block of a row kernel: kRowBlockThreads (one row per warp) for one-warp teams, else
// the team (one row per block).
int RowKernelThreads(const RowLayout& layout) {
  return layout.threads_per_row == kWarpSize ? kRowBlockThreads : layout.threads_per_row;
}

// Blocks of a row kernel over `rows` rows: one row per team, at most kMaxRowBlocks (the kernels
// stride over the rest).
int RowKernelBlocks(const RowLayout& layout, int64_t rows) {
  const int64_t teams_per_block = RowKernelThreads(layout) / layout.threads_per_row;
  return static_cast<int>(std::min(CeilDiv(rows, teams_per_block), kMaxRowBlocks));
}

// How many blocks of `threads` threads of `kernel` the current device runs at once (0 if that
// cannot be found out): the backward row kernel's grid, so that each block takes many rows and
// writes one row of weight partials. The answer depends only on the kernel, the block size and
// the device, so it is asked of CUDA once per process for each.
template <typename Kernel>
int64_t ResidentBlocks(Kernel kernel, int threads) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();  // clears the error of the failed query; the caller falls back
    return 0;
  }
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, int>, int64_t> known;
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), threads, device);
  std::lock_guard<std::mutex> lock(mu);
  if (const auto it = known.find(key); it != known.end()) return it->second;
  int multiprocessors = 0, per_multiprocessor = 0;
  if (cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device) !=
          cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_multiprocessor, kernel, threads, 0) !=
          cudaSuccess) {
    cudaGetLastError();
    return 0;  // not remembered: a later call asks again
  }
  const int64_t resident = static_cast<int64_t>(multiprocessors) * per_multiprocessor;
  known.emplace(key, resident);
  return resident;
}

// Loads kVec elements of T at p into out (as float32): packed, in accesses of at most 16 bytes
// (p aligned to kChunkAlignment<T, kVec>), or one element at a time.
template <int kVec, typename T>
__device__ __forceinline__ void LoadChunk(const T* __restrict__ p, float (&out)[kVec],
                                          bool packed = true) {
  if (packed) {
    constexpr int kPer = kChunkAlignment<T, kVec> / static_cast<int>(sizeof(T));
    using P = Pack<T, kPer>;
#pragma unroll
    for (int i = 0; i < kVec / kPer; ++i) {
      const P pack = reinterpret_cast<const P*>(p)[i];
#pragma unroll
      for (int j = 0; j < kPer; ++j) out[i * kPer + j] = ToFloat(pack.v[j]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) out[k] = ToFloat(p[k]);
  }
}

// Stores kVec values rounded to T at p, as LoadChunk reads them.
template <int kVec, typename T>
__device__ __forceinline__ void StoreChunk(T* __restrict__ p, const float (&in)[kVec],
                                           bool packed) {
  if (packed) {
    constexpr int kPer = kChunkAlignment<T, kVec> / static_cast<int>(sizeof(T));
    using P = Pack<T, kPer>;
#pragma unroll
    for (int i = 0; i < kVec / kPer; ++i) {
      P pack;
#pragma unroll
      for (int j = 0; j < kPer; ++j) pack.v[j] = FromFloat<T>(in[i * kPer + j]);
      reinterpret_cast<P*>(p)[i] = pack;
    }
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) p[k] = FromFloat<T>(in[k]);
  }
}

// The threads of a block that share one row: a warp (threads_per_row 32: the block's warps take
// rows of their own) or the whole block (blockDim.x == threads_per_row).
struct RowTeam {
  int rank;           // this thread's index in the team
  int64_t first_row;  // the team's first row; it then takes every row_step-th row
  int64_t row_step;
  bool whole_block;

  __device__ explicit RowTeam(int threads_per_row) {
    const int teams = static_cast<int>(blockDim.x) / threads_per_row;
    rank = static_cast<int>(threadIdx.x) % threads_per_row;
    first_row = static_cast<int64_t>(blockIdx.x) * teams + threadIdx.x / threads_per_row;
    row_step = static_cast<int64_t>(gridDim.x) * teams;
    whole_block = threads_per_row > kWarpSize;
  }

  // The sum of v over the team, on every thread of it; called by every thread of the team (of
  // the block, when the team is the block).
  __device__ float Sum(float v, float* scratch) const {
    return whole_block ? BlockSum(v, scratch) : WarpSum(v);
  }
};

// NormForwardKernel's results (the same arithmetic element by element; the row sums in another
// order) with a row held in the registers of a team. y_packed: y is aligned for packed stores.
template <bool kLayer, typename X, typename Y, typename W, int kChunks>
__global__ void __launch_bounds__(kRowBlockThreads)
    NormForwardRowKernel(const X* __restrict__ x, const W* __restrict__ weight,
                         const W* __restrict__ bias, Y* __restrict__ y,
                         float* __restrict__ mean_out, float* __restrict__ rstd_out, int64_t rows,
                         int64_t hidden, float eps, int threads_per_row, bool y_packed) {
  constexpr int kVec = kVecOf<X>;
  __shared__ float scratch[kRowBlockThreads / kWarpSize];
  const RowTeam team(threads_per_row);
  const int64_t row_chunks = hidden / kVec;
  for (int64_t row = team.first_row; row < rows; row += team.row_step) {
    const X* x_row = x + row * hidden;
    float v[kChunks][kVec] = {};
    // All of the row's loads first, then the arithmetic (the loads stay in flight together).
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int64_t chunk = static_cast<int64_t>(c) * threads_per_row + team.rank;
      if (chunk < row_chunks) LoadChunk<kVec>(x_row + chunk * kVec, v[c]);
    }
    float mean = 0.0f;
    if constexpr (kLayer) {
      float sum = 0.0f;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) sum += v[c][k];  // 0 in the chunks past the row
      }
      mean = team.Sum(sum, scratch) / static_cast<float>(hidden);
    }
    float sum_sq = 0.0f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      if (static_cast<int64_t>(c) * threads_per_row + team.rank >= row_chunks) continue;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float d = kLayer ? v[c][k] - mean : v[c][k];
        sum_sq += d * d;
      }
    }
    const float r = rsqrtf(team.Sum(sum_sq, scratch) / static_cast<float>(hidden) + eps);
    if (team.rank == 0) {
      rstd_out[row] = r;
      if constexpr (kLayer) mean_out[row] = mean;
    }
    Y* y_row = y + row * hidden;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int64_t chunk = static_cast<int64_t>(c) * threads_per_row + team.rank;
      if (chunk >= row_chunks) continue;
      float w[kVec], b[kVec], out[kVec];
      LoadChunk<kVec>(weight + chunk * kVec, w);
      if (kLayer && bias != nullptr) LoadChunk<kVec>(bias + chunk * kVec, b);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float centred = kLayer ? __fsub_rn(v[c][k], mean) : v[c][k];
        out[k] = __fmul_rn(__fmul_rn(centred, r), w[k]);
        if (kLayer && bias != nullptr) out[k] = __fadd_rn(out[k], b[k]);
      }
      StoreChunk<kVec>(y_row + chunk * kVec, out, y_packed);
    }
  }
}

// Threads per block of the backward row kernel with one-warp teams: fewer than the forward's
// kRowBlockThreads, as its threads hold the row's normalised x and g and their columns' weight
// and bias sums (ptxas, sm_90: about 160 registers at 24 or 32 elements per thread). Blocks of
// 128 threads then fill 61,440 of a multiprocessor's 65,536 registers (12 warps); blocks of 256,
// 40,960 (8 warps).
constexpr int kBackwardWarpBlockThreads = 128;
// Columns of a one-warp team's row: the most that its block combines in shared memory.
constexpr int kMaxWarpRowColumns = kWarpSize * kMaxRowElements;

// Threads per block of the backward row kernel: kBackwardWarpBlockThreads (one row per warp) for
// one-warp teams, else the team (one row per block).
int BackwardRowKernelThreads(const RowLayout& layout) {
  return layout.threads_per_row == kWarpSize ? kBackwardWarpBlockThreads : layout.threads_per_row;
}

// NormBackwardKernel's grad_x (the same arithmetic element by element; the row sums in another
// order) with a row held in the registers of a team, and the weight and bias gradients'
// partials of NormWeightGradPartialKernel fused in: each thread adds grad_y * n (and grad_y) of
// its columns over the rows its team takes, the teams of a block add theirs up in team order
// through shared memory, and the block writes row blockIdx.x of weight_partials (and
// bias_partials) [gridDim.x, hidden]. No atomics: the same launch gives the same sums. grad_x,
// weight_partials and bias_partials may each be null (not wanted); bias_partials is ignored for
// RMSNorm. grad_y_packed, grad_x_packed: those pointers are aligned for packed accesses.
template <bool kLayer, typename X, typename Y, typename W, int kChunks>
__global__ void __launch_bounds__(kRowBlockThreads)
    NormBackwardRowKernel(const Y* __restrict__ grad_y, const X* __restrict__ x,
                          const W* __restrict__ weight, const float* __restrict__ mean,
                          const float* __restrict__ rstd, const X* __restrict__ grad_residual,
                          X* __restrict__ grad_x, float* __restrict__ weight_partials,
                          float* __restrict__ bias_partials, int64_t rows, int64_t hidden,
                          int threads_per_row, bool grad_y_packed, bool grad_x_packed,
                          bool grad_residual_packed) {
  constexpr int kVec = kVecOf<X>;
  __shared__ float scratch[kRowBlockThreads / kWarpSize];
  const RowTeam team(threads_per_row);
  const int row_chunks = static_cast<int>(hidden / kVec);  // at most 2,048
  const bool want_weight = weight_partials != nullptr;
  const bool want_bias = kLayer && bias_partials != nullptr;
  // This thread's columns' sums of grad_y * n (weight) and grad_y (bias) over its team's rows.
  float sum_dy_n[kChunks][kVec] = {}, sum_dy[kChunks][kVec] = {};
  for (int64_t row = team.first_row; row < rows; row += team.row_step) {
    const int64_t base = row * hidden;
    const float r = rstd[row];
    const float mu = kLayer ? mean[row] : 0.0f;
    // dy: grad_y; n: x, then the normalised x; g: grad_y * weight (dy is dead after it, and the
    // weight is read once per row).
    float dy[kChunks][kVec] = {}, n[kChunks][kVec] = {}, g[kChunks][kVec] = {};
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int chunk = c * threads_per_row + team.rank;
      if (chunk >= row_chunks) continue;
      LoadChunk<kVec>(grad_y + base + chunk * kVec, dy[c], grad_y_packed);
      LoadChunk<kVec>(x + base + chunk * kVec, n[c]);
    }
    float dot = 0.0f, sum_g = 0.0f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int chunk = c * threads_per_row + team.rank;
      if (chunk >= row_chunks) continue;
      float w[kVec];
      LoadChunk<kVec>(weight + chunk * kVec, w);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        n[c][k] = __fmul_rn(kLayer ? __fsub_rn(n[c][k], mu) : n[c][k], r);
        // Rounded once and used in both sums and in grad_x: a row whose g are all equal gets
        // g - mean(g) = 0 exactly.
        g[c][k] = __fmul_rn(dy[c][k], w[k]);
        dot += g[c][k] * n[c][k];
        if constexpr (kLayer) sum_g += g[c][k];
        if (want_weight) sum_dy_n[c][k] += dy[c][k] * n[c][k];
        if (want_bias) sum_dy[c][k] += dy[c][k];
      }
    }
    // grad_x is null (not wanted) for the whole block or for none of it.
    if (grad_x == nullptr) continue;
    const float mean_dot = team.Sum(dot, scratch) / static_cast<float>(hidden);
    float mean_g = 0.0f;
    if constexpr (kLayer) mean_g = team.Sum(sum_g, scratch) / static_cast<float>(hidden);
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int chunk = c * threads_per_row + team.rank;
      if (chunk >= row_chunks) continue;
      float out[kVec];
#pragma unroll
      for (int k = 0; k < kVec; ++k) out[k] = r * (g[c][k] - mean_g - n[c][k] * mean_dot);
      if (grad_residual != nullptr) {
        float residual[kVec];
        LoadChunk<kVec>(grad_residual + base + chunk * kVec, residual, grad_residual_packed);
#pragma unroll
        for (int k = 0; k < kVec; ++k) out[k] = AddResidualGrad<X>(out[k], residual[k]);
      }
      StoreChunk<kVec>(grad_x + base + chunk * kVec, out, grad_x_packed);
    }
  }
  if (!want_weight && !want_bias) return;  // the same for every thread of the grid
  float* weight_row = want_weight ? weight_partials + blockIdx.x * hidden : nullptr;
  float* bias_row = want_bias ? bias_partials + blockIdx.x * hidden : nullptr;
  if (team.whole_block) {
    // One team per block: its threads' columns are the block's, each held by one thread.
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int chunk = c * threads_per_row + team.rank;
      if (chunk >= row_chunks) continue;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        if (want_weight) weight_row[chunk * kVec + k] = sum_dy_n[c][k];
        if (want_bias) bias_row[chunk * kVec + k] = sum_dy[c][k];
      }
    }
    return;
  }
  // One-warp teams (hidden <= kMaxWarpRowColumns): warp 0 writes its sums to shared memory,
  // warps 1, 2, ... add theirs in turn, then the block copies the totals out. Every thread
  // reaches each __syncthreads (no thread has returned: the condition above is grid-uniform).
  __shared__ float block_dy_n[kMaxWarpRowColumns], block_dy[kMaxWarpRowColumns];
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  for (int turn = 0; turn < static_cast<int>(blockDim.x) / kWarpSize; ++turn) {
    if (warp == turn) {
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int chunk = c * threads_per_row + team.rank;
        if (chunk >= row_chunks) continue;
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const int col = chunk * kVec + k;
          if (want_weight) {
            block_dy_n[col] = turn == 0 ? sum_dy_n[c][k] : block_dy_n[col] + sum_dy_n[c][k];
          }
          if (want_bias) block_dy[col] = turn == 0 ? sum_dy[c][k] : block_dy[col] + sum_dy[c][k];
        }
      }
    }
    __syncthreads();
  }
  for (int64_t col = threadIdx.x; col < hidden; col += blockDim.x) {
    if (want_weight) weight_row[col] = block_dy_n[col];
    if (want_bias) bias_row[col] = block_dy[col];
  }
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
  return DispatchNorm(
      kind, x_dtype, y_dtype, weight_dtype,
      [&](auto layer, auto x_tag, auto y_tag, auto weight_tag) {
        constexpr bool kLayer = decltype(layer)::value;
        using X = typename decltype(x_tag)::type;
        using Y = typename decltype(y_tag)::type;
        using W = typename decltype(weight_tag)::type;
        const auto* x_t = static_cast<const X*>(x);
        const auto* w_t = static_cast<const W*>(weight);
        const auto* b_t = static_cast<const W*>(bias);
        auto* y_t = static_cast<Y*>(y);
        const RowLayout layout = RowLayoutFor<X, W>(x, weight, bias, hidden);
        if (layout.threads_per_row == 0) {
          NormForwardKernel<kLayer, X, Y, W>
              <<<RowBlocks(rows), BlockKernelThreads(hidden), 0, stream>>>(x_t, w_t, b_t, y_t, mean,
                                                                           rstd, rows, hidden, eps);
          return cudaGetLastError();
        }
        const bool y_packed = Aligned(y, kChunkAlignment<Y, kVecOf<X>>);
        return DispatchChunks<kVecOf<X>>(layout.chunks, [&](auto chunks) {
          NormForwardRowKernel<kLayer, X, Y, W, decltype(chunks)::value>
              <<<RowKernelBlocks(layout, rows), RowKernelThreads(layout), 0, stream>>>(
                  x_t, w_t, b_t, y_t, mean, rstd, rows, hidden, eps, layout.threads_per_row,
                  y_packed);
          return cudaGetLastError();
        });
      });
}

NormBackwardPlan PlanNormBackward(NormKind kind, const void* x, const void* weight, int64_t rows,
                                  int64_t hidden, Dtype x_dtype, Dtype y_dtype,
                                  Dtype weight_dtype) {
  NormBackwardPlan plan;
  if (rows <= 0 || hidden <= 0) return plan;
  DispatchNorm(kind, x_dtype, y_dtype, weight_dtype,
               [&](auto layer, auto x_tag, auto /*y_tag*/, auto weight_tag) {
                 constexpr bool kLayer = decltype(layer)::value;
                 using X = typename decltype(x_tag)::type;
                 using W = typename decltype(weight_tag)::type;
                 const RowLayout layout = RowLayoutFor<X, W>(x, weight, nullptr, hidden);
                 if (layout.threads_per_row == 0) return cudaSuccess;
                 return DispatchChunks<kVecOf<X>>(layout.chunks, [&](auto chunks) {
                   // The occupancy of the kernel for a y of x's dtype whatever y_dtype is: the
                   // partitions, and so the order of the gradients' sums, do not depend on it.
                   const int threads = BackwardRowKernelThreads(layout);
                   const int64_t resident = ResidentBlocks(
                       NormBackwardRowKernel<kLayer, X, X, W, decltype(chunks)::value>, threads);
                   if (resident > 0) {
                     plan.threads_per_row = layout.threads_per_row;
                     plan.chunks = layout.chunks;
                     plan.partitions =
                         std::min(resident, CeilDiv(rows, threads / layout.threads_per_row));
                   }
                   return cudaSuccess;
                 });
               });
  if (plan.threads_per_row == 0) {
    plan.rows_per_partition = std::max(kMinRowsPerPartition, CeilDiv(rows, kMaxGridY));
    plan.partitions = CeilDiv(rows, plan.rows_per_partition);
  }
  return plan;
}

cudaError_t LaunchNormBackward(NormKind kind, const NormBackwardPlan& plan, const void* grad_y,
                               const void* x, const void* weight, const float* mean,
                               const float* rstd, const void* grad_residual, void* grad_x,
                               float* weight_partials, float* bias_partials, int64_t rows,
                               int64_t hidden, Dtype x_dtype, Dtype y_dtype, Dtype weight_dtype,
                               cudaStream_t stream) {
  if (rows <= 0 || hidden <= 0) return cudaSuccess;
  if (kind == NormKind::kLayer && mean == nullptr) return cudaErrorInvalidValue;
  if (kind == NormKind::kRms) bias_partials = nullptr;
  if (bias_partials != nullptr && weight_partials == nullptr) return cudaErrorInvalidValue;
  if (plan.partitions <= 0) return cudaErrorInvalidValue;
  if (grad_residual != nullptr && grad_x == nullptr) return cudaErrorInvalidValue;
  return DispatchNorm(
      kind, x_dtype, y_dtype, weight_dtype,
      [&](auto layer, auto x_tag, auto y_tag, auto weight_tag) {
        constexpr bool kLayer = decltype(layer)::value;
        using X = typename decltype(x_tag)::type;
        using Y = typename decltype(y_tag)::type;
        using W = typename decltype(weight_tag)::type;
        constexpr int kVec = kVecOf<X>;
        const auto* dy_t = static_cast<const Y*>(grad_y);
        const auto* x_t = static_cast<const X*>(x);
        const auto* w_t = static_cast<const W*>(weight);
        auto* dx_t = static_cast<X*>(grad_x);
        const auto* res_t = static_cast<const X*>(grad_residual);
        if (plan.threads_per_row == 0) {
          // The block kernels: grad_x, then the weight (and bias) partials in a second pass.
          if (plan.partitions > kMaxGridY || plan.partitions * plan.rows_per_partition < rows) {
            return cudaErrorInvalidValue;
          }
          if (grad_x != nullptr) {
            NormBackwardKernel<kLayer, X, Y, W>
                <<<RowBlocks(rows), BlockKernelThreads(hidden), 0, stream>>>(
                    dy_t, x_t, w_t, mean, rstd, res_t, dx_t, rows, hidden);
            if (const cudaError_t error = cudaGetLastError(); error != cudaSuccess) return error;
          }
          if (weight_partials == nullptr) return cudaSuccess;
          const dim3 grid(static_cast<unsigned>(CeilDiv(hidden, kElementwiseThreads)),
                          static_cast<unsigned>(plan.partitions));
          NormWeightGradPartialKernel<kLayer, X, Y><<<grid, kElementwiseThreads, 0, stream>>>(
              dy_t, x_t, mean, rstd, weight_partials, bias_partials, rows, hidden,
              plan.rows_per_partition);
          return cudaGetLastError();
        }
        // The plan must be for these operands (it fixes the partitions, so the gradients' sums).
        const RowLayout layout = RowLayoutFor<X, W>(x, weight, nullptr, hidden);
        if (layout.threads_per_row != plan.threads_per_row || layout.chunks != plan.chunks ||
            plan.partitions > kMaxRowBlocks) {
          return cudaErrorInvalidValue;
        }
        const bool grad_y_packed = Aligned(grad_y, kChunkAlignment<Y, kVec>);
        const bool grad_x_packed = Aligned(grad_x, kChunkAlignment<X, kVec>);
        const bool grad_residual_packed = Aligned(grad_residual, kChunkAlignment<X, kVec>);
        return DispatchChunks<kVec>(layout.chunks, [&](auto chunks) {
          NormBackwardRowKernel<kLayer, X, Y, W, decltype(chunks)::value>
              <<<static_cast<unsigned>(plan.partitions), BackwardRowKernelThreads(layout), 0,
                 stream>>>(dy_t, x_t, w_t, mean, rstd, res_t, dx_t, weight_partials, bias_partials,
                           rows, hidden, layout.threads_per_row, grad_y_packed, grad_x_packed,
                           grad_residual_packed);
          return cudaGetLastError();
        });
      });
}

}  // namespace tessera::trainer::kernels

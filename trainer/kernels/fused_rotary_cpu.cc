// The CPU rotary kernel of fused_ops_cpu.h. Compiled with -ffp-contract=off (trainer/model.cmake)
// so that no product is fused into the add after it: each product is rounded, then the sum, as
// ATen's composite (x * cos + rotate_half(x) * sin and its autograd backward) rounds them, which
// makes the kernel's results equal to the composite's bit for bit. Like fused_ops_cpu.cc it is
// built without the precompiled header and, where LibTorch ships its OpenMP runtime, with
// -fopenmp (at::parallel_for on LibTorch's threads; `omp simd` vectorises the row loops).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "trainer/kernels/fused_ops_cpu.h"

namespace tessera::trainer::cpu_kernels {
namespace {

// Rows per task of at::parallel_for: at least this many elements each.
constexpr int64_t kRotaryGrain = 16384;

// One row of head_dim = 2 h floats, h = half. Forward: out = x cos + rotate_half(x) sin, i.e.
// out[i] = x[i] c[i] - x[i+h] s[i], out[i+h] = x[i+h] c[i+h] + x[i] s[i+h]; backward (its
// transpose): out[i] = x[i] c[i] + x[i+h] s[i+h], out[i+h] = x[i+h] c[i+h] - x[i] s[i].
inline void RotaryRow(const float* __restrict__ in, const float* __restrict__ c,
                      const float* __restrict__ s, float* __restrict__ out, int64_t half,
                      bool transpose) {
  if (!transpose) {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = in[i], b = in[i + half];
      const float ac = a * c[i], bs = b * s[i];
      const float bc = b * c[i + half], as = a * s[i + half];
      out[i] = ac - bs;
      out[i + half] = bc + as;
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = in[i], b = in[i + half];
      const float ac = a * c[i], bs = b * s[i + half];
      const float bc = b * c[i + half], as = a * s[i];
      out[i] = ac + bs;
      out[i + half] = bc - as;
    }
  }
}

}  // namespace

void Rotary(const float* in, const float* cos, const float* sin, float* out, const RotaryRows& rows,
            bool transpose) {
  const int64_t n1 = rows.sizes[1], n2 = rows.sizes[2];
  const int64_t count = rows.sizes[0] * n1 * n2, half = rows.head_dim / 2;
  if (count <= 0 || half <= 0) return;
  const int64_t grain = std::max<int64_t>(1, kRotaryGrain / rows.head_dim);
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t c2 = r % n2, c1 = (r / n2) % n1, c0 = r / (n1 * n2);
      auto offset = [&](const int64_t* strides) {
        return c0 * strides[0] + c1 * strides[1] + c2 * strides[2];
      };
      const int64_t table = offset(rows.table_strides);
      RotaryRow(in + offset(rows.in_strides), cos + table, sin + table,
                out + offset(rows.out_strides), half, transpose);
    }
  });
}

}  // namespace tessera::trainer::cpu_kernels

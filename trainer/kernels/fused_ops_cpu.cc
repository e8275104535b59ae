// Compiled without the trainer's precompiled header and, where LibTorch ships its OpenMP
// runtime, with -fopenmp (trainer/model.cmake), which makes ATen/Parallel.h's at::parallel_for
// run on OpenMP threads instead of the calling thread.
#include "trainer/kernels/fused_ops_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

// Vectors of 16 floats are passed between inlined helpers; GCC notes that their ABI differs
// between the variants, which does not matter for functions that are always inlined.
#pragma GCC diagnostic ignored "-Wpsabi"

#if defined(__x86_64__) && defined(__GNUC__)
#define TESSERA_X86_VARIANTS 1
#else
#define TESSERA_X86_VARIANTS 0
#endif

namespace tessera::trainer::cpu_kernels {
namespace {

constexpr int kLanes = 16;
using VecF = float __attribute__((vector_size(kLanes * sizeof(float))));
using VecI = int32_t __attribute__((vector_size(kLanes * sizeof(int32_t))));

// Elements per task of at::parallel_for: below this, one thread does the whole call.
constexpr int64_t kGrain = 32768;

[[gnu::always_inline]] inline VecF Splat(float v) { return VecF{} + v; }

// exp(x) for x clamped to [-87, 87] (so that 2^n stays a normal float): x = n ln2 + r with
// |r| <= ln2 / 2 (ln2 split in two so that n ln2 is exact), exp(r) = 1 + r + r^2 P(r) with P a
// degree-5 fit, and 2^n built in the exponent bits. About 1 ulp.
[[gnu::always_inline]] inline VecF ExpClamped(VecF x) {
  x = x < Splat(-87.0f) ? Splat(-87.0f) : x;
  x = x > Splat(87.0f) ? Splat(87.0f) : x;
  // Adding 1.5 * 2^23 rounds x / ln2 to an integer held in the low mantissa bits.
  const VecF round = Splat(12582912.0f);
  const VecF shifted = x * Splat(1.44269504088896341f) + round;
  const VecI n = __builtin_bit_cast(VecI, shifted) - __builtin_bit_cast(VecI, round);
  const VecF nf = shifted - round;
  VecF r = x - nf * Splat(0.693359375f);
  r = r - nf * Splat(-2.12194440e-4f);
  VecF p = Splat(1.9875691500e-4f);
  p = p * r + Splat(1.3981999507e-3f);
  p = p * r + Splat(8.3334519073e-3f);
  p = p * r + Splat(4.1665795894e-2f);
  p = p * r + Splat(1.6666665459e-1f);
  p = p * r + Splat(5.0000001201e-1f);
  const VecF e = p * r * r + r + Splat(1.0f);
  const VecI scale_bits = (n + 127) << 23;
  return e * __builtin_bit_cast(VecF, scale_bits);
}

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kCubic = 0.044715f;

// GELU's pieces at x: s = sigmoid(2u) = (1 + tanh(u)) / 2 with u = sqrt(2/pi)(x + 0.044715 x^3),
// and exp(-2u), from which 1 - s = exp(-2u) s without cancellation.
struct GeluParts {
  VecF s, exp_minus_2u, x2;
};

[[gnu::always_inline]] inline GeluParts Parts(VecF x) {
  GeluParts parts;
  parts.x2 = x * x;
  const VecF u = Splat(kSqrt2OverPi) * x * (Splat(1.0f) + Splat(kCubic) * parts.x2);
  parts.exp_minus_2u = ExpClamped(Splat(-2.0f) * u);
  parts.s = Splat(1.0f) / (Splat(1.0f) + parts.exp_minus_2u);
  return parts;
}

// d/dx [x s(x)] = s + x * 2 s (1 - s) * du/dx, du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2).
[[gnu::always_inline]] inline VecF Derivative(VecF x, const GeluParts& p) {
  const VecF one_minus_s = p.s * p.exp_minus_2u;
  return p.s + Splat(2.0f * kSqrt2OverPi) * x * (p.s * one_minus_s) *
                   (Splat(1.0f) + Splat(3.0f * kCubic) * p.x2);
}

[[gnu::always_inline]] inline VecF Load(const float* p, int64_t count) {
  VecF v{};
  std::memcpy(&v, p, static_cast<size_t>(count) * sizeof(float));
  return v;
}

[[gnu::always_inline]] inline void Store(float* p, VecF v, int64_t count) {
  std::memcpy(p, &v, static_cast<size_t>(count) * sizeof(float));
}

// Calls body(i, count) for i = 0, 16, 32, ... < n: count is the constant 16 in the main loop, so
// that Load and Store become single vector moves there, and the remainder once for the tail.
template <typename Body>
[[gnu::always_inline]] inline void ForLanes(int64_t n, Body&& body) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) body(i, std::integral_constant<int64_t, kLanes>{});
  if (i < n) body(i, n - i);
}

// One thread's range. The tail is computed in a zero-padded vector and only its elements stored.
[[gnu::always_inline]] inline void GeluForwardRange(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const VecF xv = Load(x + i, kLanes);
    Store(y + i, xv * Parts(xv).s, kLanes);
  }
  if (i < n) {
    const VecF xv = Load(x + i, n - i);
    Store(y + i, xv * Parts(xv).s, n - i);
  }
}

[[gnu::always_inline]] inline void GeluBackwardRange(const float* grad_y, const float* x,
                                                     float* grad_x, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const VecF xv = Load(x + i, kLanes);
    Store(grad_x + i, Load(grad_y + i, kLanes) * Derivative(xv, Parts(xv)), kLanes);
  }
  if (i < n) {
    const VecF xv = Load(x + i, n - i);
    Store(grad_x + i, Load(grad_y + i, n - i) * Derivative(xv, Parts(xv)), n - i);
  }
}

// sigmoid(g), and 1 - sigmoid(g) = exp(-g) sigmoid(g) without cancellation.
[[gnu::always_inline]] inline void Sigmoid(VecF g, VecF* s, VecF* one_minus_s) {
  const VecF e = ExpClamped(-g);
  *s = Splat(1.0f) / (Splat(1.0f) + e);
  *one_minus_s = e * *s;
}

// SwiGLU: y = silu(g) u = g s u; dy/dg = u s (1 + g (1 - s)), dy/du = g s.
[[gnu::always_inline]] inline void SwiGluForwardRange(const float* gate, const float* up, float* y,
                                                      int64_t n) {
  ForLanes(
      n, [&](int64_t i, auto count) __attribute__((always_inline)) {
        const VecF g = Load(gate + i, count);
        VecF s, one_minus_s;
        Sigmoid(g, &s, &one_minus_s);
        Store(y + i, g * s * Load(up + i, count), count);
      });
}

[[gnu::always_inline]] inline void SwiGluBackwardRange(const float* grad_y, const float* gate,
                                                       const float* up, float* grad_gate,
                                                       float* grad_up, int64_t n) {
  ForLanes(
      n, [&](int64_t i, auto count) __attribute__((always_inline)) {
        const VecF g = Load(gate + i, count), u = Load(up + i, count), dy = Load(grad_y + i, count);
        VecF s, one_minus_s;
        Sigmoid(g, &s, &one_minus_s);
        Store(grad_gate + i, dy * u * s * (Splat(1.0f) + g * one_minus_s), count);
        Store(grad_up + i, dy * g * s, count);
      });
}

[[gnu::always_inline]] inline float SumLanes(VecF v) {
  float sum = 0;
  for (int lane = 0; lane < kLanes; ++lane) sum += v[lane];
  return sum;
}

// RMSNorm of rows [0, rows) of `hidden`: rstd = 1 / sqrt(mean(x^2) + eps), y = x rstd w.
[[gnu::always_inline]] inline void RmsNormForwardRows(const float* x, const float* w, float* y,
                                                      float* rstd, int64_t rows, int64_t hidden,
                                                      float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * hidden;
    float* yr = y + r * hidden;
    VecF squares{};
    ForLanes(
        hidden, [&](int64_t j, auto count) __attribute__((always_inline)) {
          const VecF v = Load(xr + j, count);
          squares += v * v;
        });
    const float inv = 1.0f / std::sqrt(SumLanes(squares) / static_cast<float>(hidden) + eps);
    rstd[r] = inv;
    ForLanes(
        hidden, [&](int64_t j, auto count) __attribute__((always_inline)) {
          Store(yr + j, Load(xr + j, count) * Splat(inv) * Load(w + j, count), count);
        });
  }
}

// Its backward for the same rows: grad_x = rstd (g w) - rstd^3 x mean(g w x) (null: not
// wanted), and the rows' share of grad_w, sum over rows of g x rstd, added into grad_w_sum
// (null: not wanted).
[[gnu::always_inline]] inline void RmsNormBackwardRows(const float* grad_y, const float* x,
                                                       const float* w, const float* rstd,
                                                       const float* grad_residual, float* grad_x,
                                                       float* grad_w_sum, int64_t rows,
                                                       int64_t hidden) {
  for (int64_t r = 0; r < rows; ++r) {
    const float *xr = x + r * hidden, *gr = grad_y + r * hidden;
    const float inv = rstd[r];
    if (grad_x != nullptr) {
      VecF dot{};
      ForLanes(
          hidden, [&](int64_t j, auto count) __attribute__((always_inline)) {
            dot += Load(gr + j, count) * Load(w + j, count) * Load(xr + j, count);
          });
      const float scale = inv * inv * inv * SumLanes(dot) / static_cast<float>(hidden);
      float* dxr = grad_x + r * hidden;
      const float* rr = grad_residual != nullptr ? grad_residual + r * hidden : nullptr;
      ForLanes(
          hidden, [&](int64_t j, auto count) __attribute__((always_inline)) {
            const VecF gw = Load(gr + j, count) * Load(w + j, count);
            const VecF dx = Splat(inv) * gw - Splat(scale) * Load(xr + j, count);
            // The residual's gradient added to the rounded dx, as a separate add would.
            Store(dxr + j, rr != nullptr ? dx + Load(rr + j, count) : dx, count);
          });
    }
    if (grad_w_sum != nullptr) {
      ForLanes(
          hidden, [&](int64_t j, auto count) __attribute__((always_inline)) {
            Store(grad_w_sum + j,
                  Load(grad_w_sum + j, count) +
                      Load(gr + j, count) * Load(xr + j, count) * Splat(inv),
                  count);
          });
    }
  }
}

// The ranges compiled for each instruction set: the same source, inlined into functions whose
// target lets the compiler lower the 16-lane vectors to one AVX-512 register, two AVX2 ones or
// four SSE2 ones. The AVX-512 and AVX2 variants fuse multiplies and adds into FMAs (a third
// faster), the baseline cannot, so results differ between them in the last bits.
struct RangeKernels {
  void (*gelu_forward)(const float*, float*, int64_t);
  void (*gelu_backward)(const float*, const float*, float*, int64_t);
  void (*swiglu_forward)(const float*, const float*, float*, int64_t);
  void (*swiglu_backward)(const float*, const float*, const float*, float*, float*, int64_t);
  void (*rms_norm_forward)(const float*, const float*, float*, float*, int64_t, int64_t, float);
  void (*rms_norm_backward)(const float*, const float*, const float*, const float*, const float*,
                            float*, float*, int64_t, int64_t);
};

#define TESSERA_DEFINE_RANGE_KERNELS(name, attributes)                                             \
  attributes void name##GeluForward(const float* x, float* y, int64_t n) {                         \
    GeluForwardRange(x, y, n);                                                                     \
  }                                                                                                \
  attributes void name##GeluBackward(const float* dy, const float* x, float* dx, int64_t n) {      \
    GeluBackwardRange(dy, x, dx, n);                                                               \
  }                                                                                                \
  attributes void name##SwiGluForward(const float* g, const float* u, float* y, int64_t n) {       \
    SwiGluForwardRange(g, u, y, n);                                                                \
  }                                                                                                \
  attributes void name##SwiGluBackward(const float* dy, const float* g, const float* u, float* dg, \
                                       float* du, int64_t n) {                                     \
    SwiGluBackwardRange(dy, g, u, dg, du, n);                                                      \
  }                                                                                                \
  attributes void name##RmsNormForward(const float* x, const float* w, float* y, float* rstd,      \
                                       int64_t rows, int64_t hidden, float eps) {                  \
    RmsNormForwardRows(x, w, y, rstd, rows, hidden, eps);                                          \
  }                                                                                                \
  attributes void name##RmsNormBackward(const float* dy, const float* x, const float* w,           \
                                        const float* rstd, const float* res, float* dx,            \
                                        float* dw_sum, int64_t rows, int64_t hidden) {             \
    RmsNormBackwardRows(dy, x, w, rstd, res, dx, dw_sum, rows, hidden);                            \
  }                                                                                                \
  constexpr RangeKernels k##name = {name##GeluForward,    name##GeluBackward,                      \
                                    name##SwiGluForward,  name##SwiGluBackward,                    \
                                    name##RmsNormForward, name##RmsNormBackward};

TESSERA_DEFINE_RANGE_KERNELS(Baseline, )
#if TESSERA_X86_VARIANTS
TESSERA_DEFINE_RANGE_KERNELS(Avx2, __attribute__((target("avx2,fma"))))
TESSERA_DEFINE_RANGE_KERNELS(Avx512, __attribute__((target("avx512f"))))
#endif

bool Supported(Isa isa) {
  switch (isa) {
    case Isa::kBaseline:
      return true;
#if TESSERA_X86_VARIANTS
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f");
#endif
    default:
      return false;
  }
}

const RangeKernels& KernelsFor(Isa isa) {
  switch (isa) {
#if TESSERA_X86_VARIANTS
    case Isa::kAvx2:
      return kAvx2;
    case Isa::kAvx512:
      return kAvx512;
#endif
    default:
      return kBaseline;
  }
}

}  // namespace

std::vector<Isa> SupportedIsas() {
  std::vector<Isa> isas;
  for (Isa isa : {Isa::kBaseline, Isa::kAvx2, Isa::kAvx512}) {
    if (Supported(isa)) isas.push_back(isa);
  }
  return isas;
}

Isa BestIsa() {
  static const Isa best = Supported(Isa::kAvx512) ? Isa::kAvx512
                          : Supported(Isa::kAvx2) ? Isa::kAvx2
                                                  : Isa::kBaseline;
  return best;
}

void GeluTanhForward(const float* x, float* y, int64_t n, std::optional<Isa> isa) {
  const RangeKernels& kernels = KernelsFor(isa.value_or(BestIsa()));
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    kernels.gelu_forward(x + begin, y + begin, end - begin);
  });
}

void GeluTanhBackward(const float* grad_y, const float* x, float* grad_x, int64_t n,
                      std::optional<Isa> isa) {
  const RangeKernels& kernels = KernelsFor(isa.value_or(BestIsa()));
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    kernels.gelu_backward(grad_y + begin, x + begin, grad_x + begin, end - begin);
  });
}

void SwiGluForward(const float* gate, const float* up, float* y, int64_t n,
                   std::optional<Isa> isa) {
  const RangeKernels& kernels = KernelsFor(isa.value_or(BestIsa()));
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    kernels.swiglu_forward(gate + begin, up + begin, y + begin, end - begin);
  });
}

void SwiGluBackward(const float* grad_y, const float* gate, const float* up, float* grad_gate,
                    float* grad_up, int64_t n, std::optional<Isa> isa) {
  const RangeKernels& kernels = KernelsFor(isa.value_or(BestIsa()));
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    kernels.swiglu_backward(grad_y + begin, gate + begin, up + begin, grad_gate + begin,
                            grad_up + begin, end - begin);
  });
}

namespace {
// Rows per task of the RMSNorm kernels, at least: a task holds at least kGrain elements.
int64_t RowGrain(int64_t hidden) {
  return std::max<int64_t>(1, kGrain / std::max<int64_t>(1, hidden));
}
}  // namespace

void RmsNormForward(const float* x, const float* weight, float* y, float* rstd, int64_t rows,
                    int64_t hidden, float eps, std::optional<Isa> isa) {
  const RangeKernels& kernels = KernelsFor(isa.value_or(BestIsa()));
  at::parallel_for(0, rows, RowGrain(hidden), [&](int64_t begin, int64_t end) {
    kernels.rms_norm_forward(x + begin * hidden, weight, y + begin * hidden, rstd + begin,
                             end - begin, hidden, eps);
  });
}

void RmsNormBackward(const float* grad_y, const float* x, const float* weight, const float* rstd,
                     float* grad_x, float* grad_weight, int64_t rows, int64_t hidden,
                     std::optional<Isa> isa, const float* grad_residual) {
  const RangeKernels& kernels = KernelsFor(isa.value_or(BestIsa()));
  // The weight's gradient is summed per block of kRmsNormBlockRows rows, in a fixed order:
  // the same bits whatever the number of threads.
  const int64_t blocks =
      grad_weight != nullptr ? (rows + kRmsNormBlockRows - 1) / kRmsNormBlockRows : 0;
  std::vector<float> partial(static_cast<size_t>(blocks * hidden), 0.0f);
  const int64_t block_rows = kRmsNormBlockRows;
  at::parallel_for(0, (rows + block_rows - 1) / block_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t first = b * block_rows, count = std::min(block_rows, rows - first);
      kernels.rms_norm_backward(grad_y + first * hidden, x + first * hidden, weight, rstd + first,
                                grad_residual != nullptr ? grad_residual + first * hidden : nullptr,
                                grad_x != nullptr ? grad_x + first * hidden : nullptr,
                                blocks > 0 ? partial.data() + b * hidden : nullptr, count, hidden);
    }
  });
  if (grad_weight == nullptr) return;
  std::fill(grad_weight, grad_weight + hidden, 0.0f);
  for (int64_t b = 0; b < blocks; ++b) {
    const float* row = partial.data() + b * hidden;
    for (int64_t j = 0; j < hidden; ++j) grad_weight[j] += row[j];
  }
}

bool CpuKernelsParallel() {
#ifdef _OPENMP
  return true;
#else
  return false;
#endif
}

}  // namespace tessera::trainer::cpu_kernels

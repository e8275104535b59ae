// Compiled without the trainer's precompiled header and, where LibTorch ships its OpenMP
// runtime, with -fopenmp (trainer/model.cmake), which makes ATen/Parallel.h's at::parallel_for
// run on OpenMP threads instead of the calling thread.
#include "trainer/fused_ops_cpu.h"

#include <ATen/Parallel.h>

#include <cstring>

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

// The ranges compiled for each instruction set: the same source, inlined into functions whose
// target lets the compiler lower the 16-lane vectors to one AVX-512 register, two AVX2 ones or
// four SSE2 ones. The AVX-512 and AVX2 variants fuse multiplies and adds into FMAs (a third
// faster), the baseline cannot, so results differ between them in the last bits.
struct RangeKernels {
  void (*forward)(const float*, float*, int64_t);
  void (*backward)(const float*, const float*, float*, int64_t);
};

#define TESSERA_DEFINE_RANGE_KERNELS(name, attributes)                                            \
  attributes void name##Forward(const float* x, float* y, int64_t n) {                            \
    GeluForwardRange(x, y, n);                                                                    \
  }                                                                                               \
  attributes void name##Backward(const float* grad_y, const float* x, float* grad_x, int64_t n) { \
    GeluBackwardRange(grad_y, x, grad_x, n);                                                      \
  }                                                                                               \
  constexpr RangeKernels k##name = {name##Forward, name##Backward};

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

Isa Best() {
  static const Isa best = Supported(Isa::kAvx512) ? Isa::kAvx512
                          : Supported(Isa::kAvx2) ? Isa::kAvx2
                                                  : Isa::kBaseline;
  return best;
}

}  // namespace

std::vector<Isa> SupportedIsas() {
  std::vector<Isa> isas;
  for (Isa isa : {Isa::kBaseline, Isa::kAvx2, Isa::kAvx512}) {
    if (Supported(isa)) isas.push_back(isa);
  }
  return isas;
}

Isa BestIsa() { return Best(); }

void GeluTanhForward(const float* x, float* y, int64_t n, std::optional<Isa> isa) {
  const RangeKernels& kernels = KernelsFor(isa.value_or(Best()));
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    kernels.forward(x + begin, y + begin, end - begin);
  });
}

void GeluTanhBackward(const float* grad_y, const float* x, float* grad_x, int64_t n,
                      std::optional<Isa> isa) {
  const RangeKernels& kernels = KernelsFor(isa.value_or(Best()));
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    kernels.backward(grad_y + begin, x + begin, grad_x + begin, end - begin);
  });
}

bool CpuKernelsParallel() {
#ifdef _OPENMP
  return true;
#else
  return false;
#endif
}

}  // namespace tessera::trainer::cpu_kernels

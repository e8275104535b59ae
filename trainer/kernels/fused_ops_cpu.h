// CPU kernels of the fused ops (fused_ops.h), on float32 buffers (fused_ops_cpu.cc; the rotary
// one in fused_rotary_cpu.cc). They split the work over
// ATen's intra-op threads (at::parallel_for, the OpenMP pool LibTorch's own kernels use, so one
// pool serves both) when the build links LibTorch's OpenMP runtime, and run on the calling
// thread otherwise. On x86-64 each kernel is built for AVX-512, AVX2 + FMA and the baseline
// (SSE2), and the best one the CPU supports runs; they agree to float32 rounding (the first two
// use FMAs).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace tessera::trainer::cpu_kernels {

// The instruction sets the kernels are built for (AVX2 and AVX-512 on x86-64 only).
enum class Isa { kBaseline, kAvx2, kAvx512 };
// Those of the built variants that this CPU runs, kBaseline first; and the one used by default.
std::vector<Isa> SupportedIsas();
Isa BestIsa();

// Each kernel runs BestIsa()'s variant unless `isa` names another (tests compare them; an
// unsupported one must not be named).

// y[i] = GELU(x[i]) with the tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))),
// computed as x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3)) (the same function; no cancellation
// where tanh is near -1). Within a few float32 ulps of ATen's gelu(x, "tanh") on finite input.
void GeluTanhForward(const float* x, float* y, int64_t n, std::optional<Isa> isa = std::nullopt);

// grad_x[i] = grad_y[i] * GELU'(x[i]), the derivative recomputed from x in the same pass.
// grad_x may alias grad_y.
void GeluTanhBackward(const float* grad_y, const float* x, float* grad_x, int64_t n,
                      std::optional<Isa> isa = std::nullopt);

// SwiGLU's activation, silu(gate) * up, over n floats; and its backward, both gradients in one
// pass.
void SwiGluForward(const float* gate, const float* up, float* y, int64_t n,
                   std::optional<Isa> isa = std::nullopt);
void SwiGluBackward(const float* grad_y, const float* gate, const float* up, float* grad_gate,
                    float* grad_up, int64_t n, std::optional<Isa> isa = std::nullopt);

// RMSNorm of `rows` contiguous rows of `hidden` floats: rstd[r] = 1 / sqrt(mean(x_r^2) + eps),
// y_r = x_r * rstd[r] * weight.
void RmsNormForward(const float* x, const float* weight, float* y, float* rstd, int64_t rows,
                    int64_t hidden, float eps, std::optional<Isa> isa = std::nullopt);
// Its backward from the forward's rstd: grad_x (null: not computed) and grad_weight (null: not
// computed; else overwritten). grad_weight sums blocks of kRmsNormBlockRows rows in a fixed
// order, so it does not depend on the number of threads. grad_residual (null: none), rows x
// hidden, is added to grad_x after it is rounded: bit for bit grad_x + grad_residual as a
// separate add gives it (the gradient that x also gets through a residual connection).
inline constexpr int64_t kRmsNormBlockRows = 64;
void RmsNormBackward(const float* grad_y, const float* x, const float* weight, const float* rstd,
                     float* grad_x, float* grad_weight, int64_t rows, int64_t hidden,
                     std::optional<Isa> isa = std::nullopt, const float* grad_residual = nullptr);

// Rotary position embedding over rows of head_dim floats, the operand seen as
// [sizes[0], sizes[1], sizes[2], head_dim] with the last dimension contiguous (stride 1) in the
// input, the output and the cos / sin tables; the other strides are in elements, the tables' 0
// where they broadcast (both tables share them). With h = head_dim / 2 (head_dim even), per
// row: forward (transpose false) out = x cos + rotate_half(x) sin, rotate_half(x) =
// cat(-x[h:], x[:h]); its transpose, the backward, with transpose true. Each product and sum is
// rounded once, in the composite's order, so the results are the composite's bit for bit (not a
// variant per instruction set: the loop is memory-bound). out must not overlap in.
struct RotaryRows {
  int64_t sizes[3] = {0, 0, 0};
  int64_t head_dim = 0;
  int64_t in_strides[3] = {0, 0, 0};
  int64_t out_strides[3] = {0, 0, 0};
  int64_t table_strides[3] = {0, 0, 0};
};
void Rotary(const float* in, const float* cos, const float* sin, float* out, const RotaryRows& rows,
            bool transpose);

// Whether the kernels split their work over threads in this build (see above).
bool CpuKernelsParallel();

}  // namespace tessera::trainer::cpu_kernels

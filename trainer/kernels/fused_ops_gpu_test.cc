// The CUDA kernels of fused_ops.h (when there is a GPU; every case skips without one): forward and
// every gradient against ATen's composite on the same GPU, float32 to float32 rounding and
// bfloat16 / float16 against the float32 composite of the same (rounded) inputs, over odd sizes,
// non-contiguous and misaligned inputs, widths of both norm implementations, more than 65535 rows
// and empty inputs, the norms straight into 16-bit dtypes, the norms' gradients run to run and
// ResidualAdd bit for bit; and Qwen3- and GPT-2-shaped models' loss and gradients under autocast
// with the kernels on and off. fused_ops_test.cc has the CPU side.
#include <ATen/autocast_mode.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/model_config.h"
#include "trainer/kernels/device.h"
#include "trainer/kernels/fused_ops.h"
#include "trainer/kernels/fused_ops_fixture.h"
#include "trainer/model/model.h"
#include "trainer/model/model_dims_fixture.h"

namespace tessera::trainer {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// ---- GPU: the kernels against the composite on the same device. ----

class FusedOpsGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible";
    ASSERT_TRUE(FusedKernelsBuilt()) << "a CUDA device but a build without the CUDA kernels";
    ASSERT_TRUE(FusedKernelsEnabled());
    torch::manual_seed(17);
  }

  static Tensor Randn(std::vector<int64_t> sizes, torch::ScalarType dtype = torch::kFloat32) {
    return torch::randn(sizes, torch::TensorOptions().device(torch::kCUDA)).to(dtype);
  }
};

// Float32: the composite's numbers up to float32 rounding (reductions run in another order).
constexpr double kRtol32 = 1e-5, kAtol32 = 1e-5;
constexpr double kFloat32Epsilon = 0x1p-23;
// Lower precision: the result of the float32 composite on the same (already rounded) inputs, up
// to about two roundings to 8 significant bits.
constexpr double kRtolLow = 2e-2, kAtolLow = 1e-2;

TEST_F(FusedOpsGpuTest, RmsNormFloat32MatchesComposite) {
  for (int64_t hidden : {1000, 4096, 5120, 77, 128, 1}) {
    SCOPED_TRACE(hidden);
    const Tensor x = Randn({3, 5, hidden}), w = Randn({hidden}), grad = Randn({3, 5, hidden});
    const OpRun fused = RunOp(kFusedRmsNorm, {x, w}, {true, true}, grad);
    EXPECT_THAT(fused.node, HasSubstr("NormFunction"));
    ExpectRunClose(fused, RunOp(kReferenceRmsNorm, {x, w}, {true, true}, grad), kRtol32, kAtol32,
                   "rms_norm f32");
  }
}

TEST_F(FusedOpsGpuTest, RmsNormLowPrecisionMatchesFloat32Composite) {
  // bf16 activations with a float32 weight are what autocast gives the q/k norms; a weight of the
  // activations' dtype is covered too.
  for (auto dtype : {torch::kBFloat16, torch::kFloat16}) {
    for (auto weight_dtype : {torch::kFloat32, dtype}) {
      SCOPED_TRACE(c10::toString(dtype) + std::string(" weight ") + c10::toString(weight_dtype));
      const Tensor x = Randn({4, 9, 4096}, dtype), w = Randn({4096}, weight_dtype);
      const Tensor grad = Randn({4, 9, 4096}, dtype);
      const OpRun fused = RunOp(kFusedRmsNorm, {x, w}, {true, true}, grad);
      EXPECT_THAT(fused.node, HasSubstr("NormFunction"));
      ASSERT_EQ(fused.output.scalar_type(), dtype);
      ASSERT_EQ(fused.grads[1].scalar_type(), weight_dtype);
      const OpRun reference =
          RunOp(kReferenceRmsNorm, {x.to(torch::kFloat32), w.to(torch::kFloat32)}, {true, true},
                grad.to(torch::kFloat32));
      ExpectClose(fused.output.to(torch::kFloat32), reference.output, kRtolLow, kAtolLow, "output");
      ExpectClose(fused.grads[0].to(torch::kFloat32), reference.grads[0], kRtolLow, kAtolLow,
                  "grad x");
      ExpectClose(fused.grads[1].to(torch::kFloat32), reference.grads[1], kRtolLow, kAtolLow,
                  "grad weight");
    }
  }
}

TEST_F(FusedOpsGpuTest, RmsNormManyRowsNonContiguousAndFrozenWeight) {
  // More rows than one grid dimension of blocks (65535) and than one weight-gradient partition.
  {
    const Tensor x = Randn({70001, 64}), w = Randn({64}), grad = Randn({70001, 64});
    ExpectRunClose(RunOp(kFusedRmsNorm, {x, w}, {true, true}, grad),
                   RunOp(kReferenceRmsNorm, {x, w}, {true, true}, grad), kRtol32, kAtol32,
                   "70001 rows");
  }
  // A transposed input; a weight that takes no gradient (a frozen norm under LoRA).
  {
    const Tensor x = Randn({96, 6, 4}), w = Randn({4}), grad = Randn({6, 96, 4});
    auto transposed = [](size_t i, const Tensor& t) { return i == 0 ? t.transpose(0, 1) : t; };
    const OpRun fused = RunOp(kFusedRmsNorm, {x, w}, {true, false}, grad, transposed);
    EXPECT_THAT(fused.node, HasSubstr("NormFunction"));
    EXPECT_FALSE(fused.grads[1].defined());
    ExpectRunClose(fused, RunOp(kReferenceRmsNorm, {x, w}, {true, false}, grad, transposed),
                   kRtol32, kAtol32, "transposed");
  }
}

TEST_F(FusedOpsGpuTest, LayerNormFloat32MatchesComposite) {
  for (int64_t hidden : {768, 1000, 4096, 77, 1}) {
    SCOPED_TRACE(hidden);
    const Tensor x = Randn({3, 5, hidden}) * 3 + 1, w = Randn({hidden}), b = Randn({hidden});
    const Tensor grad = Randn({3, 5, hidden});
    const OpRun fused = RunOp(kFusedLayerNorm, {x, w, b}, {true, true, true}, grad);
    EXPECT_THAT(fused.node, HasSubstr("NormFunction"));
    ExpectRunClose(fused, RunOp(kReferenceLayerNorm, {x, w, b}, {true, true, true}, grad), kRtol32,
                   kAtol32, "layer_norm f32");
    // Without a bias.
    ExpectRunClose(RunOp(kFusedLayerNorm, {x, w}, {true, true}, grad),
                   RunOp(kReferenceLayerNorm, {x, w}, {true, true}, grad), kRtol32, kAtol32,
                   "layer_norm f32 without bias");
  }
}

TEST_F(FusedOpsGpuTest, LayerNormLowPrecisionManyRowsAndFrozenWeights) {
  for (auto dtype : {torch::kBFloat16, torch::kFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    const Tensor x = Randn({4, 9, 768}, dtype), w = Randn({768}), b = Randn({768});
    const Tensor grad = Randn({4, 9, 768}, dtype);
    const OpRun fused = RunOp(kFusedLayerNorm, {x, w, b}, {true, true, true}, grad);
    EXPECT_THAT(fused.node, HasSubstr("NormFunction"));
    ASSERT_EQ(fused.output.scalar_type(), dtype);
    const OpRun reference = RunOp(kReferenceLayerNorm, {x.to(torch::kFloat32), w, b},
                                  {true, true, true}, grad.to(torch::kFloat32));
    ExpectClose(fused.output.to(torch::kFloat32), reference.output, kRtolLow, kAtolLow, "output");
    for (size_t i = 0; i < 3; ++i) {
      ExpectClose(fused.grads[i].to(torch::kFloat32), reference.grads[i], kRtolLow, kAtolLow,
                  "grad " + std::to_string(i));
    }
  }
  // More rows than one grid dimension of blocks and than one weight-gradient partition.
  {
    const Tensor x = Randn({70001, 64}), w = Randn({64}), b = Randn({64});
    const Tensor grad = Randn({70001, 64});
    ExpectRunClose(RunOp(kFusedLayerNorm, {x, w, b}, {true, true, true}, grad),
                   RunOp(kReferenceLayerNorm, {x, w, b}, {true, true, true}, grad), kRtol32,
                   kAtol32, "70001 rows");
  }
  // A transposed input; weight and bias that take no gradient (frozen under LoRA).
  {
    const Tensor x = Randn({96, 6, 40}), w = Randn({40}), b = Randn({40});
    const Tensor grad = Randn({6, 96, 40});
    auto transposed = [](size_t i, const Tensor& t) { return i == 0 ? t.transpose(0, 1) : t; };
    const OpRun fused = RunOp(kFusedLayerNorm, {x, w, b}, {true, false, false}, grad, transposed);
    EXPECT_FALSE(fused.grads[1].defined());
    EXPECT_FALSE(fused.grads[2].defined());
    ExpectRunClose(fused,
                   RunOp(kReferenceLayerNorm, {x, w, b}, {true, false, false}, grad, transposed),
                   kRtol32, kAtol32, "transposed");
  }
}

// A float32 input normalised straight into bfloat16 / float16 (what the model asks for under
// autocast) is exactly the kernel's float32 result cast, and a 16-bit output gradient gives
// exactly the gradients that the same values in float32 give: one rounding, same arithmetic.
// Widths 768 and 4096 take the row kernels (a warp, a block per row), 77 the block kernels.
TEST_F(FusedOpsGpuTest, NormsIntoA16BitDtypeAreTheCastOfTheFloat32Result) {
  for (int64_t hidden : {768, 4096, 77}) {
    for (bool rms : {true, false}) {
      for (auto dtype : {torch::kBFloat16, torch::kFloat16}) {
        SCOPED_TRACE(std::to_string(hidden) + (rms ? " rms " : " layer ") + c10::toString(dtype));
        const Tensor x = Randn({3, 11, hidden}), w = Randn({hidden}), b = Randn({hidden});
        const Tensor grad = Randn({3, 11, hidden}, dtype);
        auto norm = [&](std::optional<at::ScalarType> out) -> Op {
          return [rms, out](const std::vector<Tensor>& in) {
            return rms ? FusedRmsNorm(in[0], in[1], 1e-6, out)
                       : FusedLayerNorm(in[0], in[1], in[2], 1e-5, out);
          };
        };
        const OpRun low = RunOp(norm(dtype), {x, w, b}, {true, true, !rms}, grad);
        const OpRun wide =
            RunOp(norm(std::nullopt), {x, w, b}, {true, true, !rms}, grad.to(torch::kFloat32));
        EXPECT_THAT(low.node, HasSubstr("NormFunction"));
        ASSERT_EQ(low.output.scalar_type(), dtype);
        EXPECT_TRUE(torch::equal(low.output, wide.output.to(dtype)));
        for (size_t i = 0; i < 3; ++i) {
          ASSERT_EQ(low.grads[i].defined(), wide.grads[i].defined()) << i;
          if (!low.grads[i].defined()) continue;
          EXPECT_EQ(low.grads[i].scalar_type(), torch::kFloat32) << i;
          EXPECT_TRUE(torch::equal(low.grads[i], wide.grads[i])) << "grad " << i;
        }
      }
    }
  }
}

// The norms at widths the row kernels take with one warp per row (64, 768, 1000, 1024) and with
// a block per row (4096, 8192), and at widths they leave to the block kernels (77 and 1: not
// whole 16-byte chunks of x; 8200: wider than 8192): forward and every gradient against the
// composite, RMSNorm, LayerNorm with and without a bias, float32 and bfloat16 activations.
TEST_F(FusedOpsGpuTest, NormsMatchCompositeAtRowAndBlockKernelWidths) {
  for (int64_t hidden : {64, 768, 1000, 1024, 4096, 8192, 77, 1, 8200}) {
    SCOPED_TRACE(hidden);
    // LayerNorm's x off centre; RMSNorm's not (at hidden 1 its grad_x is a cancellation that
    // grows relative to the rest as |x| does).
    const Tensor x = Randn({5, 7, hidden}) * 3 + 1, w = Randn({hidden}), b = Randn({hidden});
    const Tensor x_rms = Randn({5, 7, hidden}), grad = Randn({5, 7, hidden});
    const OpRun rms = RunOp(kFusedRmsNorm, {x_rms, w}, {true, true}, grad);
    EXPECT_THAT(rms.node, HasSubstr("NormFunction"));
    const OpRun rms_reference = RunOp(kReferenceRmsNorm, {x_rms, w}, {true, true}, grad);
    ExpectClose(rms.output, rms_reference.output, kRtol32, kAtol32, "rms_norm f32 output");
    ExpectClose(rms.grads[1], rms_reference.grads[1], kRtol32, kAtol32, "rms_norm f32 grad 1");
    // grad_x = g w rstd - x rstd^3 mean(g w x): two terms of size |g w| rstd that cancel down to
    // eps / |x|^3 at hidden 1. Two float32 computations of it can then differ by a few roundings
    // of the terms, not of the result, so the tolerance is in units of the terms' size.
    const double terms =
        (grad * w * torch::rsqrt(x_rms.pow(2).mean(-1, true) + 1e-6)).abs().max().item<double>();
    const double grad_x_max = rms_reference.grads[0].abs().max().item<double>();
    ExpectClose(rms.grads[0], rms_reference.grads[0], kRtol32,
                std::max(kAtol32, 16 * kFloat32Epsilon * terms / grad_x_max),
                "rms_norm f32 grad 0");
    ExpectRunClose(RunOp(kFusedLayerNorm, {x, w, b}, {true, true, true}, grad),
                   RunOp(kReferenceLayerNorm, {x, w, b}, {true, true, true}, grad), kRtol32,
                   kAtol32, "layer_norm f32");
    ExpectRunClose(RunOp(kFusedLayerNorm, {x, w}, {true, true}, grad),
                   RunOp(kReferenceLayerNorm, {x, w}, {true, true}, grad), kRtol32, kAtol32,
                   "layer_norm f32 without bias");
    // bf16 activations (chunks of 8) with a float32 weight, against the float32 composite of the
    // same rounded values.
    const Tensor xl = x.to(torch::kBFloat16), gradl = grad.to(torch::kBFloat16);
    const OpRun low = RunOp(kFusedLayerNorm, {xl, w, b}, {true, true, true}, gradl);
    const OpRun reference = RunOp(kReferenceLayerNorm, {xl.to(torch::kFloat32), w, b},
                                  {true, true, true}, gradl.to(torch::kFloat32));
    ExpectClose(low.output.to(torch::kFloat32), reference.output, kRtolLow, kAtolLow,
                "layer_norm bf16 output");
    for (size_t i = 0; i < 3; ++i) {
      ExpectClose(low.grads[i].to(torch::kFloat32), reference.grads[i], kRtolLow, kAtolLow,
                  "layer_norm bf16 grad " + std::to_string(i));
    }
  }
}

// The row kernels over more rows than one grid dimension of blocks (65535); operands one element
// into their storage (contiguous but not 16-byte aligned: x or the weight so sends the rows to
// the block kernels, grad_y so makes the row kernel load it one element at a time); frozen
// weight or bias, and an x that takes no gradient (weight and bias gradients alone).
TEST_F(FusedOpsGpuTest, NormRowKernelsTakeManyRowsMisalignedOperandsAndFrozenParameters) {
  {
    const Tensor x = Randn({70001, 768}), w = Randn({768}), b = Randn({768});
    const Tensor grad = Randn({70001, 768});
    ExpectRunClose(RunOp(kFusedLayerNorm, {x, w, b}, {true, true, true}, grad),
                   RunOp(kReferenceLayerNorm, {x, w, b}, {true, true, true}, grad), kRtol32,
                   kAtol32, "70001 rows x 768");
    const Tensor x2 = Randn({66000, 2048}), w2 = Randn({2048}), grad2 = Randn({66000, 2048});
    ExpectRunClose(RunOp(kFusedRmsNorm, {x2, w2}, {true, true}, grad2),
                   RunOp(kReferenceRmsNorm, {x2, w2}, {true, true}, grad2), kRtol32, kAtol32,
                   "66000 rows x 2048");
  }
  constexpr int64_t kRows = 37, kHidden = 768;
  // Values one element longer than the operand; the op sees the view past the first element.
  auto shift = [](const Tensor& t, std::vector<int64_t> sizes) {
    return t.narrow(0, 1, t.size(0) - 1).view(sizes);
  };
  const Tensor x = Randn({kRows * kHidden + 1}), w = Randn({kHidden + 1}), b = Randn({kHidden});
  const Tensor grad = Randn({kRows, kHidden});
  const Tensor misaligned_grad = shift(Randn({kRows * kHidden + 1}), {kRows, kHidden});
  for (bool shift_x : {true, false}) {
    for (bool shift_w : {true, false}) {
      SCOPED_TRACE(std::string(shift_x ? "x shifted " : "x aligned ") +
                   (shift_w ? "weight shifted" : "weight aligned"));
      auto make_input = [&](size_t i, const Tensor& t) {
        if (i == 0)
          return shift_x ? shift(t, {kRows, kHidden})
                         : t.narrow(0, 0, kRows * kHidden).view({kRows, kHidden});
        if (i == 1) return shift_w ? shift(t, {kHidden}) : t.narrow(0, 0, kHidden);
        return t;
      };
      for (const Tensor& g : {grad, misaligned_grad}) {
        ExpectRunClose(RunOp(kFusedLayerNorm, {x, w, b}, {true, true, true}, g, make_input),
                       RunOp(kReferenceLayerNorm, {x, w, b}, {true, true, true}, g, make_input),
                       kRtol32, kAtol32, "layer_norm");
        ExpectRunClose(RunOp(kFusedRmsNorm, {x, w}, {true, true}, g, make_input),
                       RunOp(kReferenceRmsNorm, {x, w}, {true, true}, g, make_input), kRtol32,
                       kAtol32, "rms_norm");
      }
    }
  }
  // Frozen parameters, and no gradient for x (the row kernel writes no grad_x).
  const Tensor x2 = Randn({kRows, kHidden}), w2 = Randn({kHidden});
  for (const std::vector<bool>& differentiable : {std::vector<bool>{true, false, false},
                                                  {true, false, true},
                                                  {true, true, false},
                                                  {false, true, true},
                                                  {false, true, false}}) {
    SCOPED_TRACE(::testing::PrintToString(differentiable));
    const OpRun fused = RunOp(kFusedLayerNorm, {x2, w2, b}, differentiable, grad);
    for (size_t i = 0; i < 3; ++i) EXPECT_EQ(fused.grads[i].defined(), differentiable[i]) << i;
    ExpectRunClose(fused, RunOp(kReferenceLayerNorm, {x2, w2, b}, differentiable, grad), kRtol32,
                   kAtol32, "layer_norm frozen");
    const std::vector<bool> rms_differentiable(differentiable.begin(), differentiable.begin() + 2);
    if (!rms_differentiable[0] && !rms_differentiable[1]) continue;
    ExpectRunClose(RunOp(kFusedRmsNorm, {x2, w2}, rms_differentiable, grad),
                   RunOp(kReferenceRmsNorm, {x2, w2}, rms_differentiable, grad), kRtol32, kAtol32,
                   "rms_norm frozen");
  }
}

// The weight and bias gradients are column sums of per-block partials, in a fixed order: two
// runs give the same bits (and grad_x too), at the GPT-2 124M step's shape (16,384 rows of 768,
// float32 in, bf16 out), a block-per-row width and a block-kernel width.
TEST_F(FusedOpsGpuTest, NormGradientsAreTheSameBitsRunToRun) {
  for (int64_t hidden : {768, 4096, 77}) {
    SCOPED_TRACE(hidden);
    const Tensor x = Randn({16384, hidden}), w = Randn({hidden}), b = Randn({hidden});
    const Tensor grad = Randn({16384, hidden}, torch::kBFloat16);
    const Op layer = [](const std::vector<Tensor>& in) {
      return FusedLayerNorm(in[0], in[1], in[2], 1e-5, torch::kBFloat16);
    };
    const Op rms = [](const std::vector<Tensor>& in) {
      return FusedRmsNorm(in[0], in[1], 1e-6, torch::kBFloat16);
    };
    ExpectIdentical(RunOp(layer, {x, w, b}, {true, true, true}, grad),
                    RunOp(layer, {x, w, b}, {true, true, true}, grad));
    ExpectIdentical(RunOp(rms, {x, w}, {true, true}, grad), RunOp(rms, {x, w}, {true, true}, grad));
  }
}

TEST_F(FusedOpsGpuTest, RotaryFloat32MatchesCompositeOnTheModelsLayout) {
  for (int64_t head_dim : {128, 64, 10, 2}) {
    SCOPED_TRACE(head_dim);
    auto [cos, sin] = RotaryTables(/*max_seq_len=*/40, head_dim, 10000);
    // The model passes narrowed tables and q.transpose(1, 2) of q [batch, seq, heads, head_dim].
    cos = cos.to(torch::kCUDA).narrow(0, 0, 33);
    sin = sin.to(torch::kCUDA).narrow(0, 0, 33);
    const Tensor x = Randn({2, 33, 5, head_dim}), grad = Randn({2, 5, 33, head_dim});
    const OpRun fused = RunOp(kFusedRotary, {x, cos, sin}, {true, false, false}, grad, HeadsFirst);
    EXPECT_THAT(fused.node, HasSubstr("RotaryFunction"));
    ExpectRunClose(fused,
                   RunOp(kReferenceRotary, {x, cos, sin}, {true, false, false}, grad, HeadsFirst),
                   kRtol32, kAtol32, "rotary transposed");
    // A contiguous x, a 2-d x broadcast over rows (stride 0) and a transposed output gradient.
    const Tensor x4 = Randn({2, 5, 33, head_dim});
    ExpectRunClose(RunOp(kFusedRotary, {x4, cos, sin}, {true, false, false},
                         grad.transpose(1, 2).contiguous().transpose(1, 2)),
                   RunOp(kReferenceRotary, {x4, cos, sin}, {true, false, false}, grad), kRtol32,
                   kAtol32, "rotary contiguous");
    const Tensor row = Randn({head_dim}), grad2 = Randn({33, head_dim});
    auto expand = [](size_t i, const Tensor& t) { return i == 0 ? t.expand({33, t.size(0)}) : t; };
    ExpectRunClose(RunOp(kFusedRotary, {row, cos, sin}, {true, false, false}, grad2, expand),
                   RunOp(kReferenceRotary, {row, cos, sin}, {true, false, false}, grad2, expand),
                   kRtol32, kAtol32, "rotary 2-d broadcast");
  }
}

TEST_F(FusedOpsGpuTest, RotaryLowPrecisionAndManyRowsMatchComposite) {
  auto [cos, sin] = RotaryTables(/*max_seq_len=*/4500, /*head_dim=*/16, 10000);
  cos = cos.to(torch::kCUDA);
  sin = sin.to(torch::kCUDA);
  // 2 * 8 * 4500 = 72000 rows.
  const Tensor x = Randn({2, 4500, 8, 16}), grad = Randn({2, 8, 4500, 16});
  ExpectRunClose(RunOp(kFusedRotary, {x, cos, sin}, {true, false, false}, grad, HeadsFirst),
                 RunOp(kReferenceRotary, {x, cos, sin}, {true, false, false}, grad, HeadsFirst),
                 kRtol32, kAtol32, "rotary 72000 rows");
  for (auto dtype : {torch::kBFloat16, torch::kFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    const Tensor xl = x.to(dtype), gradl = grad.to(dtype);
    const OpRun fused =
        RunOp(kFusedRotary, {xl, cos, sin}, {true, false, false}, gradl, HeadsFirst);
    ASSERT_EQ(fused.output.scalar_type(), dtype);
    ASSERT_EQ(fused.grads[0].scalar_type(), dtype);
    const OpRun reference = RunOp(kReferenceRotary, {xl.to(torch::kFloat32), cos, sin},
                                  {true, false, false}, gradl.to(torch::kFloat32), HeadsFirst);
    ExpectClose(fused.output.to(torch::kFloat32), reference.output, kRtolLow, kAtolLow, "output");
    ExpectClose(fused.grads[0].to(torch::kFloat32), reference.grads[0], kRtolLow, kAtolLow,
                "grad x");
  }
}

TEST_F(FusedOpsGpuTest, SwiGluMatchesComposite) {
  for (int64_t width : {1000, 4096, 5120, 77}) {
    SCOPED_TRACE(width);
    const Tensor gate = Randn({3, 7, width}) * 4, up = Randn({3, 7, width}),
                 grad = Randn({3, 7, width});
    const OpRun fused = RunOp(kFusedSwiGlu, {gate, up}, {true, true}, grad);
    EXPECT_THAT(fused.node, HasSubstr("SwiGluFunction"));
    ExpectRunClose(fused, RunOp(kReferenceSwiGlu, {gate, up}, {true, true}, grad), kRtol32, kAtol32,
                   "swiglu f32");
    for (auto dtype : {torch::kBFloat16, torch::kFloat16}) {
      SCOPED_TRACE(c10::toString(dtype));
      const Tensor gl = gate.to(dtype), ul = up.to(dtype), dl = grad.to(dtype);
      const OpRun low = RunOp(kFusedSwiGlu, {gl, ul}, {true, true}, dl);
      const OpRun reference =
          RunOp(kReferenceSwiGlu, {gl.to(torch::kFloat32), ul.to(torch::kFloat32)}, {true, true},
                dl.to(torch::kFloat32));
      ExpectClose(low.output.to(torch::kFloat32), reference.output, kRtolLow, kAtolLow, "output");
      ExpectClose(low.grads[0].to(torch::kFloat32), reference.grads[0], kRtolLow, kAtolLow,
                  "grad gate");
      ExpectClose(low.grads[1].to(torch::kFloat32), reference.grads[1], kRtolLow, kAtolLow,
                  "grad up");
    }
  }
  // Many elements, a transposed gate, and an up that takes no gradient.
  const Tensor gate = Randn({3, 70001}), up = Randn({70001, 3}), grad = Randn({70001, 3});
  auto transposed = [](size_t i, const Tensor& t) { return i == 0 ? t.t() : t; };
  const OpRun fused = RunOp(kFusedSwiGlu, {gate, up}, {true, false}, grad, transposed);
  EXPECT_FALSE(fused.grads[1].defined());
  ExpectRunClose(fused, RunOp(kReferenceSwiGlu, {gate, up}, {true, false}, grad, transposed),
                 kRtol32, kAtol32, "swiglu transposed");
  // Views one element into their storage: contiguous but not 16-byte aligned, so every element
  // takes the one-element kernel instead of the 16-byte packs (8 bf16, 4 float).
  auto shifted = [](size_t, const Tensor& t) { return t.narrow(0, 1, t.size(0) - 1); };
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    const Tensor g = (Randn({4097}) * 4).to(dtype), u = Randn({4097}).to(dtype),
                 d = Randn({4096}).to(dtype);
    const OpRun misaligned = RunOp(kFusedSwiGlu, {g, u}, {true, true}, d, shifted);
    EXPECT_THAT(misaligned.node, HasSubstr("SwiGluFunction"));
    const OpRun reference = RunOp(kReferenceSwiGlu, {g.to(torch::kFloat32), u.to(torch::kFloat32)},
                                  {true, true}, d.to(torch::kFloat32), shifted);
    const double rtol = dtype == torch::kFloat32 ? kRtol32 : kRtolLow;
    const double atol = dtype == torch::kFloat32 ? kAtol32 : kAtolLow;
    ExpectClose(misaligned.output.to(torch::kFloat32), reference.output, rtol, atol, "output");
    ExpectClose(misaligned.grads[0].to(torch::kFloat32), reference.grads[0], rtol, atol,
                "grad gate");
    ExpectClose(misaligned.grads[1].to(torch::kFloat32), reference.grads[1], rtol, atol, "grad up");
  }
}

// ResidualAdd's kernel is ATen's add bit for bit, forward and gradients (the residual's as it
// comes, the branch's cast to its dtype), for bf16, fp16 and float32 branches: over whole 16-byte
// packs and tails (sizes not a multiple of 8), the GPT-2 124M micro-batch's [16, 1024, 768], views
// one element into their storage (the one-element kernel), either input frozen, and without
// autograd. Broadcast, transposed and 16-bit residual operands run ATen's add itself.
TEST_F(FusedOpsGpuTest, ResidualAddIsAtenAddBitwise) {
  for (auto dtype : {torch::kBFloat16, torch::kFloat16, torch::kFloat32}) {
    SCOPED_TRACE(c10::toString(dtype));
    for (const std::vector<int64_t>& sizes :
         {std::vector<int64_t>{4, 768}, {7, 1001}, {1, 3}, {16, 1024, 768}}) {
      SCOPED_TRACE(::testing::PrintToString(sizes));
      const Tensor residual = Randn(sizes) * 100, branch = Randn(sizes, dtype);
      const Tensor grad = Randn(sizes);
      const OpRun fused = RunOp(kResidualAdd, {residual, branch}, {true, true}, grad);
      EXPECT_THAT(fused.node, HasSubstr("ResidualAddFunction"));
      ExpectIdentical(fused, RunOp(kAtenAdd, {residual, branch}, {true, true}, grad));
    }
    const Tensor residual = Randn({6 * 96 + 1}) * 100, branch = Randn({6 * 96 + 1}, dtype);
    const Tensor grad = Randn({6, 96});
    auto shifted = [](size_t, const Tensor& t) {
      return t.narrow(0, 1, t.size(0) - 1).view({6, 96});
    };
    for (const std::vector<bool>& differentiable :
         {std::vector<bool>{true, true}, {true, false}, {false, true}}) {
      SCOPED_TRACE(::testing::PrintToString(differentiable));
      const OpRun misaligned =
          RunOp(kResidualAdd, {residual, branch}, differentiable, grad, shifted);
      EXPECT_THAT(misaligned.node, HasSubstr("ResidualAddFunction"));
      ExpectIdentical(misaligned,
                      RunOp(kAtenAdd, {residual, branch}, differentiable, grad, shifted));
    }
    {
      torch::NoGradGuard no_grad;
      const Tensor r = Randn({5, 768}), b = Randn({5, 768}, dtype);
      const Tensor out = ResidualAdd(r, b);
      EXPECT_EQ(out.scalar_type(), torch::kFloat32);
      EXPECT_TRUE(torch::equal(out, r + b));
    }
    // Operands the kernel does not take: ATen's add, its node and its bits.
    const Tensor r = Randn({5, 64}), b = Randn({64, 5}, dtype), row = Randn({64}, dtype);
    const Tensor grad2 = Randn({5, 64});
    auto transposed = [](size_t i, const Tensor& t) { return i == 1 ? t.t() : t; };
    const OpRun strided = RunOp(kResidualAdd, {r, b}, {true, true}, grad2, transposed);
    EXPECT_THAT(strided.node, Not(HasSubstr("ResidualAddFunction")));
    ExpectIdentical(strided, RunOp(kAtenAdd, {r, b}, {true, true}, grad2, transposed));
    const OpRun broadcast = RunOp(kResidualAdd, {r, row}, {true, true}, grad2);
    EXPECT_THAT(broadcast.node, Not(HasSubstr("ResidualAddFunction")));
    ExpectIdentical(broadcast, RunOp(kAtenAdd, {r, row}, {true, true}, grad2));
    if (dtype != torch::kFloat32) {
      const Tensor low = r.to(dtype);
      const OpRun low_residual = RunOp(kResidualAdd, {low, low}, {true, true}, grad2.to(dtype));
      EXPECT_THAT(low_residual.node, Not(HasSubstr("ResidualAddFunction")));
      ExpectIdentical(low_residual, RunOp(kAtenAdd, {low, low}, {true, true}, grad2.to(dtype)));
    }
  }
  // Fused kernels off: ATen's add.
  const Tensor r = Randn({4, 768}), b = Randn({4, 768}, torch::kBFloat16), grad = Randn({4, 768});
  SetFusedKernelsEnabled(false);
  const OpRun off = RunOp(kResidualAdd, {r, b}, {true, true}, grad);
  SetFusedKernelsEnabled(true);
  EXPECT_THAT(off.node, Not(HasSubstr("ResidualAddFunction")));
  ExpectIdentical(off, RunOp(kAtenAdd, {r, b}, {true, true}, grad));
}

// A norm keeping its input adds the residual connection's gradient to x's in its backward
// kernel: bit for bit the gradients of x used twice (autograd's add), at widths of the row
// kernels (one warp a row, a whole block a row) and of the block kernels, float32 and bf16 x, a
// float32 x normalised into bf16 (the model under autocast), both paths or either alone, the
// weight (and bias) frozen or not.
TEST_F(FusedOpsGpuTest, NormKeepingItsInputAddsTheResidualGradientBitwise) {
  for (int64_t hidden : {768, 1024, 4096, 77}) {
    for (bool rms : {true, false}) {
      for (auto [x_dtype, out_dtype] : {std::pair<torch::ScalarType, std::optional<at::ScalarType>>{
                                            torch::kFloat32, std::nullopt},
                                        {torch::kFloat32, at::kBFloat16},
                                        {torch::kBFloat16, std::nullopt}}) {
        const Tensor x = Randn({4, 33, hidden}, x_dtype) * 2, w = Randn({hidden});
        const Tensor b = Randn({hidden}), grad = Randn({4, 33, hidden});
        const std::vector<Tensor> inputs = rms ? std::vector<Tensor>{x, w} : std::vector{x, w, b};
        for (int uses : {3, 1, 2}) {
          for (bool parameter_grads : {true, false}) {
            SCOPED_TRACE(::testing::Message()
                         << "hidden " << hidden << (rms ? " rms " : " layer ")
                         << c10::toString(x_dtype) << " out "
                         << (out_dtype ? c10::toString(*out_dtype) : "x's") << " uses " << uses
                         << " parameter grads " << parameter_grads);
            const std::vector<bool> differentiable(inputs.size(), parameter_grads);
            std::vector<bool> with_x = differentiable;
            with_x[0] = true;
            const Tensor g = uses == 2 && out_dtype ? grad.to(*out_dtype) : grad.to(x_dtype);
            ExpectIdentical(RunOp(NormResidualOp(rms, true, out_dtype, uses), inputs, with_x, g),
                            RunOp(NormResidualOp(rms, false, out_dtype, uses), inputs, with_x, g));
          }
        }
        const NormAndInput kept =
            rms ? FusedRmsNormKeepingInput(x.requires_grad_(), w, 1e-6, out_dtype)
                : FusedLayerNormKeepingInput(x.requires_grad_(), w, b, 1e-5, out_dtype);
        EXPECT_EQ(kept.x_kept.data_ptr(), x.data_ptr());
        EXPECT_THAT(KeptInputNode(kept), HasSubstr("NormFunction"));
        x.requires_grad_(false);
      }
    }
  }
}

TEST_F(FusedOpsGpuTest, EmptyInputsGiveEmptyResultsAndZeroWeightGradient) {
  const Tensor x = Randn({0, 64}), w = Randn({64}), grad = Randn({0, 64});
  const OpRun norm = RunOp(kFusedRmsNorm, {x, w}, {true, true}, grad);
  EXPECT_EQ(norm.output.sizes(), x.sizes());
  EXPECT_EQ(norm.grads[0].sizes(), x.sizes());
  EXPECT_TRUE(torch::equal(norm.grads[1], torch::zeros_like(w)));
  const OpRun layer = RunOp(kFusedLayerNorm, {x, w, w}, {true, true, true}, grad);
  EXPECT_EQ(layer.output.sizes(), x.sizes());
  EXPECT_TRUE(torch::equal(layer.grads[1], torch::zeros_like(w)));
  EXPECT_TRUE(torch::equal(layer.grads[2], torch::zeros_like(w)));
  auto [cos, sin] = RotaryTables(/*max_seq_len=*/4, /*head_dim=*/8, 10000);
  const Tensor q = Randn({0, 4, 2, 8});
  const OpRun rotary = RunOp(kFusedRotary, {q, cos.to(torch::kCUDA), sin.to(torch::kCUDA)},
                             {true, false, false}, Randn({0, 2, 4, 8}), HeadsFirst);
  EXPECT_EQ(rotary.output.sizes(), (std::vector<int64_t>{0, 2, 4, 8}));
  const Tensor gate = Randn({2, 0}), up = Randn({2, 0});
  const OpRun swiglu = RunOp(kFusedSwiGlu, {gate, up}, {true, true}, Randn({2, 0}));
  EXPECT_EQ(swiglu.output.sizes(), gate.sizes());
  EXPECT_EQ(swiglu.grads[0].sizes(), gate.sizes());
}

TEST_F(FusedOpsGpuTest, SwitchedOffRunsTheCompositeBitwise) {
  const Tensor x = Randn({6, 96}), w = Randn({96}), grad = Randn({6, 96});
  SetFusedKernelsEnabled(false);
  const OpRun off = RunOp(kFusedRmsNorm, {x, w}, {true, true}, grad);
  SetFusedKernelsEnabled(true);
  EXPECT_THAT(off.node, Not(HasSubstr("NormFunction")));
  ExpectEqual(off, RunOp(kReferenceRmsNorm, {x, w}, {true, true}, grad));
}

// Qwen3-shaped (RMSNorm, q/k norms, rotary, SwiGLU) under bf16 autocast, with selective
// checkpointing (SwiGLU recomputed): loss and gradients with the kernels on track those off. bf16
// rounds the two computations' activations differently (the kernels round once, the composite
// after each op): close in norm, not equal.
TEST_F(FusedOpsGpuTest, ModelTracksTheCompositeUnderAutocast) {
  const v1::ModelDims dims = testing::TinyQwenDims(/*ffn_hidden_size=*/160, /*seq_len=*/48);
  const Tensor tokens = torch::randint(257, {2, 49}, torch::kLong).to(torch::kCUDA);
  ExpectModelTracksTheComposite(dims, tokens, /*autocast=*/true, /*loss_tolerance=*/1e-2,
                                /*grad_tolerance=*/1e-1);
}

// GPT-2-shaped (LayerNorm with bias, fused qkv, GELU) likewise.
TEST_F(FusedOpsGpuTest, Gpt2TracksTheCompositeUnderAutocast) {
  const v1::ModelDims dims = testing::PresetDims("tiny-gpt2");
  const Tensor tokens = torch::randint(dims.vocab_size(), {2, 33}, torch::kLong).to(torch::kCUDA);
  ExpectModelTracksTheComposite(dims, tokens, /*autocast=*/true, /*loss_tolerance=*/1e-2,
                                /*grad_tolerance=*/1e-1);
}

}  // namespace
}  // namespace tessera::trainer

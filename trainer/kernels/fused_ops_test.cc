// FusedRmsNorm, FusedLayerNorm, FusedRotary and FusedSwiGlu against ATen's composite (as the model
// ran it before the fused kernels), and ResidualAdd against ATen's add, on the CPU (the fallback):
// bitwise, forward and gradients, and the norms' output in autocast's dtype as the cast of their
// result; FusedGeluTanh's CPU kernel against GELU in float64 and ATen's float32 GELU, over sizes
// around the vector width and the per-thread split, extreme inputs, views, one or two threads,
// and a GPT-2-shaped model with the kernel on and off. fused_ops_gpu_test.cc has the CUDA side.
#include "trainer/kernels/fused_ops.h"

#include <ATen/autocast_mode.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <numbers>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/model_config.h"
#include "trainer/kernels/device.h"
#include "trainer/kernels/fused_ops_cpu.h"
#include "trainer/kernels/fused_ops_fixture.h"
#include "trainer/model/model.h"
#include "trainer/model/model_dims_fixture.h"

namespace tessera::trainer {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// ---- CPU: the fallback is the composite, bit for bit. ----

// float32: the CPU kernel, to float32 rounding of the composite; bfloat16: the composite itself.
TEST(FusedOpsCpuTest, RmsNormFloat32IsTheKernelOtherDtypesTheComposite) {
  torch::manual_seed(1);
  // Widths around the 16-lane vector and more rows than one 64-row block of the weight gradient.
  for (int64_t hidden : {37, 64, 384}) {
    SCOPED_TRACE(hidden);
    const Tensor x = torch::randn({3, 50, hidden}) * 2, w = torch::randn({hidden});
    const Tensor grad = torch::randn({3, 50, hidden});
    const OpRun fused = RunOp(kFusedRmsNorm, {x, w}, {true, true}, grad);
    EXPECT_THAT(fused.node, HasSubstr("RmsNormCpuFunction"));
    ExpectRunClose(fused, RunOp(kReferenceRmsNorm, {x, w}, {true, true}, grad), 1e-5, 1e-6,
                   "float32");
  }
  const Tensor x = torch::randn({3, 5, 37}).to(torch::kBFloat16), w = torch::randn({37});
  const Tensor grad = torch::randn({3, 5, 37}).to(torch::kBFloat16);
  const OpRun composite = RunOp(kFusedRmsNorm, {x, w}, {true, true}, grad);
  ExpectEqual(composite, RunOp(kReferenceRmsNorm, {x, w}, {true, true}, grad));
  EXPECT_THAT(composite.node, Not(HasSubstr("RmsNormCpuFunction")));
}

TEST(FusedOpsCpuTest, RmsNormFrozenWeightViewsThreadsAndTheSwitch) {
  torch::manual_seed(11);
  const Tensor x = torch::randn({300, 96}), w = torch::randn({96}), grad = torch::randn({300, 96});
  const auto transpose = [](size_t input, const Tensor& t) { return input == 0 ? t.t() : t; };
  // x as a transposed view; the weight frozen (LoRA): no gradient computed for it.
  const Tensor xt = x.t().contiguous();
  const OpRun frozen = RunOp(kFusedRmsNorm, {xt, w}, {true, false}, grad, transpose);
  EXPECT_FALSE(frozen.grads[1].defined());
  ExpectRunClose(frozen, RunOp(kReferenceRmsNorm, {xt, w}, {true, false}, grad, transpose), 1e-5,
                 1e-6, "frozen weight, view");
  // The weight's gradient sums fixed blocks of rows: one thread and two give the same bits.
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const OpRun one = RunOp(kFusedRmsNorm, {x, w}, {true, true}, grad);
  at::set_num_threads(2);
  const OpRun two = RunOp(kFusedRmsNorm, {x, w}, {true, true}, grad);
  at::set_num_threads(threads);
  ExpectEqual(two, one);
  SetFusedKernelsEnabled(false);
  const OpRun off = RunOp(kFusedRmsNorm, {x, w}, {true, true}, grad);
  SetFusedKernelsEnabled(true);
  ExpectEqual(off, RunOp(kReferenceRmsNorm, {x, w}, {true, true}, grad));
}

TEST(FusedOpsCpuTest, LayerNormIsTheCompositeBitwise) {
  // No CPU kernel: ATen's layer_norm, with and without a bias, fused kernels on or off.
  const Tensor x = torch::randn({3, 7, 40}), w = torch::randn({40}), b = torch::randn({40});
  const Tensor grad = torch::randn({3, 7, 40});
  for (bool fused : {true, false}) {
    SetFusedKernelsEnabled(fused);
    ExpectEqual(RunOp(kFusedLayerNorm, {x, w, b}, {true, true, true}, grad),
                RunOp(kReferenceLayerNorm, {x, w, b}, {true, true, true}, grad));
    ExpectEqual(RunOp(kFusedLayerNorm, {x, w}, {true, true}, grad),
                RunOp(kReferenceLayerNorm, {x, w}, {true, true}, grad));
  }
  SetFusedKernelsEnabled(true);
}

// A Norm made with autocast_output returns, for a float32 input under autocast, autocast's dtype
// with exactly the values of casting its float32 result, and the same gradients as the cast
// would pass back; without autocast (or without autocast_output) it is unchanged.
TEST(FusedOpsCpuTest, NormsWithAutocastOutputAreTheCastOfTheFloat32Result) {
  for (bool rms : {true, false}) {
    SCOPED_TRACE(rms ? "rms" : "layer");
    torch::manual_seed(3);
    Norm plain(48, 1e-5, rms), into(48, 1e-5, rms, /*autocast_output=*/true);
    {
      torch::NoGradGuard no_grad;
      for (const Tensor& p : plain->parameters()) p.normal_();
      auto from = plain->parameters();
      auto to = into->parameters();
      for (size_t i = 0; i < from.size(); ++i) to[i].copy_(from[i]);
    }
    const Tensor x = torch::randn({5, 48});
    EXPECT_TRUE(torch::equal(into->forward(x), plain->forward(x)));  // autocast off
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::autocast::set_autocast_enabled(at::kCPU, true);
    const Tensor xa = x.clone().requires_grad_(true), xb = x.clone().requires_grad_(true);
    const Tensor out = into->forward(xa);
    const Tensor expected = plain->forward(xb).to(at::kBFloat16);
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
    ASSERT_EQ(out.scalar_type(), at::kBFloat16);
    EXPECT_TRUE(torch::equal(out, expected));
    const Tensor grad = torch::randn({5, 48}).to(at::kBFloat16);
    out.backward(grad);
    expected.backward(grad);
    EXPECT_TRUE(torch::equal(xa.grad(), xb.grad()));
    EXPECT_TRUE(torch::equal(into->parameters()[0].grad(), plain->parameters()[0].grad()));
  }
}

// The CPU rotary kernel rounds each product and sum as the composite does: the same bits
// forward and backward, on the model's transposed layout, contiguous and odd-strided inputs, 2-D
// to 4-D shapes, head sizes down to 2, with and without autograd, on one thread or two; other
// dtypes run the composite.
TEST(FusedOpsCpuTest, RotaryFloat32IsTheKernelAndTheCompositeBitwise) {
  torch::manual_seed(2);
  for (int64_t head_dim : {64, 16, 2, 130}) {
    SCOPED_TRACE(head_dim);
    auto [cos, sin] = RotaryTables(/*max_seq_len=*/9, head_dim, 10000);
    for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
      SCOPED_TRACE(c10::toString(dtype));
      const Tensor x = (torch::randn({2, 9, 3, head_dim}) * 5).to(dtype);
      const Tensor grad = torch::randn({2, 3, 9, head_dim}).to(dtype);
      const OpRun fused =
          RunOp(kFusedRotary, {x, cos, sin}, {true, false, false}, grad, HeadsFirst);
      ExpectEqual(fused,
                  RunOp(kReferenceRotary, {x, cos, sin}, {true, false, false}, grad, HeadsFirst));
      if (dtype == torch::kFloat32) {
        EXPECT_THAT(fused.node, HasSubstr("RotaryFunction"));
      } else {
        EXPECT_THAT(fused.node, Not(HasSubstr("Rotary")));
      }
    }
  }
  auto [cos, sin] = RotaryTables(/*max_seq_len=*/40, /*head_dim=*/32, 10000);
  // Contiguous 4-D, 3-D and 2-D inputs; a last dimension that is not contiguous; two threads
  // against one (enough rows for a split).
  for (const std::vector<int64_t>& sizes :
       std::vector<std::vector<int64_t>>{{4, 6, 40, 32}, {6, 40, 32}, {40, 32}}) {
    const Tensor x = torch::randn(sizes), grad = torch::randn(sizes);
    ExpectEqual(RunOp(kFusedRotary, {x, cos, sin}, {true, false, false}, grad),
                RunOp(kReferenceRotary, {x, cos, sin}, {true, false, false}, grad));
  }
  const Tensor wide = torch::randn({5, 40, 64}), grad = torch::randn({5, 40, 32});
  auto strided = [](size_t i, const Tensor& t) {
    return i == 0 ? t.slice(/*dim=*/2, 0, 64, /*step=*/2) : t;
  };
  ExpectEqual(RunOp(kFusedRotary, {wide, cos, sin}, {true, false, false}, grad, strided),
              RunOp(kReferenceRotary, {wide, cos, sin}, {true, false, false}, grad, strided));
  const Tensor big = torch::randn({8, 40, 6, 32}), big_grad = torch::randn({8, 6, 40, 32});
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const OpRun one =
      RunOp(kFusedRotary, {big, cos, sin}, {true, false, false}, big_grad, HeadsFirst);
  at::set_num_threads(2);
  const OpRun two =
      RunOp(kFusedRotary, {big, cos, sin}, {true, false, false}, big_grad, HeadsFirst);
  at::set_num_threads(threads);
  ExpectEqual(one, two);
  ExpectEqual(two,
              RunOp(kReferenceRotary, {big, cos, sin}, {true, false, false}, big_grad, HeadsFirst));
  // Without autograd (inference, or recomputation under no_grad) the kernel runs alone.
  {
    torch::NoGradGuard no_grad;
    const Tensor q = big.transpose(1, 2);
    EXPECT_TRUE(torch::equal(FusedRotary(q, cos, sin), ReferenceRotary(q, cos, sin)));
  }
  // Switched off: the composite.
  SetFusedKernelsEnabled(false);
  const OpRun off =
      RunOp(kFusedRotary, {big, cos, sin}, {true, false, false}, big_grad, HeadsFirst);
  SetFusedKernelsEnabled(true);
  EXPECT_THAT(off.node, Not(HasSubstr("Rotary")));
}

// SplitQkv's views are unbind's, and its one-pass gradient is the stacked-and-reordered one bit
// for bit, with all three views used, or only some (the others count as zero gradients).
TEST(FusedOpsCpuTest, SplitQkvIsUnbindWithAOnePassGradient) {
  torch::manual_seed(4);
  const int64_t batch = 2, seq = 5, heads = 3, head_dim = 4;
  auto unbind = [&](const Tensor& qkv) {
    return qkv.view({batch, seq, 3, heads, head_dim}).permute({2, 0, 3, 1, 4}).unbind(0);
  };
  const Tensor value = torch::randn({batch, seq, 3 * heads * head_dim});
  const std::vector<Tensor> grads = {torch::randn({batch, heads, seq, head_dim}),
                                     torch::randn({batch, heads, seq, head_dim}),
                                     torch::randn({batch, heads, seq, head_dim})};
  for (const std::vector<bool>& used : std::vector<std::vector<bool>>{
           {true, true, true}, {true, false, true}, {false, true, false}}) {
    std::vector<Tensor> results;
    for (bool fused : {true, false}) {
      SetFusedKernelsEnabled(fused);
      const Tensor qkv = value.clone().requires_grad_(true);
      const std::vector<Tensor> parts = SplitQkv(qkv, heads, head_dim);
      SetFusedKernelsEnabled(true);
      ASSERT_EQ(parts.size(), 3u);
      const std::vector<Tensor> expected = unbind(value);
      Tensor loss = torch::zeros({});
      for (int i = 0; i < 3; ++i) {
        EXPECT_TRUE(torch::equal(parts[i], expected[i])) << i;
        if (fused) {
          EXPECT_THAT(parts[i].grad_fn()->name(), HasSubstr("SplitQkvFunction"));
        }
        if (used[i]) loss = loss + (parts[i] * grads[i]).sum();
      }
      loss.backward();
      results.push_back(qkv.grad());
    }
    EXPECT_TRUE(torch::equal(results[0], results[1]));
  }
  // Without autograd: plain views.
  const std::vector<Tensor> plain = SplitQkv(value, heads, head_dim);
  EXPECT_TRUE(torch::equal(plain[1], unbind(value)[1]));
  EXPECT_THROW(SplitQkv(value, heads + 1, head_dim), c10::Error);
}

TEST(FusedOpsCpuTest, SwiGluFloat32IsTheKernelOtherDtypesTheComposite) {
  torch::manual_seed(3);
  const Tensor gate = torch::randn({4, 7, 33}) * 4, up = torch::randn({4, 7, 33});
  const Tensor grad = torch::randn({4, 7, 33});
  const OpRun fused = RunOp(kFusedSwiGlu, {gate, up}, {true, true}, grad);
  EXPECT_THAT(fused.node, HasSubstr("SwiGluFunction"));
  ExpectRunClose(fused, RunOp(kReferenceSwiGlu, {gate, up}, {true, true}, grad), 1e-5, 1e-6,
                 "float32");
  // Only one input taking a gradient.
  const OpRun frozen_up = RunOp(kFusedSwiGlu, {gate, up}, {true, false}, grad);
  EXPECT_FALSE(frozen_up.grads[1].defined());
  ExpectRunClose(frozen_up, RunOp(kReferenceSwiGlu, {gate, up}, {true, false}, grad), 1e-5, 1e-6,
                 "frozen up");
  const Tensor gate16 = gate.to(torch::kBFloat16), up16 = up.to(torch::kBFloat16);
  const OpRun composite =
      RunOp(kFusedSwiGlu, {gate16, up16}, {true, true}, grad.to(torch::kBFloat16));
  ExpectEqual(composite,
              RunOp(kReferenceSwiGlu, {gate16, up16}, {true, true}, grad.to(torch::kBFloat16)));
  EXPECT_THAT(composite.node, Not(HasSubstr("SwiGluFunction")));
  SetFusedKernelsEnabled(false);
  const OpRun off = RunOp(kFusedSwiGlu, {gate, up}, {true, true}, grad);
  SetFusedKernelsEnabled(true);
  ExpectEqual(off, RunOp(kReferenceSwiGlu, {gate, up}, {true, true}, grad));
}

// No CPU kernel: ResidualAdd is residual + branch itself, forward and gradients, for a float32 or
// 16-bit branch, with either input frozen.
TEST(FusedOpsCpuTest, ResidualAddIsAtenAddBitwise) {
  torch::manual_seed(5);
  for (auto dtype : {torch::kBFloat16, torch::kFloat16, torch::kFloat32}) {
    SCOPED_TRACE(c10::toString(dtype));
    const Tensor residual = torch::randn({3, 7, 40}) * 100;
    const Tensor branch = torch::randn({3, 7, 40}).to(dtype), grad = torch::randn({3, 7, 40});
    for (const std::vector<bool>& differentiable :
         {std::vector<bool>{true, true}, {true, false}, {false, true}}) {
      const OpRun fused = RunOp(kResidualAdd, {residual, branch}, differentiable, grad);
      EXPECT_THAT(fused.node, Not(HasSubstr("ResidualAddFunction")));
      ExpectIdentical(fused, RunOp(kAtenAdd, {residual, branch}, differentiable, grad));
    }
  }
}

// The CPU RMSNorm kernel adds the residual connection's gradient to x's in its own backward:
// the same output and gradients, bit for bit, as autograd adding the two (x used twice), through
// both paths or either alone, with the weight frozen or not. The kept input is x's storage, not
// a copy. LayerNorm, other dtypes and the switch off keep x itself.
TEST(FusedOpsCpuTest, NormKeepingItsInputAddsTheResidualGradientBitwise) {
  torch::manual_seed(12);
  for (int64_t hidden : {64, 37}) {
    const Tensor x = torch::randn({3, 9, hidden}) * 2, w = torch::randn({hidden});
    const Tensor grad = torch::randn({3, 9, hidden});
    for (int uses : {3, 1, 2}) {
      for (bool weight_grad : {true, false}) {
        SCOPED_TRACE(::testing::Message()
                     << "hidden " << hidden << " uses " << uses << " weight_grad " << weight_grad);
        const OpRun kept = RunOp(NormResidualOp(/*rms=*/true, /*keep=*/true, std::nullopt, uses),
                                 {x, w}, {true, weight_grad}, grad);
        ExpectIdentical(kept, RunOp(NormResidualOp(true, false, std::nullopt, uses), {x, w},
                                    {true, weight_grad}, grad));
      }
    }
  }
  const Tensor x = torch::randn({4, 16}).requires_grad_(), w = torch::randn({16});
  const NormAndInput rms = FusedRmsNormKeepingInput(x, w, 1e-6);
  EXPECT_EQ(rms.x_kept.data_ptr(), x.data_ptr());
  EXPECT_THAT(KeptInputNode(rms), HasSubstr("RmsNormCpuFunction"));
  EXPECT_TRUE(torch::equal(rms.y, FusedRmsNorm(x, w, 1e-6)));
  EXPECT_TRUE(FusedLayerNormKeepingInput(x, w, torch::randn({16}), 1e-5).x_kept.is_same(x));
  const Tensor x64 = x.detach().to(torch::kFloat64).requires_grad_();
  EXPECT_TRUE(FusedRmsNormKeepingInput(x64, w, 1e-6).x_kept.is_same(x64));
  SetFusedKernelsEnabled(false);
  const NormAndInput off = FusedRmsNormKeepingInput(x, w, 1e-6);
  SetFusedKernelsEnabled(true);
  EXPECT_TRUE(off.x_kept.is_same(x));
  ExpectIdentical(RunOp(NormResidualOp(true, true, std::nullopt), {x.detach(), w}, {true, true},
                        torch::ones({4, 16})),
                  RunOp(NormResidualOp(true, false, std::nullopt), {x.detach(), w}, {true, true},
                        torch::ones({4, 16})));
}

TEST(FusedOpsCpuTest, SwitchRoundTrips) {
  ASSERT_TRUE(FusedKernelsEnabled());
  SetFusedKernelsEnabled(false);
  EXPECT_FALSE(FusedKernelsEnabled());
  SetFusedKernelsEnabled(true);
  EXPECT_TRUE(FusedKernelsEnabled());
}

// ---- CPU: the GELU kernel. ----

const Op kFusedGelu = [](const std::vector<Tensor>& in) { return FusedGeluTanh(in[0]); };
const Op kAtenGelu = [](const std::vector<Tensor>& in) { return torch::gelu(in[0], "tanh"); };

// Normal values spread over GELU's whole shape, with zeros, tiny and huge magnitudes, and the
// points where its exponential saturates, at the front.
Tensor GeluInputs(int64_t n) {
  Tensor x = torch::randn({n}) * 4;
  const std::vector<float> edges = {0.0f, -0.0f, 1e-30f, -1e-30f, 1e-7f, -3.0f, 3.0f, -6.0f,
                                    6.0f, -9.5f, 9.5f,   -30.0f,  30.0f, -1e4f, 1e4f};
  for (size_t i = 0; i < edges.size() && static_cast<int64_t>(i) < n; ++i) x[i] = edges[i];
  return x;
}

TEST(FusedOpsCpuTest, GeluMatchesFloat64AndAten) {
  torch::manual_seed(4);
  // Around one 16-lane vector, and past the 32768-element task so that two threads share it.
  for (int64_t n : {1, 15, 16, 17, 33, 1000, 32768 * 2 + 5, 200003}) {
    SCOPED_TRACE(n);
    const Tensor x = GeluInputs(n), grad = torch::randn({n});
    const OpRun fused = RunOp(kFusedGelu, {x}, {true}, grad);
    EXPECT_THAT(fused.node, HasSubstr("GeluTanhCpuFunction"));
    const OpRun aten = RunOp(kAtenGelu, {x}, {true}, grad);
    // Against the float64 definition the kernel is within a few float32 ulps (plus an absolute
    // term for the results that are near 0 where the function is), as ATen's own GELU is.
    ExpectClose(fused.output, ReferenceGelu64(x).to(torch::kFloat32), 4e-6, 1e-7, "forward");
    ExpectClose(fused.grads[0],
                (grad.to(torch::kFloat64) * ReferenceGeluDerivative64(x)).to(torch::kFloat32), 4e-6,
                1e-7, "backward");
    ExpectRunClose(fused, aten, 1e-5, 1e-6, "against ATen");
  }
}

TEST(FusedOpsCpuTest, GeluTakesViewsAndDoesNotNeedGrad) {
  torch::manual_seed(5);
  const Tensor base = torch::randn({37, 29}) * 3, grad = torch::randn({29, 37});
  const auto transpose = [](size_t, const Tensor& t) { return t.t(); };
  const OpRun fused = RunOp(kFusedGelu, {base}, {true}, grad, transpose);
  ExpectRunClose(fused, RunOp(kAtenGelu, {base}, {true}, grad, transpose), 1e-5, 1e-6, "view");
  EXPECT_EQ(fused.output.sizes(), (std::vector<int64_t>{29, 37}));
  // Without autograd: the same values, and no graph.
  torch::NoGradGuard no_grad;
  const Tensor plain = FusedGeluTanh(base.t());
  EXPECT_FALSE(plain.requires_grad());
  EXPECT_TRUE(torch::equal(plain, fused.output));
}

TEST(FusedOpsCpuTest, GeluIsTheSameOnOneThreadAsOnTwo) {
  torch::manual_seed(6);
  const Tensor x = GeluInputs(150001), grad = torch::randn({150001});
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const OpRun one = RunOp(kFusedGelu, {x}, {true}, grad);
  at::set_num_threads(2);
  const OpRun two = RunOp(kFusedGelu, {x}, {true}, grad);
  at::set_num_threads(threads);
  ExpectEqual(two, one);
}

// Every instruction set's variant that this CPU runs is as accurate as the baseline, forward
// and backward, at sizes around the 16-lane vector (the padded tail); the FMA variants round
// differently, so they agree with it to float32 rounding, not bitwise.
TEST(FusedOpsCpuTest, GeluVariantsAgree) {
  const std::vector<cpu_kernels::Isa> isas = cpu_kernels::SupportedIsas();
  ASSERT_FALSE(isas.empty());
  EXPECT_EQ(isas.front(), cpu_kernels::Isa::kBaseline);
  EXPECT_THAT(isas, ::testing::Contains(cpu_kernels::BestIsa()));
  torch::manual_seed(10);
  for (int64_t n : {1, 7, 16, 31, 4099}) {
    SCOPED_TRACE(n);
    const Tensor x = GeluInputs(n), grad = torch::randn({n});
    std::vector<Tensor> forward, backward;
    for (cpu_kernels::Isa isa : isas) {
      Tensor y = torch::empty({n}), gx = torch::empty({n});
      cpu_kernels::GeluTanhForward(x.data_ptr<float>(), y.data_ptr<float>(), n, isa);
      cpu_kernels::GeluTanhBackward(grad.data_ptr<float>(), x.data_ptr<float>(),
                                    gx.data_ptr<float>(), n, isa);
      forward.push_back(y);
      backward.push_back(gx);
    }
    const Tensor expected_backward =
        (grad.to(torch::kFloat64) * ReferenceGeluDerivative64(x)).to(torch::kFloat32);
    for (size_t i = 0; i < isas.size(); ++i) {
      SCOPED_TRACE(static_cast<int>(isas[i]));
      ExpectClose(forward[i], ReferenceGelu64(x).to(torch::kFloat32), 4e-6, 1e-7, "forward");
      ExpectClose(backward[i], expected_backward, 4e-6, 1e-7, "backward");
      ExpectClose(forward[i], forward[0], 4e-6, 1e-7, "forward against the baseline");
      ExpectClose(backward[i], backward[0], 4e-6, 1e-7, "backward against the baseline");
    }
  }
}

// The same for SwiGLU and RMSNorm: every variant this CPU runs agrees with the baseline's.
TEST(FusedOpsCpuTest, SwiGluAndRmsNormVariantsAgree) {
  const std::vector<cpu_kernels::Isa> isas = cpu_kernels::SupportedIsas();
  torch::manual_seed(12);
  for (int64_t hidden : {5, 16, 100}) {
    SCOPED_TRACE(hidden);
    const int64_t rows = 70, n = rows * hidden;
    const Tensor a = torch::randn({rows, hidden}) * 3, b = torch::randn({rows, hidden});
    const Tensor w = torch::randn({hidden}), grad = torch::randn({rows, hidden});
    std::vector<std::vector<Tensor>> outputs;
    for (cpu_kernels::Isa isa : isas) {
      auto& out = outputs.emplace_back();
      for (int k = 0; k < 6; ++k) out.push_back(torch::empty({rows, hidden}));
      Tensor rstd = torch::empty({rows}), grad_w = torch::empty({hidden});
      cpu_kernels::SwiGluForward(a.data_ptr<float>(), b.data_ptr<float>(), out[0].data_ptr<float>(),
                                 n, isa);
      cpu_kernels::SwiGluBackward(grad.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(),
                                  out[1].data_ptr<float>(), out[2].data_ptr<float>(), n, isa);
      cpu_kernels::RmsNormForward(a.data_ptr<float>(), w.data_ptr<float>(),
                                  out[3].data_ptr<float>(), rstd.data_ptr<float>(), rows, hidden,
                                  1e-6f, isa);
      cpu_kernels::RmsNormBackward(grad.data_ptr<float>(), a.data_ptr<float>(), w.data_ptr<float>(),
                                   rstd.data_ptr<float>(), out[4].data_ptr<float>(),
                                   grad_w.data_ptr<float>(), rows, hidden, isa);
      out[5] = grad_w;
    }
    // The baseline against the composite, then every variant against the baseline.
    ExpectClose(outputs[0][0], ReferenceSwiGlu(a, b), 1e-5, 1e-6, "swiglu");
    ExpectClose(outputs[0][3], ReferenceRmsNorm(a, w, 1e-6), 1e-5, 1e-6, "rms_norm");
    for (size_t i = 1; i < isas.size(); ++i) {
      SCOPED_TRACE(static_cast<int>(isas[i]));
      for (size_t k = 0; k < outputs[i].size(); ++k) {
        ExpectClose(outputs[i][k], outputs[0][k], 1e-5, 1e-6, "output " + std::to_string(k));
      }
    }
  }
}

TEST(FusedOpsCpuTest, GeluSwitchedOffOrNotFloat32IsAtenBitwise) {
  torch::manual_seed(7);
  const Tensor x = torch::randn({5, 41}), grad = torch::randn({5, 41});
  SetFusedKernelsEnabled(false);
  const OpRun off = RunOp(kFusedGelu, {x}, {true}, grad);
  SetFusedKernelsEnabled(true);
  EXPECT_THAT(off.node, Not(HasSubstr("GeluTanhCpuFunction")));
  ExpectEqual(off, RunOp(kAtenGelu, {x}, {true}, grad));
  for (auto dtype : {torch::kBFloat16, torch::kFloat64}) {
    SCOPED_TRACE(c10::toString(dtype));
    const OpRun other = RunOp(kFusedGelu, {x.to(dtype)}, {true}, grad.to(dtype));
    EXPECT_THAT(other.node, Not(HasSubstr("GeluTanhCpuFunction")));
    ExpectEqual(other, RunOp(kAtenGelu, {x.to(dtype)}, {true}, grad.to(dtype)));
  }
}

// GPT-2-shaped (GELU) and Qwen3-shaped (RMSNorm with q/k norms, SwiGLU), with and without
// selective checkpointing (the activation recomputed): loss and gradients with the CPU kernels
// track those with ATen's ops to float32 rounding.
TEST(FusedOpsCpuTest, ModelsTrackAtenOps) {
  for (const v1::ModelDims& dims :
       {testing::PresetDims("tiny-gpt2"), testing::TinyQwenDims(/*ffn_hidden_size=*/160)}) {
    SCOPED_TRACE(dims.ShortDebugString());
    ASSERT_GT(dims.num_layers(), 0);
    torch::manual_seed(8);
    const Tensor tokens = torch::randint(dims.vocab_size(), {2, 17}, torch::kLong);
    ExpectModelTracksTheComposite(dims, tokens, /*autocast=*/false, /*loss_tolerance=*/1e-4,
                                  /*grad_tolerance=*/1e-4);
  }
}

}  // namespace
}  // namespace tessera::trainer

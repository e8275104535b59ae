// FusedRmsNorm, FusedLayerNorm, FusedRotary and FusedSwiGlu against ATen's composite, which is
// copied here as the model ran it before the fused kernels, and ResidualAdd against ATen's add:
// on the CPU (the fallback) bitwise, forward and gradients, and the norms' output in autocast's
// dtype as the cast of their result; FusedGeluTanh's CPU kernel against GELU in float64 and
// ATen's float32 GELU, over sizes around the vector width and the per-thread split, extreme
// inputs, views, one or two threads, and a GPT-2-shaped model with the kernel on and off;
// on a GPU (when there is one) the CUDA kernels' forward and every gradient against the composite
// on the same GPU, float32 to float32 rounding and bfloat16 / float16 against the float32 composite
// of the same (rounded) inputs, over odd sizes, non-contiguous and misaligned inputs, widths of
// both norm implementations, more than 65535 rows and empty inputs, the norms straight into
// 16-bit dtypes, the norms' gradients run to run and ResidualAdd bit for bit; and Qwen3- and
// GPT-2-shaped models' loss and gradients under autocast with the kernels on and off.
#include "trainer/fused_ops.h"

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
#include "trainer/device.h"
#include "trainer/fused_ops_cpu.h"
#include "trainer/model.h"
#include "trainer/test_model_dims.h"

namespace tessera::trainer {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using Tensor = torch::Tensor;

// ---- The composite, as model.cc had it. ----

Tensor ReferenceRotateHalf(const Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

Tensor ReferenceRotary(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  Tensor x32 = x.to(torch::kFloat32);
  return (x32 * cos + ReferenceRotateHalf(x32) * sin).to(x.scalar_type());
}

Tensor ReferenceRmsNorm(const Tensor& x, const Tensor& weight, double eps) {
  Tensor x32 = x.to(torch::kFloat32);
  Tensor normed = x32 * torch::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return (normed * weight.to(torch::kFloat32)).to(x.scalar_type());
}

Tensor ReferenceLayerNorm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  return at::layer_norm(x.to(torch::kFloat32), {weight.size(0)}, weight, bias, eps)
      .to(x.scalar_type());
}

Tensor ReferenceSwiGlu(const Tensor& gate, const Tensor& up) { return torch::silu(gate) * up; }

// GELU (tanh) and its derivative in float64, from its definition.
Tensor ReferenceGelu64(const Tensor& x) {
  const Tensor x64 = x.to(torch::kFloat64);
  const Tensor t = torch::tanh(std::sqrt(2 / std::numbers::pi) * (x64 + 0.044715 * x64.pow(3)));
  return 0.5 * x64 * (1 + t);
}

Tensor ReferenceGeluDerivative64(const Tensor& x) {
  const Tensor x64 = x.to(torch::kFloat64);
  const double k = std::sqrt(2 / std::numbers::pi);
  const Tensor t = torch::tanh(k * (x64 + 0.044715 * x64.pow(3)));
  return 0.5 * (1 + t) + 0.5 * x64 * (1 - t * t) * k * (1 + 3 * 0.044715 * x64 * x64);
}

// ---- Running an op: its output, the gradients of its inputs for a given output gradient, and
// the name of the autograd node that made the output. ----

using Op = std::function<Tensor(const std::vector<Tensor>&)>;

struct OpRun {
  Tensor output;
  std::vector<Tensor> grads;  // per input; undefined for inputs that take no gradient
  std::string node;
};

// `inputs` are leaves made from `values` (detached copies); `differentiable[i]` says whether
// input i requires grad. `make_input` turns a leaf into what the op sees (e.g. a transposed view).
OpRun RunOp(const Op& op, const std::vector<Tensor>& values,
            const std::vector<bool>& differentiable, const Tensor& grad_output,
            const std::function<Tensor(size_t, const Tensor&)>& make_input = nullptr) {
  std::vector<Tensor> leaves, inputs;
  for (size_t i = 0; i < values.size(); ++i) {
    leaves.push_back(values[i].detach().clone().requires_grad_(differentiable[i]));
    inputs.push_back(make_input ? make_input(i, leaves.back()) : leaves.back());
  }
  OpRun run;
  run.output = op(inputs);
  run.node = run.output.grad_fn() ? run.output.grad_fn()->name() : "";
  run.output.backward(grad_output);
  for (size_t i = 0; i < leaves.size(); ++i) {
    run.grads.push_back(differentiable[i] ? leaves[i].grad() : Tensor());
  }
  run.output = run.output.detach();
  return run;
}

void ExpectEqual(const OpRun& actual, const OpRun& expected) {
  EXPECT_TRUE(torch::equal(actual.output, expected.output));
  ASSERT_EQ(actual.grads.size(), expected.grads.size());
  for (size_t i = 0; i < actual.grads.size(); ++i) {
    ASSERT_EQ(actual.grads[i].defined(), expected.grads[i].defined()) << "input " << i;
    if (expected.grads[i].defined()) {
      EXPECT_TRUE(torch::equal(actual.grads[i], expected.grads[i])) << "input " << i;
    }
  }
}

// |actual - expected| <= rtol |expected| + atol_of_max max|expected| elementwise, with matching
// shape and dtype.
void ExpectClose(const Tensor& actual, const Tensor& expected, double rtol, double atol_of_max,
                 const std::string& what) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  EXPECT_EQ(actual.scalar_type(), expected.scalar_type()) << what;
  const Tensor a = actual.to(torch::kFloat64), e = expected.to(torch::kFloat64);
  if (e.numel() == 0) return;
  const double atol = atol_of_max * e.abs().max().item<double>();
  const Tensor excess = (a - e).abs() - (rtol * e.abs() + atol);
  EXPECT_LE(excess.max().item<double>(), 0.0)
      << what << ": max |diff| " << (a - e).abs().max().item<double>() << ", max |expected| "
      << e.abs().max().item<double>();
}

void ExpectRunClose(const OpRun& actual, const OpRun& expected, double rtol, double atol_of_max,
                    const std::string& what) {
  ExpectClose(actual.output, expected.output, rtol, atol_of_max, what + " output");
  for (size_t i = 0; i < expected.grads.size(); ++i) {
    if (!expected.grads[i].defined()) continue;
    ASSERT_TRUE(actual.grads[i].defined()) << what << " grad " << i;
    ExpectClose(actual.grads[i], expected.grads[i], rtol, atol_of_max,
                what + " grad " + std::to_string(i));
  }
}

const Op kFusedRmsNorm = [](const std::vector<Tensor>& in) {
  return FusedRmsNorm(in[0], in[1], 1e-6);
};
const Op kReferenceRmsNorm = [](const std::vector<Tensor>& in) {
  return ReferenceRmsNorm(in[0], in[1], 1e-6);
};
// LayerNorm of in[0] with weight in[1] and, when given, bias in[2].
const Op kFusedLayerNorm = [](const std::vector<Tensor>& in) {
  return FusedLayerNorm(in[0], in[1], in.size() > 2 ? in[2] : Tensor(), 1e-5);
};
const Op kReferenceLayerNorm = [](const std::vector<Tensor>& in) {
  return ReferenceLayerNorm(in[0], in[1], in.size() > 2 ? in[2] : Tensor(), 1e-5);
};
const Op kFusedRotary = [](const std::vector<Tensor>& in) {
  return FusedRotary(in[0], in[1], in[2]);
};
const Op kReferenceRotary = [](const std::vector<Tensor>& in) {
  return ReferenceRotary(in[0], in[1], in[2]);
};
const Op kFusedSwiGlu = [](const std::vector<Tensor>& in) { return FusedSwiGlu(in[0], in[1]); };
const Op kReferenceSwiGlu = [](const std::vector<Tensor>& in) {
  return ReferenceSwiGlu(in[0], in[1]);
};

const Op kResidualAdd = [](const std::vector<Tensor>& in) { return ResidualAdd(in[0], in[1]); };
const Op kAtenAdd = [](const std::vector<Tensor>& in) { return in[0] + in[1]; };

// ExpectEqual, and the same dtypes.
void ExpectIdentical(const OpRun& actual, const OpRun& expected) {
  ASSERT_EQ(actual.output.scalar_type(), expected.output.scalar_type());
  ASSERT_EQ(actual.grads.size(), expected.grads.size());
  for (size_t i = 0; i < actual.grads.size(); ++i) {
    ASSERT_EQ(actual.grads[i].defined(), expected.grads[i].defined()) << "input " << i;
    if (expected.grads[i].defined()) {
      ASSERT_EQ(actual.grads[i].scalar_type(), expected.grads[i].scalar_type()) << "input " << i;
    }
  }
  ExpectEqual(actual, expected);
}

// x [batch, seq, heads, head_dim] seen as [batch, heads, seq, head_dim], as the model calls rotary.
Tensor HeadsFirst(size_t input, const Tensor& t) { return input == 0 ? t.transpose(1, 2) : t; }

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

TEST(FusedOpsCpuTest, SwitchRoundTrips) {
  ASSERT_TRUE(FusedKernelsEnabled());
  SetFusedKernelsEnabled(false);
  EXPECT_FALSE(FusedKernelsEnabled());
  SetFusedKernelsEnabled(true);
  EXPECT_TRUE(FusedKernelsEnabled());
}

// ---- A model's loss and gradients with the fused kernels on and off. ----

// For each of fused on, then off: a fresh model of `dims` (the same seed) on the tokens' device,
// one forward (under bf16 autocast on CUDA when `autocast`) and backward; then expects the losses
// within loss_tolerance and every parameter's gradient within grad_tolerance of the composite's
// in norm.
void ExpectModelTracksTheComposite(const v1::ModelDims& dims, const Tensor& tokens, bool autocast,
                                   double loss_tolerance, double grad_tolerance) {
  const int64_t seq = tokens.size(1) - 1;
  const Tensor inputs = tokens.narrow(1, 0, seq), targets = tokens.narrow(1, 1, seq);
  for (auto mode : {v1::ACTIVATION_CHECKPOINTING_NONE, v1::ACTIVATION_CHECKPOINTING_SELECTIVE}) {
    SCOPED_TRACE(v1::ActivationCheckpointing_Name(mode));
    std::vector<double> losses;
    std::vector<std::vector<Tensor>> grads;
    for (bool fused : {true, false}) {
      SetFusedKernelsEnabled(fused);
      torch::manual_seed(9);
      CausalLM model(dims, 0.02);
      model->SetActivationCheckpointing(mode);
      model->to(tokens.device());
      if (autocast) {
        at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
        at::autocast::set_autocast_enabled(at::kCUDA, true);
      }
      Tensor loss = model->Loss(inputs, targets);
      if (autocast) {
        at::autocast::set_autocast_enabled(at::kCUDA, false);
        at::autocast::clear_cache();
      }
      loss.backward();
      losses.push_back(loss.item<double>());
      auto& g = grads.emplace_back();
      for (const Tensor& p : model->parameters()) {
        ASSERT_TRUE(p.grad().defined());
        g.push_back(p.grad().cpu());
      }
    }
    SetFusedKernelsEnabled(true);
    EXPECT_NEAR(losses[0], losses[1], loss_tolerance);
    ASSERT_EQ(grads[0].size(), grads[1].size());
    for (size_t i = 0; i < grads[0].size(); ++i) {
      const double error = (grads[0][i] - grads[1][i]).norm().item<double>();
      EXPECT_LE(error, grad_tolerance * grads[1][i].norm().item<double>() + 1e-7)
          << "parameter " << i;
    }
  }
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
    ExpectRunClose(rms, RunOp(kReferenceRmsNorm, {x_rms, w}, {true, true}, grad), kRtol32, kAtol32,
                   "rms_norm f32");
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
    const OpRun reference =
        RunOp(kReferenceSwiGlu, {g.to(torch::kFloat32), u.to(torch::kFloat32)}, {true, true},
              d.to(torch::kFloat32), shifted);
    const double rtol = dtype == torch::kFloat32 ? kRtol32 : kRtolLow;
    const double atol = dtype == torch::kFloat32 ? kAtol32 : kAtolLow;
    ExpectClose(misaligned.output.to(torch::kFloat32), reference.output, rtol, atol, "output");
    ExpectClose(misaligned.grads[0].to(torch::kFloat32), reference.grads[0], rtol, atol,
                "grad gate");
    ExpectClose(misaligned.grads[1].to(torch::kFloat32), reference.grads[1], rtol, atol,
                "grad up");
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

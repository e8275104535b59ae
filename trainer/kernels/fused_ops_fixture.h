// Shared by fused_ops_test.cc (the CPU fallback and kernels) and fused_ops_gpu_test.cc (the
// CUDA kernels): ATen's composite of each fused op as model.cc ran it before the fused kernels, a
// runner that gives an op's output and the gradients of its inputs, comparisons, and a model's
// loss and gradients with the kernels on and off.
#pragma once

#include <ATen/autocast_mode.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <numbers>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "trainer/kernels/fused_ops.h"
#include "trainer/model/model.h"

namespace tessera::trainer {

using Tensor = torch::Tensor;

// ---- The composite, as model.cc had it. ----

inline Tensor ReferenceRotateHalf(const Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

inline Tensor ReferenceRotary(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  Tensor x32 = x.to(torch::kFloat32);
  return (x32 * cos + ReferenceRotateHalf(x32) * sin).to(x.scalar_type());
}

inline Tensor ReferenceRmsNorm(const Tensor& x, const Tensor& weight, double eps) {
  Tensor x32 = x.to(torch::kFloat32);
  Tensor normed = x32 * torch::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return (normed * weight.to(torch::kFloat32)).to(x.scalar_type());
}

inline Tensor ReferenceLayerNorm(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                 double eps) {
  return at::layer_norm(x.to(torch::kFloat32), {weight.size(0)}, weight, bias, eps)
      .to(x.scalar_type());
}

inline Tensor ReferenceSwiGlu(const Tensor& gate, const Tensor& up) {
  return torch::silu(gate) * up;
}

// GELU (tanh) and its derivative in float64, from its definition.
inline Tensor ReferenceGelu64(const Tensor& x) {
  const Tensor x64 = x.to(torch::kFloat64);
  const Tensor t = torch::tanh(std::sqrt(2 / std::numbers::pi) * (x64 + 0.044715 * x64.pow(3)));
  return 0.5 * x64 * (1 + t);
}

inline Tensor ReferenceGeluDerivative64(const Tensor& x) {
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
inline OpRun RunOp(const Op& op, const std::vector<Tensor>& values,
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

inline void ExpectEqual(const OpRun& actual, const OpRun& expected) {
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
inline void ExpectClose(const Tensor& actual, const Tensor& expected, double rtol,
                        double atol_of_max, const std::string& what) {
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

inline void ExpectRunClose(const OpRun& actual, const OpRun& expected, double rtol,
                           double atol_of_max, const std::string& what) {
  ExpectClose(actual.output, expected.output, rtol, atol_of_max, what + " output");
  for (size_t i = 0; i < expected.grads.size(); ++i) {
    if (!expected.grads[i].defined()) continue;
    ASSERT_TRUE(actual.grads[i].defined()) << what << " grad " << i;
    ExpectClose(actual.grads[i], expected.grads[i], rtol, atol_of_max,
                what + " grad " + std::to_string(i));
  }
}

inline const Op kFusedRmsNorm = [](const std::vector<Tensor>& in) {
  return FusedRmsNorm(in[0], in[1], 1e-6);
};
inline const Op kReferenceRmsNorm = [](const std::vector<Tensor>& in) {
  return ReferenceRmsNorm(in[0], in[1], 1e-6);
};
// LayerNorm of in[0] with weight in[1] and, when given, bias in[2].
inline const Op kFusedLayerNorm = [](const std::vector<Tensor>& in) {
  return FusedLayerNorm(in[0], in[1], in.size() > 2 ? in[2] : Tensor(), 1e-5);
};
inline const Op kReferenceLayerNorm = [](const std::vector<Tensor>& in) {
  return ReferenceLayerNorm(in[0], in[1], in.size() > 2 ? in[2] : Tensor(), 1e-5);
};
inline const Op kFusedRotary = [](const std::vector<Tensor>& in) {
  return FusedRotary(in[0], in[1], in[2]);
};
inline const Op kReferenceRotary = [](const std::vector<Tensor>& in) {
  return ReferenceRotary(in[0], in[1], in[2]);
};
inline const Op kFusedSwiGlu = [](const std::vector<Tensor>& in) {
  return FusedSwiGlu(in[0], in[1]);
};
inline const Op kReferenceSwiGlu = [](const std::vector<Tensor>& in) {
  return ReferenceSwiGlu(in[0], in[1]);
};

inline const Op kResidualAdd = [](const std::vector<Tensor>& in) {
  return ResidualAdd(in[0], in[1]);
};
inline const Op kAtenAdd = [](const std::vector<Tensor>& in) { return in[0] + in[1]; };

// A block's residual connection around a norm: x + branch(norm(x)), with the norm keeping its
// input for the residual (FusedRmsNormKeepingInput / FusedLayerNormKeepingInput) or not (x used
// twice). in: x, weight and, for LayerNorm, bias; the norm's output in out_dtype (x's when
// nullopt). `uses`: 3 both paths, 1 the residual only, 2 the branch only.
inline Op NormResidualOp(bool rms, bool keep, std::optional<at::ScalarType> out_dtype,
                         int uses = 3) {
  return [=](const std::vector<Tensor>& in) {
    const Tensor bias = in.size() > 2 ? in[2] : Tensor();
    NormAndInput norm;
    if (keep) {
      norm = rms ? FusedRmsNormKeepingInput(in[0], in[1], 1e-6, out_dtype)
                 : FusedLayerNormKeepingInput(in[0], in[1], bias, 1e-5, out_dtype);
    } else {
      norm.y = rms ? FusedRmsNorm(in[0], in[1], 1e-6, out_dtype)
                   : FusedLayerNorm(in[0], in[1], bias, 1e-5, out_dtype);
      norm.x_kept = in[0];
    }
    const Tensor branch = torch::tanh(norm.y) * 3;
    if (uses == 1) return norm.x_kept * 2;
    if (uses == 2) return branch;
    return ResidualAdd(norm.x_kept, branch);
  };
}

// The autograd node that made a kept input (its grad_fn's name), or "" for none.
inline std::string KeptInputNode(const NormAndInput& norm) {
  return norm.x_kept.grad_fn() ? norm.x_kept.grad_fn()->name() : "";
}

// ExpectEqual, and the same dtypes.
inline void ExpectIdentical(const OpRun& actual, const OpRun& expected) {
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
inline Tensor HeadsFirst(size_t input, const Tensor& t) {
  return input == 0 ? t.transpose(1, 2) : t;
}

// ---- A model's loss and gradients with the fused kernels on and off. ----

// For each of fused on, then off: a fresh model of `dims` (the same seed) on the tokens' device,
// one forward (under bf16 autocast on CUDA when `autocast`) and backward; then expects the losses
// within loss_tolerance and every parameter's gradient within grad_tolerance of the composite's
// in norm.
inline void ExpectModelTracksTheComposite(const v1::ModelDims& dims, const Tensor& tokens,
                                          bool autocast, double loss_tolerance,
                                          double grad_tolerance) {
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

}  // namespace tessera::trainer

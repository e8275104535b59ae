#include "trainer/kernels/fused_ops.h"

#include <torch/csrc/autograd/custom_function.h>

#include <atomic>
#include <optional>

#include "trainer/kernels/fused_ops_cpu.h"

#if TESSERA_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "trainer/kernels/fused_ops_kernels.h"
#endif

namespace tessera::trainer {
namespace {

std::atomic<bool> fused_kernels_enabled{true};

// The composites: what the model ran before the fused kernels, and what it still runs wherever
// they do not apply. Keep them as they are: CPU training's numbers depend on them bit for bit.

torch::Tensor RotateHalf(const torch::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

torch::Tensor RotaryComposite(const torch::Tensor& x, const torch::Tensor& cos,
                              const torch::Tensor& sin) {
  torch::Tensor x32 = x.to(torch::kFloat32);
  return (x32 * cos + RotateHalf(x32) * sin).to(x.scalar_type());
}

torch::Tensor RmsNormComposite(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                               at::ScalarType out_dtype) {
  torch::Tensor x32 = x.to(torch::kFloat32);
  torch::Tensor normed = x32 * torch::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return (normed * weight.to(torch::kFloat32)).to(out_dtype);
}

torch::Tensor LayerNormComposite(const torch::Tensor& x, const torch::Tensor& weight,
                                 const torch::Tensor& bias, double eps, at::ScalarType out_dtype) {
  // Autocast runs layer_norm in float32 on its own; the explicit cast covers CPU and no-autocast.
  return at::layer_norm(x.to(torch::kFloat32), {weight.size(0)}, weight, bias, eps).to(out_dtype);
}

torch::Tensor SwiGluComposite(const torch::Tensor& gate, const torch::Tensor& up) {
  return torch::silu(gate) * up;
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

bool FusedGeluCpuApplies(const torch::Tensor& x) {
  return x.device().is_cpu() && x.scalar_type() == at::kFloat && x.layout() == at::kStrided &&
         x.numel() > 0;
}

// GELU of a contiguous float32 CPU tensor by the kernel.
torch::Tensor GeluTanhCpu(const torch::Tensor& x_c) {
  torch::Tensor y = at::empty(x_c.sizes(), x_c.options());
  cpu_kernels::GeluTanhForward(x_c.const_data_ptr<float>(), y.mutable_data_ptr<float>(),
                               x_c.numel());
  return y;
}

struct GeluTanhCpuFunction : torch::autograd::Function<GeluTanhCpuFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x) {
    const torch::Tensor x_c = x.contiguous();
    ctx->save_for_backward({x_c});
    return GeluTanhCpu(x_c);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined() || !ctx->needs_input_grad(0)) return {torch::Tensor()};
    const torch::Tensor x = ctx->get_saved_variables()[0];
    const torch::Tensor grad_y = grads[0].to(at::kFloat).contiguous();
    torch::Tensor grad_x = at::empty(x.sizes(), x.options());
    cpu_kernels::GeluTanhBackward(grad_y.const_data_ptr<float>(), x.const_data_ptr<float>(),
                                  grad_x.mutable_data_ptr<float>(), x.numel());
    return {grad_x};
  }
};

bool FloatCpu(const torch::Tensor& t) {
  return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.layout() == at::kStrided;
}

bool FusedRmsNormCpuApplies(const torch::Tensor& x, const torch::Tensor& weight) {
  return FloatCpu(x) && FloatCpu(weight) && x.dim() >= 1 && weight.dim() == 1 &&
         x.size(-1) == weight.size(0) && x.numel() > 0;
}

// The kept input of a norm (NormFunction, RmsNormCpuFunction with keep_input): x returned as a
// second output for the residual connection around the layer the norm feeds, so that the
// gradient reaching it arrives in the norm's backward together with grad_y, which adds it to
// grad_x in its own pass (no separate add of the two by autograd). Its gradient, or undefined.
torch::Tensor KeptInputGrad(const variable_list& grads, const torch::Tensor& x) {
  if (grads.size() < 2 || !grads[1].defined()) return {};
  return grads[1].to(x.scalar_type()).contiguous();
}

// The norm's outputs: y, and x when it is kept (returned as is: autograd makes it a view of x
// with this node as its gradient function).
variable_list NormOutputs(torch::Tensor y, const torch::Tensor& x, bool keep_input) {
  if (!keep_input) return {std::move(y)};
  return {std::move(y), x};
}

struct RmsNormCpuFunction : torch::autograd::Function<RmsNormCpuFunction> {
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, double eps, bool keep_input) {
    const torch::Tensor x_c = x.contiguous(), w_c = weight.contiguous();
    const int64_t hidden = x_c.size(-1), rows = x_c.numel() / hidden;
    torch::Tensor y = at::empty(x_c.sizes(), x_c.options());
    torch::Tensor rstd = at::empty({rows}, x_c.options());
    cpu_kernels::RmsNormForward(x_c.const_data_ptr<float>(), w_c.const_data_ptr<float>(),
                                y.mutable_data_ptr<float>(), rstd.mutable_data_ptr<float>(), rows,
                                hidden, static_cast<float>(eps));
    ctx->save_for_backward({x_c, w_c, rstd});
    // An unused output's gradient stays undefined rather than a tensor of zeros.
    if (keep_input) ctx->set_materialize_grads(false);
    return NormOutputs(std::move(y), x, keep_input);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    torch::Tensor grad_x, grad_weight;
    const variable_list saved = ctx->get_saved_variables();
    const torch::Tensor &x = saved[0], &weight = saved[1], &rstd = saved[2];
    const torch::Tensor grad_kept =
        ctx->needs_input_grad(0) ? KeptInputGrad(grads, x) : at::Tensor();
    if (!grads[0].defined()) return {grad_kept, grad_weight, torch::Tensor(), torch::Tensor()};
    const torch::Tensor grad_y = grads[0].to(at::kFloat).contiguous();
    const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
    if (ctx->needs_input_grad(0)) grad_x = at::empty(x.sizes(), x.options());
    if (ctx->needs_input_grad(1)) grad_weight = at::empty({hidden}, weight.options());
    cpu_kernels::RmsNormBackward(
        grad_y.const_data_ptr<float>(), x.const_data_ptr<float>(), weight.const_data_ptr<float>(),
        rstd.const_data_ptr<float>(), grad_x.defined() ? grad_x.mutable_data_ptr<float>() : nullptr,
        grad_weight.defined() ? grad_weight.mutable_data_ptr<float>() : nullptr, rows, hidden,
        std::nullopt, grad_kept.defined() ? grad_kept.const_data_ptr<float>() : nullptr);
    return {grad_x, grad_weight, torch::Tensor(), torch::Tensor()};
  }
};

bool FusedRotaryCpuApplies(const torch::Tensor& x, const torch::Tensor& cos,
                           const torch::Tensor& sin) {
  return FloatCpu(x) && FloatCpu(cos) && FloatCpu(sin) && !cos.requires_grad() &&
         !sin.requires_grad() && x.dim() >= 2 && x.dim() <= 4 && cos.dim() == 2 &&
         cos.sizes() == sin.sizes() && cos.size(0) == x.size(-2) && cos.size(1) == x.size(-1) &&
         x.size(-1) % 2 == 0 && x.numel() > 0;
}

// Views `t` (2 to 4 dimensions) as 4 by adding leading dimensions of size 1.
torch::Tensor As4d(torch::Tensor t) {
  while (t.dim() < 4) t = t.unsqueeze(0);
  return t;
}

// The rotation (or its transpose) of a float32 CPU tensor by the kernel: out has in's shape, and
// its strides where in is dense (the model's transposed q and k), as the composite's would.
torch::Tensor RotaryCpu(torch::Tensor in, const torch::Tensor& cos, const torch::Tensor& sin,
                        bool transpose) {
  if (in.stride(-1) != 1) in = in.contiguous();
  // in's last dimension is contiguous, so out's is too (its strides, or contiguous).
  torch::Tensor out = at::empty_like(in);
  const torch::Tensor in4 = As4d(in), out4 = As4d(out), table = As4d(cos).expand(in4.sizes());
  cpu_kernels::RotaryRows rows;
  rows.head_dim = in4.size(3);
  for (int d = 0; d < 3; ++d) {
    rows.sizes[d] = in4.size(d);
    rows.in_strides[d] = in4.stride(d);
    rows.out_strides[d] = out4.stride(d);
    rows.table_strides[d] = table.stride(d);
  }
  cpu_kernels::Rotary(in.const_data_ptr<float>(), cos.const_data_ptr<float>(),
                      sin.const_data_ptr<float>(), out.mutable_data_ptr<float>(), rows, transpose);
  return out;
}

bool FusedSwiGluCpuApplies(const torch::Tensor& gate, const torch::Tensor& up) {
  return FloatCpu(gate) && FloatCpu(up) && gate.sizes() == up.sizes() && gate.numel() > 0;
}

#if TESSERA_WITH_CUDA

std::optional<kernels::Dtype> KernelDtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return kernels::Dtype::kFloat32;
    case at::kBFloat16:
      return kernels::Dtype::kBFloat16;
    case at::kHalf:
      return kernels::Dtype::kFloat16;
    default:
      return std::nullopt;
  }
}

kernels::Dtype KernelDtypeOf(const torch::Tensor& t) {
  const std::optional<kernels::Dtype> dtype = KernelDtype(t.scalar_type());
  TORCH_CHECK(dtype.has_value(), "fused kernels: unsupported dtype ", t.scalar_type());
  return *dtype;
}

void CheckLaunch(cudaError_t error, const char* kernel) {
  TORCH_CHECK(error == cudaSuccess, "fused kernel ", kernel, ": ", cudaGetErrorString(error));
}

bool OnOneCudaDevice(const torch::Tensor& a, const torch::Tensor& b) {
  return a.is_cuda() && b.is_cuda() && a.device() == b.device();
}

// The CUDA norm kernels apply to x and a weight (and bias) of supported dtypes on one device,
// with an output dtype they are built for.
bool FusedNormApplies(const torch::Tensor& x, const torch::Tensor& weight,
                      const torch::Tensor& bias, at::ScalarType out_dtype) {
  const std::optional<kernels::Dtype> x_dtype = KernelDtype(x.scalar_type()),
                                      y_dtype = KernelDtype(out_dtype);
  return OnOneCudaDevice(x, weight) && x_dtype && y_dtype &&
         kernels::NormDtypesSupported(*x_dtype, *y_dtype) && KernelDtype(weight.scalar_type()) &&
         x.dim() >= 1 && weight.dim() == 1 && x.size(-1) == weight.size(0) && x.numel() > 0 &&
         (!bias.defined() ||
          (OnOneCudaDevice(x, bias) && bias.scalar_type() == weight.scalar_type() &&
           bias.sizes() == weight.sizes()));
}

// NormFunction's bias argument when there is none.
torch::Tensor NoBias(const torch::Tensor& weight) { return at::empty({0}, weight.options()); }

// RMSNorm (rms true, no bias) or LayerNorm on the CUDA kernels, the output in out_dtype. A
// missing bias comes as an empty tensor: autograd's apply() takes the device of every tensor
// argument, and an undefined one has none.
struct NormFunction : torch::autograd::Function<NormFunction> {
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, const torch::Tensor& bias, double eps,
                               bool rms, int64_t out_dtype, bool keep_input) {
    const c10::cuda::CUDAGuard guard(x.device());
    const kernels::NormKind kind = rms ? kernels::NormKind::kRms : kernels::NormKind::kLayer;
    const auto y_type = static_cast<at::ScalarType>(out_dtype);
    const torch::Tensor x_c = x.contiguous(), w_c = weight.contiguous();
    const bool has_bias = bias.numel() > 0;
    const torch::Tensor b_c = has_bias ? bias.contiguous() : torch::Tensor();
    const int64_t hidden = x_c.size(-1), rows = x_c.numel() / hidden;
    torch::Tensor y = at::empty(x_c.sizes(), x_c.options().dtype(y_type));
    torch::Tensor rstd = at::empty({rows}, x_c.options().dtype(at::kFloat));
    torch::Tensor mean = rms ? torch::Tensor() : at::empty({rows}, rstd.options());
    CheckLaunch(kernels::LaunchNormForward(
                    kind, x_c.const_data_ptr(), w_c.const_data_ptr(),
                    b_c.defined() ? b_c.const_data_ptr() : nullptr, y.mutable_data_ptr(),
                    mean.defined() ? mean.mutable_data_ptr<float>() : nullptr,
                    rstd.mutable_data_ptr<float>(), rows, hidden, static_cast<float>(eps),
                    KernelDtypeOf(x_c), KernelDtypeOf(y), KernelDtypeOf(w_c),
                    c10::cuda::getCurrentCUDAStream()),
                "NormForward");
    ctx->save_for_backward({x_c, w_c, mean, rstd});
    ctx->saved_data["rms"] = rms;
    ctx->saved_data["out_dtype"] = out_dtype;
    ctx->saved_data["has_bias"] = has_bias;
    if (keep_input) ctx->set_materialize_grads(false);
    return NormOutputs(std::move(y), x, keep_input);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const torch::Tensor &x = saved[0], &weight = saved[1], &mean = saved[2], &rstd = saved[3];
    torch::Tensor grad_x, grad_weight, grad_bias;
    const auto none = [&] {
      return variable_list{grad_x,          grad_weight,     grad_bias,      torch::Tensor(),
                           torch::Tensor(), torch::Tensor(), torch::Tensor()};
    };
    const torch::Tensor grad_kept =
        ctx->needs_input_grad(0) ? KeptInputGrad(grads, x) : at::Tensor();
    if (!grads[0].defined()) {
      grad_x = grad_kept;
      return none();
    }
    const c10::cuda::CUDAGuard guard(x.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const bool rms = ctx->saved_data["rms"].toBool();
    const kernels::NormKind kind = rms ? kernels::NormKind::kRms : kernels::NormKind::kLayer;
    const auto y_type = static_cast<at::ScalarType>(ctx->saved_data["out_dtype"].toInt());
    const torch::Tensor grad_y = grads[0].to(y_type).contiguous();
    const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
    const float* mean_data = mean.defined() ? mean.const_data_ptr<float>() : nullptr;
    const bool want_bias = ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2);
    const bool want_weight = ctx->needs_input_grad(1) || want_bias;  // bias partials need these
    if (!ctx->needs_input_grad(0) && !want_weight) return none();
    const bool add_kept = grad_kept.defined() && ctx->needs_input_grad(0);
    const kernels::NormBackwardPlan plan =
        kernels::PlanNormBackward(kind, x.const_data_ptr(), weight.const_data_ptr(), rows, hidden,
                                  KernelDtypeOf(x), KernelDtypeOf(grad_y), KernelDtypeOf(weight));
    if (ctx->needs_input_grad(0)) grad_x = at::empty(x.sizes(), x.options());
    // One pass gives grad_x and the partial column sums of the weight and bias gradients
    // (deterministic: no atomics); their sums over the partitions are the gradients.
    torch::Tensor weight_partials, bias_partials;
    if (want_weight) weight_partials = at::empty({plan.partitions, hidden}, rstd.options());
    if (want_bias) bias_partials = at::empty({plan.partitions, hidden}, rstd.options());
    CheckLaunch(kernels::LaunchNormBackward(
                    kind, plan, grad_y.const_data_ptr(), x.const_data_ptr(),
                    weight.const_data_ptr(), mean_data, rstd.const_data_ptr<float>(),
                    add_kept ? grad_kept.const_data_ptr() : nullptr,
                    grad_x.defined() ? grad_x.mutable_data_ptr() : nullptr,
                    want_weight ? weight_partials.mutable_data_ptr<float>() : nullptr,
                    want_bias ? bias_partials.mutable_data_ptr<float>() : nullptr, rows, hidden,
                    KernelDtypeOf(x), KernelDtypeOf(grad_y), KernelDtypeOf(weight), stream),
                "NormBackward");
    if (ctx->needs_input_grad(1)) grad_weight = weight_partials.sum(0).to(weight.scalar_type());
    if (want_bias) grad_bias = bias_partials.sum(0).to(weight.scalar_type());
    return none();
  }
};

bool FusedRotaryApplies(const torch::Tensor& x, const torch::Tensor& cos,
                        const torch::Tensor& sin) {
  return OnOneCudaDevice(x, cos) && OnOneCudaDevice(x, sin) && KernelDtype(x.scalar_type()) &&
         cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
         !cos.requires_grad() && !sin.requires_grad() && x.dim() >= 2 && x.dim() <= 4 &&
         cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(-2) &&
         cos.size(1) == x.size(-1) && x.size(-1) % 2 == 0 && x.numel() > 0;
}

// out = the rotation of `in` (or its transpose), in's shape and dtype; out takes in's strides when
// in is dense, else it is contiguous.
torch::Tensor LaunchRotaryOn(const torch::Tensor& in, const torch::Tensor& cos,
                             const torch::Tensor& sin, bool transpose) {
  const c10::cuda::CUDAGuard guard(in.device());
  torch::Tensor out = at::empty_like(in);
  const torch::Tensor in4 = As4d(in), out4 = As4d(out);
  const torch::Tensor table = cos.expand(in4.sizes());
  kernels::RotaryGeometry geometry;
  for (int d = 0; d < 3; ++d) geometry.sizes[d] = in4.size(d);
  geometry.head_dim = in4.size(3);
  for (int d = 0; d < 4; ++d) {
    geometry.in_strides[d] = in4.stride(d);
    geometry.out_strides[d] = out4.stride(d);
    geometry.table_strides[d] = table.stride(d);
  }
  CheckLaunch(
      kernels::LaunchRotary(in.const_data_ptr(), cos.const_data_ptr<float>(),
                            sin.const_data_ptr<float>(), out.mutable_data_ptr(), geometry,
                            transpose, KernelDtypeOf(in), c10::cuda::getCurrentCUDAStream()),
      transpose ? "RotaryBackward" : "RotaryForward");
  return out;
}

bool FusedSwiGluApplies(const torch::Tensor& gate, const torch::Tensor& up) {
  return OnOneCudaDevice(gate, up) && KernelDtype(gate.scalar_type()) &&
         gate.scalar_type() == up.scalar_type() && gate.sizes() == up.sizes() && gate.numel() > 0;
}

// ResidualAdd's CUDA kernel applies to a float32 residual and a branch of a kernel dtype, of one
// shape, both dense in the same (contiguous) order, on one device.
bool FusedResidualAddApplies(const torch::Tensor& residual, const torch::Tensor& branch) {
  return OnOneCudaDevice(residual, branch) && residual.layout() == at::kStrided &&
         branch.layout() == at::kStrided && residual.scalar_type() == at::kFloat &&
         KernelDtype(branch.scalar_type()).has_value() && residual.sizes() == branch.sizes() &&
         residual.is_contiguous() && branch.is_contiguous() && residual.numel() > 0;
}

// residual + branch by the kernel, for operands FusedResidualAddApplies takes.
torch::Tensor ResidualAddCuda(const torch::Tensor& residual, const torch::Tensor& branch) {
  const c10::cuda::CUDAGuard guard(residual.device());
  torch::Tensor out = at::empty(residual.sizes(), residual.options());
  CheckLaunch(kernels::LaunchResidualAdd(residual.const_data_ptr<float>(), branch.const_data_ptr(),
                                         out.mutable_data_ptr<float>(), residual.numel(),
                                         KernelDtypeOf(branch), c10::cuda::getCurrentCUDAStream()),
              "ResidualAdd");
  return out;
}

// ResidualAddCuda with ATen's add's gradients: the output gradient itself for the residual, and
// cast to the branch's dtype for the branch (what autograd's engine does to AddBackward's).
struct ResidualAddFunction : torch::autograd::Function<ResidualAddFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& residual,
                               const torch::Tensor& branch) {
    ctx->saved_data["branch_dtype"] = static_cast<int64_t>(branch.scalar_type());
    return ResidualAddCuda(residual, branch);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    torch::Tensor grad_residual, grad_branch;
    if (grads[0].defined()) {
      const auto branch_dtype =
          static_cast<at::ScalarType>(ctx->saved_data["branch_dtype"].toInt());
      if (ctx->needs_input_grad(0)) grad_residual = grads[0];
      if (ctx->needs_input_grad(1)) grad_branch = grads[0].to(branch_dtype);
    }
    return {grad_residual, grad_branch};
  }
};

#endif  // TESSERA_WITH_CUDA

// The rotation (or its transpose) of `in` by the CPU kernel (float32) or the CUDA one, by its
// device.
torch::Tensor RotateOn(const torch::Tensor& in, const torch::Tensor& cos, const torch::Tensor& sin,
                       bool transpose) {
#if TESSERA_WITH_CUDA
  if (in.is_cuda()) return LaunchRotaryOn(in, cos, sin, transpose);
#endif
  return RotaryCpu(in, cos, sin, transpose);
}

struct RotaryFunction : torch::autograd::Function<RotaryFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& cos, const torch::Tensor& sin) {
    // Contiguous tables share their strides, which the kernels assume; the model's are already.
    const torch::Tensor cos_c = cos.contiguous(), sin_c = sin.contiguous();
    ctx->save_for_backward({cos_c, sin_c});
    ctx->saved_data["dtype"] = static_cast<int64_t>(x.scalar_type());
    return RotateOn(x, cos_c, sin_c, /*transpose=*/false);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined() || !ctx->needs_input_grad(0)) {
      return {torch::Tensor(), torch::Tensor(), torch::Tensor()};
    }
    const variable_list saved = ctx->get_saved_variables();
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {RotateOn(grads[0].to(dtype), saved[0], saved[1], /*transpose=*/true), torch::Tensor(),
            torch::Tensor()};
  }
};

// SwiGLU on the CPU kernel (float32) or the CUDA one, by the operands' device.
struct SwiGluFunction : torch::autograd::Function<SwiGluFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& gate,
                               const torch::Tensor& up) {
    const torch::Tensor gate_c = gate.contiguous(), up_c = up.contiguous();
    torch::Tensor y = at::empty(gate_c.sizes(), gate_c.options());
#if TESSERA_WITH_CUDA
    if (gate_c.is_cuda()) {
      const c10::cuda::CUDAGuard guard(gate_c.device());
      CheckLaunch(kernels::LaunchSwiGluForward(
                      gate_c.const_data_ptr(), up_c.const_data_ptr(), y.mutable_data_ptr(),
                      gate_c.numel(), KernelDtypeOf(gate_c), c10::cuda::getCurrentCUDAStream()),
                  "SwiGluForward");
    }
#endif
    if (gate_c.device().is_cpu()) {
      cpu_kernels::SwiGluForward(gate_c.const_data_ptr<float>(), up_c.const_data_ptr<float>(),
                                 y.mutable_data_ptr<float>(), gate_c.numel());
    }
    ctx->save_for_backward({gate_c, up_c});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {torch::Tensor(), torch::Tensor()};
    const variable_list saved = ctx->get_saved_variables();
    const torch::Tensor &gate = saved[0], &up = saved[1];
    const torch::Tensor grad_y = grads[0].to(gate.scalar_type()).contiguous();
    torch::Tensor grad_gate = at::empty(gate.sizes(), gate.options());
    torch::Tensor grad_up = at::empty(up.sizes(), up.options());
#if TESSERA_WITH_CUDA
    if (gate.is_cuda()) {
      const c10::cuda::CUDAGuard guard(gate.device());
      CheckLaunch(kernels::LaunchSwiGluBackward(
                      grad_y.const_data_ptr(), gate.const_data_ptr(), up.const_data_ptr(),
                      grad_gate.mutable_data_ptr(), grad_up.mutable_data_ptr(), gate.numel(),
                      KernelDtypeOf(gate), c10::cuda::getCurrentCUDAStream()),
                  "SwiGluBackward");
    }
#endif
    if (gate.device().is_cpu()) {
      cpu_kernels::SwiGluBackward(grad_y.const_data_ptr<float>(), gate.const_data_ptr<float>(),
                                  up.const_data_ptr<float>(), grad_gate.mutable_data_ptr<float>(),
                                  grad_up.mutable_data_ptr<float>(), gate.numel());
    }
    return {ctx->needs_input_grad(0) ? grad_gate : torch::Tensor(),
            ctx->needs_input_grad(1) ? grad_up : torch::Tensor()};
  }
};

// q, k, v as views of the projection; the gradient assembled in one pass.
struct SplitQkvFunction : torch::autograd::Function<SplitQkvFunction> {
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& qkv, int64_t heads,
                               int64_t head_dim) {
    ctx->saved_data["sizes"] = qkv.sizes().vec();
    return qkv.view({qkv.size(0), qkv.size(1), 3, heads, head_dim})
        .permute({2, 0, 3, 1, 4})
        .unbind(0);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const std::vector<int64_t> sizes = ctx->saved_data["sizes"].toIntVector();
    const torch::Tensor* any = nullptr;
    for (const torch::Tensor& g : grads) {
      if (g.defined()) any = &g;
    }
    if (any == nullptr) return {torch::Tensor(), torch::Tensor(), torch::Tensor()};
    // [batch, seq, 3, heads, head_dim], each third written from its [batch, heads, seq,
    // head_dim] gradient through a transposed view.
    const int64_t heads = any->size(1), head_dim = any->size(3);
    torch::Tensor grad = at::empty({sizes[0], sizes[1], 3, heads, head_dim}, any->options());
    for (int64_t i = 0; i < 3; ++i) {
      torch::Tensor part = grad.select(2, i);
      if (grads[i].defined()) {
        part.copy_(grads[i].transpose(1, 2));
      } else {
        part.zero_();
      }
    }
    return {grad.view(sizes), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

void SetFusedKernelsEnabled(bool enabled) { fused_kernels_enabled.store(enabled); }

bool FusedKernelsEnabled() { return fused_kernels_enabled.load(); }

bool FusedKernelsBuilt() { return TESSERA_WITH_CUDA != 0; }

namespace {

// A norm function's outputs (NormOutputs) as y and the input kept for the residual: the second
// output when the input was kept, else x itself.
NormAndInput WithKeptInput(variable_list outputs, const torch::Tensor& x, bool keep_input) {
  return {std::move(outputs[0]), keep_input ? std::move(outputs[1]) : x};
}

// FusedRmsNorm (keep_input false: x_kept is x itself) or FusedRmsNormKeepingInput.
NormAndInput RmsNorm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                     std::optional<at::ScalarType> out_dtype, bool keep_input) {
  const at::ScalarType out = out_dtype.value_or(x.scalar_type());
  if (FusedKernelsEnabled() && FusedRmsNormCpuApplies(x, weight)) {
    NormAndInput norm =
        WithKeptInput(RmsNormCpuFunction::apply(x, weight, eps, keep_input), x, keep_input);
    if (out != at::kFloat) norm.y = norm.y.to(out);
    return norm;
  }
#if TESSERA_WITH_CUDA
  if (FusedKernelsEnabled() && FusedNormApplies(x, weight, torch::Tensor(), out)) {
    return WithKeptInput(NormFunction::apply(x, weight, NoBias(weight), eps, /*rms=*/true,
                                             static_cast<int64_t>(out), keep_input),
                         x, keep_input);
  }
#endif
  return {RmsNormComposite(x, weight, eps, out), x};
}

NormAndInput LayerNorm(const torch::Tensor& x, const torch::Tensor& weight,
                       const torch::Tensor& bias, double eps,
                       std::optional<at::ScalarType> out_dtype,
                       [[maybe_unused]] bool keep_input) {  // no CPU LayerNorm kernel to keep it
  const at::ScalarType out = out_dtype.value_or(x.scalar_type());
#if TESSERA_WITH_CUDA
  if (FusedKernelsEnabled() && FusedNormApplies(x, weight, bias, out)) {
    return WithKeptInput(NormFunction::apply(x, weight, bias.defined() ? bias : NoBias(weight), eps,
                                             /*rms=*/false, static_cast<int64_t>(out), keep_input),
                         x, keep_input);
  }
#endif
  return {LayerNormComposite(x, weight, bias, eps, out), x};
}

}  // namespace

torch::Tensor FusedRmsNorm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                           std::optional<at::ScalarType> out_dtype) {
  return RmsNorm(x, weight, eps, out_dtype, /*keep_input=*/false).y;
}

NormAndInput FusedRmsNormKeepingInput(const torch::Tensor& x, const torch::Tensor& weight,
                                      double eps, std::optional<at::ScalarType> out_dtype) {
  return RmsNorm(x, weight, eps, out_dtype, /*keep_input=*/true);
}

torch::Tensor FusedLayerNorm(const torch::Tensor& x, const torch::Tensor& weight,
                             const torch::Tensor& bias, double eps,
                             std::optional<at::ScalarType> out_dtype) {
  return LayerNorm(x, weight, bias, eps, out_dtype, /*keep_input=*/false).y;
}

NormAndInput FusedLayerNormKeepingInput(const torch::Tensor& x, const torch::Tensor& weight,
                                        const torch::Tensor& bias, double eps,
                                        std::optional<at::ScalarType> out_dtype) {
  return LayerNorm(x, weight, bias, eps, out_dtype, /*keep_input=*/true);
}

torch::Tensor FusedRotary(const torch::Tensor& x, const torch::Tensor& cos,
                          const torch::Tensor& sin) {
  if (FusedKernelsEnabled() && FusedRotaryCpuApplies(x, cos, sin)) {
    if (!(x.requires_grad() && torch::GradMode::is_enabled())) {
      return RotaryCpu(x, cos.contiguous(), sin.contiguous(), /*transpose=*/false);
    }
    return RotaryFunction::apply(x, cos, sin);
  }
#if TESSERA_WITH_CUDA
  if (FusedKernelsEnabled() && FusedRotaryApplies(x, cos, sin)) {
    return RotaryFunction::apply(x, cos, sin);
  }
#endif
  return RotaryComposite(x, cos, sin);
}

torch::Tensor FusedSwiGlu(const torch::Tensor& gate, const torch::Tensor& up) {
  bool applies = FusedSwiGluCpuApplies(gate, up);
#if TESSERA_WITH_CUDA
  applies = applies || FusedSwiGluApplies(gate, up);
#endif
  if (FusedKernelsEnabled() && applies) return SwiGluFunction::apply(gate, up);
  return SwiGluComposite(gate, up);
}

torch::Tensor FusedGeluTanh(const torch::Tensor& x) {
  if (FusedKernelsEnabled() && FusedGeluCpuApplies(x)) {
    // Without autograd (inference, recomputation under no_grad) the kernel runs alone.
    if (!(x.requires_grad() && torch::GradMode::is_enabled())) return GeluTanhCpu(x.contiguous());
    return GeluTanhCpuFunction::apply(x);
  }
  return torch::gelu(x, "tanh");
}

torch::Tensor ResidualAdd(const torch::Tensor& residual, const torch::Tensor& branch) {
#if TESSERA_WITH_CUDA
  if (FusedKernelsEnabled() && FusedResidualAddApplies(residual, branch)) {
    // Without autograd (inference, recomputation under no_grad) the kernel runs alone.
    if (!((residual.requires_grad() || branch.requires_grad()) && torch::GradMode::is_enabled())) {
      return ResidualAddCuda(residual, branch);
    }
    return ResidualAddFunction::apply(residual, branch);
  }
#endif
  return residual + branch;
}

std::vector<torch::Tensor> SplitQkv(const torch::Tensor& qkv, int64_t heads, int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.size(2) == 3 * heads * head_dim, "SplitQkv: ", qkv.sizes(),
              " is not [batch, seq, 3 x ", heads, " x ", head_dim, "]");
  if (!FusedKernelsEnabled() || !(qkv.requires_grad() && torch::GradMode::is_enabled())) {
    return qkv.view({qkv.size(0), qkv.size(1), 3, heads, head_dim})
        .permute({2, 0, 3, 1, 4})
        .unbind(0);
  }
  return SplitQkvFunction::apply(qkv, heads, head_dim);
}

bool FusedCrossEntropyApplies([[maybe_unused]] const torch::Tensor& h,
                              [[maybe_unused]] at::ScalarType compute,
                              [[maybe_unused]] const torch::Tensor& targets) {
#if TESSERA_WITH_CUDA
  return FusedKernelsEnabled() && OnOneCudaDevice(h, targets) && KernelDtype(compute).has_value() &&
         targets.scalar_type() == at::kLong;
#else
  return false;
#endif
}

std::optional<torch::Tensor> FusedCrossEntropyRows([[maybe_unused]] torch::Tensor& logits,
                                                   [[maybe_unused]] const torch::Tensor& targets,
                                                   [[maybe_unused]] const torch::Tensor& count,
                                                   [[maybe_unused]] int64_t ignore,
                                                   [[maybe_unused]] bool write_grad,
                                                   [[maybe_unused]] int64_t vocab) {
#if TESSERA_WITH_CUDA
  if (vocab <= 0) vocab = logits.dim() == 2 ? logits.size(1) : 0;
  if (FusedCrossEntropyApplies(logits, logits.scalar_type(), targets) &&
      OnOneCudaDevice(logits, count) && logits.dim() == 2 && logits.is_contiguous() && vocab > 0 &&
      vocab <= logits.size(1) && targets.dim() == 1 && targets.size(0) == logits.size(0) &&
      count.numel() == 1 && count.scalar_type() == at::kFloat) {
    const c10::cuda::CUDAGuard guard(logits.device());
    const torch::Tensor targets_c = targets.contiguous(), count_c = count.contiguous();
    torch::Tensor row_loss = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
    CheckLaunch(kernels::LaunchCrossEntropyRows(
                    logits.mutable_data_ptr(), targets_c.const_data_ptr<int64_t>(),
                    count_c.const_data_ptr<float>(), row_loss.mutable_data_ptr<float>(),
                    logits.size(0), vocab, logits.size(1), ignore, write_grad,
                    KernelDtypeOf(logits), c10::cuda::getCurrentCUDAStream()),
                "CrossEntropyRows");
    return row_loss;
  }
#endif
  return std::nullopt;
}

}  // namespace tessera::trainer

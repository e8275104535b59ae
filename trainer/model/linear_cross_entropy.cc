#include "trainer/model/linear_cross_entropy.h"

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <atomic>
#include <iostream>
#include <optional>

#include "planner/model_config.h"
#include "trainer/data/data_loader.h"
#include "trainer/kernels/fused_ops.h"

namespace tessera::trainer {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Whether this process's LibTorch takes a matrix product of 16-bit operands into a float32
// output (aten::addmm.dtype_out); cleared, with a warning, the first time it refuses.
std::atomic<bool> products_into_float32{true};

// out (+)= a b as one product written into `out` (accumulate: out + a b, read and written in
// out's dtype, float32 or a's), without a separate product in a's dtype and a pass to add or
// copy it. False where that is not possible (out's dtype neither a's nor float32, or this
// LibTorch refuses it): the caller then computes the product and adds or copies it.
bool ProductInto(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, bool accumulate) {
  const at::ScalarType dtype = out.scalar_type();
  const bool same = dtype == a.scalar_type();
  if (!same && (dtype != at::kFloat || !products_into_float32.load())) return false;
  try {
    if (same) {
      accumulate ? out.addmm_(a, b) : at::mm_out(out, a, b);
    } else {
      accumulate ? at::addmm_out(out, out, a, b, dtype) : at::mm_out(out, a, b, dtype);
    }
    return true;
  } catch (const c10::Error& e) {
    // Refused before any kernel ran (argument checks): out is untouched.
    if (same) throw;
    if (products_into_float32.exchange(false)) {
      std::cerr << "tessera-trainer: LinearCrossEntropy: this LibTorch does not take 16-bit "
                   "products into float32 outputs; adding the products separately ("
                << e.what_without_backtrace() << ")\n";
    }
    return false;
  }
}

struct LinearCrossEntropyFunction : torch::autograd::Function<LinearCrossEntropyFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& h, const at::Tensor& weight,
                            const at::Tensor& targets, int64_t chunk_rows, bool grad_h,
                            bool grad_w) {
    // The dtype of the two products: autocast's when it is on (a linear layer's inputs would be
    // cast to it), else the inputs'. Cast once here, not per chunk.
    const at::DeviceType device = h.device().type();
    const at::ScalarType compute = at::autocast::is_autocast_enabled(device)
                                       ? at::autocast::get_autocast_dtype(device)
                                       : h.scalar_type();
    const at::Tensor h_c = h.to(compute);
    const int64_t rows = h.size(0);
    const int64_t vocab = weight.size(0);
    const bool fused = FusedCrossEntropyApplies(h, compute, targets);
    // On the fused path the weight's rows are padded with zeros to a multiple of 64, so that
    // the logits' rows are 16-byte aligned: at an odd vocabulary (GPT-2's 50,257) cuBLAS
    // otherwise falls back to slow unaligned kernels for all three products. The kernel skips
    // the padding columns and writes 0 into their gradient.
    const int64_t padded = fused ? planner::LossPaddedVocab(vocab) : vocab;
    at::Tensor w_c = weight.to(compute);
    if (padded != vocab) w_c = at::constant_pad_nd(w_c, {0, 0, 0, padded - vocab});
    const at::Tensor counted = targets != kIgnoreTarget;
    // 1 when no target counts: loss 0 and zero gradients rather than 0 / 0.
    const at::Tensor count = counted.sum().clamp_min(1).to(at::kFloat);
    at::Tensor loss = at::zeros({}, h.options().dtype(at::kFloat));
    at::Tensor dh = grad_h ? at::empty_like(h) : at::Tensor();
    at::Tensor dw = grad_w ? at::zeros({padded, weight.size(1)}, weight.options().dtype(at::kFloat))
                           : at::Tensor();
    if (chunk_rows <= 0) {
      chunk_rows = fused ? planner::GpuLossChunkRows(vocab, c10::elementSize(compute))
                         : planner::LossChunkRows(vocab);
    }
    for (int64_t begin = 0; begin < rows; begin += chunk_rows) {
      const int64_t n = std::min(chunk_rows, rows - begin);
      const at::Tensor h_chunk = h_c.narrow(0, begin, n);
      at::Tensor logits = at::matmul(h_chunk, w_c.t());
      at::Tensor grad_c;
      if (fused) {
        // On a GPU, one kernel: the rows' losses, and their gradient written over the logits in
        // the compute dtype (no float32 logits, log-probabilities or gradient in memory).
        std::optional<at::Tensor> row_loss =
            FusedCrossEntropyRows(logits, targets.narrow(0, begin, n), count, kIgnoreTarget,
                                  /*write_grad=*/grad_h || grad_w, vocab);
        TORCH_CHECK(row_loss.has_value(), "LinearCrossEntropy: the fused kernel did not take ",
                    logits.sizes(), " ", logits.scalar_type(), " logits");
        loss.add_(row_loss->sum());
        if (!grad_h && !grad_w) continue;
        grad_c = std::move(logits);
      } else {
        const at::Tensor keep = counted.narrow(0, begin, n);
        // Ignored rows pick column 0; their loss and gradient are multiplied by 0.
        const at::Tensor index = targets.narrow(0, begin, n).clamp_min(0).unsqueeze(1);
        // The same operations as cross_entropy over log_softmax and its backward, in the same
        // order, so that a single chunk gives bitwise the losses and gradients the unchunked
        // reference gives.
        at::Tensor log_probs = at::log_softmax(logits.to(at::kFloat), /*dim=*/1);
        logits.reset();
        const at::Tensor picked = log_probs.gather(1, index).squeeze(1);
        const at::Tensor weight_of_row = keep.to(at::kFloat);
        loss.add_((-picked * weight_of_row).sum());
        if (!grad_h && !grad_w) continue;
        // d(loss) / d(logits) through the backward kernels cross_entropy's own gradient takes
        // (nll: -w at the target with w = counted / count; then log_softmax's), so that a
        // single chunk's gradients are bitwise the reference's.
        at::Tensor grad_log_probs = at::zeros_like(log_probs);
        grad_log_probs.scatter_(1, index, -(weight_of_row / count).unsqueeze(1));
        at::Tensor grad =
            at::_log_softmax_backward_data(grad_log_probs, log_probs, /*dim=*/1, at::kFloat);
        grad_log_probs.reset();
        log_probs.reset();
        grad_c = grad.to(compute);
      }
      if (grad_h) {
        at::Tensor dh_chunk = dh.narrow(0, begin, n);
        if (!fused || !ProductInto(dh_chunk, grad_c, w_c, /*accumulate=*/false)) {
          dh_chunk.copy_(at::matmul(grad_c, w_c));
        }
      }
      if (grad_w) {
        // Fused: grad^T h, which lands in dW's own [vocab, hidden] layout, summed into the
        // float32 dW by the product itself. Composite: (h^T grad)^T, as the backward of h W^T
        // computes it: the same numbers, summed in the same order as the reference.
        if (!fused || !ProductInto(dw, grad_c.t(), h_chunk, /*accumulate=*/true)) {
          dw.add_(fused ? at::matmul(grad_c.t(), h_chunk) : at::matmul(h_chunk.t(), grad_c).t());
        }
      }
    }
    // The padding rows' gradient (zero) is cut off; the first `vocab` rows of a row-major
    // tensor are contiguous.
    if (dw.defined() && padded != vocab) dw = dw.narrow(0, 0, vocab);
    ctx->save_for_backward({dh, dw});
    ctx->saved_data["weight_dtype"] = static_cast<int64_t>(weight.scalar_type());
    return loss.div_(count);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& dh = saved[0];
    const at::Tensor& dw = saved[1];
    const at::Tensor& scale = grads[0];
    const auto weight_dtype =
        static_cast<at::ScalarType>(ctx->saved_data["weight_dtype"].toInt());
    return {dh.defined() ? dh * scale.to(dh.scalar_type()) : at::Tensor(),
            dw.defined() ? (dw * scale.to(at::kFloat)).to(weight_dtype) : at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

torch::Tensor LinearCrossEntropy(const torch::Tensor& h, const torch::Tensor& weight,
                                 const torch::Tensor& targets, int64_t chunk_rows) {
  TORCH_CHECK(h.dim() == 2 && weight.dim() == 2 && h.size(1) == weight.size(1),
              "LinearCrossEntropy: h ", h.sizes(), " and weight ", weight.sizes(),
              " do not multiply");
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == h.size(0), "LinearCrossEntropy: targets ",
              targets.sizes(), " for ", h.size(0), " rows");
  const bool grad = at::GradMode::is_enabled();
  return LinearCrossEntropyFunction::apply(h, weight, targets, chunk_rows,
                                           grad && h.requires_grad(),
                                           grad && weight.requires_grad());
}

bool LinearCrossEntropyProductsIntoFloat32() { return products_into_float32.load(); }

}  // namespace tessera::trainer

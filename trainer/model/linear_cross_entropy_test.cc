// LinearCrossEntropy against the reference it replaces (ATen's linear, then cross_entropy over
// the whole float32 logits): the loss and the gradients of h and of the weight, over several
// chunks, with ignored targets, all targets ignored, a frozen weight, without grad mode, under
// CPU bf16 autocast, and on a GPU (bf16 autocast) when there is one, with the fused
// cross-entropy kernel and without it.
#include "trainer/model/linear_cross_entropy.h"

#include <ATen/autocast_mode.h>

#include <cstdint>

#include "gtest/gtest.h"
#include "trainer/data/data_loader.h"
#include "trainer/kernels/device.h"
#include "trainer/kernels/fused_ops.h"

namespace tessera::trainer {
namespace {

namespace F = torch::nn::functional;

struct Result {
  torch::Tensor loss, dh, dw;
};

Result Reference(const torch::Tensor& h0, const torch::Tensor& w0, const torch::Tensor& targets) {
  torch::Tensor h = h0.detach().clone().requires_grad_(true);
  torch::Tensor w = w0.detach().clone().requires_grad_(true);
  const torch::Tensor losses = F::cross_entropy(
      F::linear(h, w).to(torch::kFloat32), targets,
      F::CrossEntropyFuncOptions().reduction(torch::kNone).ignore_index(kIgnoreTarget));
  const torch::Tensor loss = losses.sum() / (targets != kIgnoreTarget).sum().clamp_min(1);
  loss.backward();
  return {loss.detach(), h.grad(), w.grad()};
}

Result Fused(const torch::Tensor& h0, const torch::Tensor& w0, const torch::Tensor& targets,
             int64_t chunk_rows) {
  torch::Tensor h = h0.detach().clone().requires_grad_(true);
  torch::Tensor w = w0.detach().clone().requires_grad_(true);
  const torch::Tensor loss = LinearCrossEntropy(h, w, targets, chunk_rows);
  loss.backward();
  return {loss.detach(), h.grad(), w.grad()};
}

struct Case {
  torch::Tensor h, w, targets;
};

Case RandomCase(int64_t rows, int64_t hidden, int64_t vocab, torch::Device device) {
  torch::manual_seed(11);
  Case c;
  c.h = torch::randn({rows, hidden}).to(device);
  c.w = (torch::randn({vocab, hidden}) * 0.2).to(device);
  torch::Tensor targets = torch::randint(0, vocab, {rows}, torch::kInt64);
  // Every third row's target is not counted (a masked prompt).
  targets.index_put_({torch::arange(0, rows, 3)}, kIgnoreTarget);
  c.targets = targets.to(device);
  return c;
}

void ExpectClose(const Result& fused, const Result& reference, double tolerance) {
  EXPECT_TRUE(torch::allclose(fused.loss, reference.loss, tolerance, tolerance))
      << fused.loss.item<double>() << " vs " << reference.loss.item<double>();
  EXPECT_TRUE(torch::allclose(fused.dh, reference.dh, tolerance, tolerance))
      << "max |dh diff| " << (fused.dh - reference.dh).abs().max().item<double>();
  EXPECT_TRUE(torch::allclose(fused.dw, reference.dw, tolerance, tolerance))
      << "max |dw diff| " << (fused.dw - reference.dw).abs().max().item<double>();
}

TEST(LinearCrossEntropyTest, MatchesLinearThenCrossEntropyOverSeveralChunks) {
  const Case c = RandomCase(/*rows=*/37, /*hidden=*/16, /*vocab=*/50, torch::kCPU);
  const Result reference = Reference(c.h, c.w, c.targets);
  for (int64_t chunk : {1, 5, 37, 100, 0}) {
    SCOPED_TRACE(chunk);
    ExpectClose(Fused(c.h, c.w, c.targets, chunk), reference, 1e-5);
  }
  // One chunk runs the reference's own kernels in its order: bitwise the same numbers, so that
  // a model's losses and weights do not move when its loss is computed this way.
  const Result one = Fused(c.h, c.w, c.targets, 0);
  EXPECT_TRUE(torch::equal(one.loss, reference.loss));
  EXPECT_TRUE(torch::equal(one.dh, reference.dh));
  EXPECT_TRUE(torch::equal(one.dw, reference.dw));
}

TEST(LinearCrossEntropyTest, NoCountedTargetGivesZeroLossAndZeroGradients) {
  Case c = RandomCase(8, 4, 10, torch::kCPU);
  c.targets.fill_(kIgnoreTarget);
  const Result fused = Fused(c.h, c.w, c.targets, 3);
  EXPECT_EQ(fused.loss.item<double>(), 0.0);
  EXPECT_EQ(fused.dh.abs().max().item<double>(), 0.0);
  EXPECT_EQ(fused.dw.abs().max().item<double>(), 0.0);
  ExpectClose(fused, Reference(c.h, c.w, c.targets), 0);
}

TEST(LinearCrossEntropyTest, AFrozenHeadGetsNoGradientAndNoGradModeComputesOnlyTheLoss) {
  const Case c = RandomCase(12, 8, 20, torch::kCPU);
  const Result reference = Reference(c.h, c.w, c.targets);
  torch::Tensor h = c.h.clone().requires_grad_(true);
  const torch::Tensor frozen = c.w.clone();
  LinearCrossEntropy(h, frozen, c.targets, 5).backward();
  EXPECT_FALSE(frozen.grad().defined());
  EXPECT_TRUE(torch::allclose(h.grad(), reference.dh, 1e-5, 1e-5));

  torch::NoGradGuard no_grad;
  torch::Tensor w = c.w.clone().requires_grad_(true);
  const torch::Tensor loss = LinearCrossEntropy(c.h, w, c.targets, 5);
  EXPECT_FALSE(loss.requires_grad());
  EXPECT_TRUE(torch::allclose(loss, reference.loss, 1e-6, 1e-6));
}

// Under autocast both sides multiply in bf16 (a linear layer's inputs are cast to it) and take
// the softmax in float32; the chunks' weight gradients add up in float32 where the reference
// rounds one product to bf16, hence the tolerance.
TEST(LinearCrossEntropyTest, UnderCpuBf16AutocastMatchesTheReferenceUnderIt) {
  const Case c = RandomCase(64, 32, 40, torch::kCPU);
  at::autocast::set_autocast_enabled(at::kCPU, true);
  at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
  const Result reference = Reference(c.h, c.w, c.targets);
  const Result fused = Fused(c.h, c.w, c.targets, 16);
  at::autocast::set_autocast_enabled(at::kCPU, false);
  at::autocast::clear_cache();
  EXPECT_EQ(fused.dw.scalar_type(), torch::kFloat32);
  ExpectClose(fused, reference, 2e-2);
}

TEST(LinearCrossEntropyTest, CudaBf16MatchesTheReference) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible";
  const Case c = RandomCase(3000, 256, 5000, torch::Device(torch::kCUDA, 0));
  at::autocast::set_autocast_enabled(at::kCUDA, true);
  at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
  const Result reference = Reference(c.h, c.w, c.targets);
  const Result fused = Fused(c.h, c.w, c.targets, 700);
  // The default chunk on the GPU: all 3,000 rows in one.
  const Result one_chunk = Fused(c.h, c.w, c.targets, 0);
  at::autocast::set_autocast_enabled(at::kCUDA, false);
  at::autocast::clear_cache();
  ExpectClose(fused, reference, 2e-2);
  ExpectClose(one_chunk, reference, 2e-2);
  // The chunks' products went straight into the float32 dh and dW.
  EXPECT_TRUE(LinearCrossEntropyProductsIntoFloat32());
  // Float32 on the GPU: as tight as on the CPU.
  ExpectClose(Fused(c.h, c.w, c.targets, 700), Reference(c.h, c.w, c.targets), 1e-4);
}

// The fused kernel by itself (fused_ops.h FusedCrossEntropyRows) against log_softmax and its
// backward, row by row: an odd vocabulary (no row is 16-byte aligned: one-element accesses), the
// same padded and a vocabulary of whole 16-byte packs (16-byte accesses), ignored rows, float32
// and bfloat16 logits, with and without the gradient.
TEST(LinearCrossEntropyTest, CudaFusedRowsMatchLogSoftmaxAndItsBackward) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible";
  const torch::Device gpu(torch::kCUDA, 0);
  torch::manual_seed(5);
  const int64_t rows = 300, vocab = 5001;
  const torch::Tensor base = torch::randn({rows, vocab}).mul_(3).to(gpu);
  torch::Tensor targets = torch::randint(0, vocab, {rows}, torch::kInt64);
  targets.index_put_({torch::arange(0, rows, 4)}, kIgnoreTarget);
  targets = targets.to(gpu);
  const torch::Tensor counted = targets != kIgnoreTarget;
  const torch::Tensor count = counted.sum().to(torch::kFloat);
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    // The reference from the same rounded logits, in float32. Every tensor here is a copy:
    // for float32, to(dtype) would return `base` itself, and the kernel writes in place.
    const torch::Tensor logits32 =
        base.to(dtype).to(torch::kFloat32).detach().clone().requires_grad_(true);
    const torch::Tensor per_row = F::cross_entropy(
        logits32, targets,
        F::CrossEntropyFuncOptions().reduction(torch::kNone).ignore_index(kIgnoreTarget));
    (per_row.sum() / count).backward();
    const double tolerance = dtype == torch::kFloat32 ? 1e-5 : 1e-2;

    torch::Tensor loss_only = base.to(dtype).clone();
    const torch::Tensor untouched = loss_only.clone();
    const std::optional<torch::Tensor> losses =
        FusedCrossEntropyRows(loss_only, targets, count, kIgnoreTarget, /*write_grad=*/false);
    ASSERT_TRUE(losses.has_value());
    EXPECT_TRUE(torch::allclose(*losses, per_row.detach(), 1e-5, 1e-5));
    EXPECT_TRUE(torch::equal(loss_only, untouched)) << "write_grad false changed the logits";

    torch::Tensor logits = base.to(dtype).clone();
    const std::optional<torch::Tensor> with_grad =
        FusedCrossEntropyRows(logits, targets, count, kIgnoreTarget, /*write_grad=*/true);
    ASSERT_TRUE(with_grad.has_value());
    EXPECT_TRUE(torch::allclose(*with_grad, per_row.detach(), 1e-5, 1e-5));
    EXPECT_EQ(logits.scalar_type(), dtype);
    const torch::Tensor grad = logits.to(torch::kFloat32);
    EXPECT_TRUE(torch::allclose(grad, logits32.grad(), tolerance, tolerance * 1e-3))
        << "max difference " << (grad - logits32.grad()).abs().max().item<double>();
    EXPECT_EQ(grad.index({torch::arange(0, rows, 4)}).abs().max().item<double>(), 0.0)
        << "an ignored row got a gradient";

    // Rows padded to 5,056 columns (as LinearCrossEntropy pads them), the padding holding
    // values that would dominate the softmax if it were read: the same losses and gradient,
    // and a zero gradient in the padding. Aligned rows take the kernel's 16-byte accesses
    // (the unpadded ones above its one-element loads), so the sums run in another order: equal
    // to float32 rounding, not bitwise.
    torch::Tensor padded =
        torch::cat({base.to(dtype), torch::full({rows, 55}, 1e4, base.options()).to(dtype)}, 1);
    const std::optional<torch::Tensor> padded_losses = FusedCrossEntropyRows(
        padded, targets, count, kIgnoreTarget, /*write_grad=*/true, /*vocab=*/vocab);
    ASSERT_TRUE(padded_losses.has_value());
    EXPECT_TRUE(torch::allclose(*padded_losses, per_row.detach(), 1e-5, 1e-5));
    const torch::Tensor padded_grad = padded.narrow(1, 0, vocab).to(torch::kFloat32);
    EXPECT_TRUE(torch::allclose(padded_grad, logits32.grad(), tolerance, tolerance * 1e-3))
        << "max difference " << (padded_grad - logits32.grad()).abs().max().item<double>();
    EXPECT_EQ(padded.narrow(1, vocab, 55).abs().max().item<double>(), 0.0);
    EXPECT_EQ(padded_grad.index({torch::arange(0, rows, 4)}).abs().max().item<double>(), 0.0);

    // A vocabulary of whole 16-byte packs without padding (5,000 columns): aligned rows too.
    const int64_t even = 5000;
    const torch::Tensor even_targets =
        targets.clamp_max(even - 1).masked_fill(targets == kIgnoreTarget, kIgnoreTarget);
    const torch::Tensor even32 =
        base.narrow(1, 0, even).to(dtype).to(torch::kFloat32).detach().clone().requires_grad_(true);
    const torch::Tensor even_rows = F::cross_entropy(
        even32, even_targets,
        F::CrossEntropyFuncOptions().reduction(torch::kNone).ignore_index(kIgnoreTarget));
    (even_rows.sum() / count).backward();
    torch::Tensor even_logits = base.narrow(1, 0, even).to(dtype).contiguous().clone();
    const std::optional<torch::Tensor> even_losses =
        FusedCrossEntropyRows(even_logits, even_targets, count, kIgnoreTarget, /*write_grad=*/true);
    ASSERT_TRUE(even_losses.has_value());
    EXPECT_TRUE(torch::allclose(*even_losses, even_rows.detach(), 1e-5, 1e-5));
    EXPECT_TRUE(torch::allclose(even_logits.to(torch::kFloat32), even32.grad(), tolerance,
                                tolerance * 1e-3));
  }
  // Off, or on the CPU, the caller's composite runs.
  torch::Tensor cpu_logits = base.cpu();
  EXPECT_FALSE(FusedCrossEntropyRows(cpu_logits, targets.cpu(), count.cpu(), kIgnoreTarget, true)
                   .has_value());
  SetFusedKernelsEnabled(false);
  torch::Tensor logits = base.clone();
  EXPECT_FALSE(FusedCrossEntropyRows(logits, targets, count, kIgnoreTarget, true).has_value());
  SetFusedKernelsEnabled(true);
}

// LinearCrossEntropy on the GPU with the fused kernel and with the composite (--fused_kernels
// false): both match the reference; no counted target gives zeros on both.
TEST(LinearCrossEntropyTest, CudaFusedAndCompositeChunksBothMatchTheReference) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible";
  const Case c = RandomCase(2000, 128, 5001, torch::Device(torch::kCUDA, 0));
  const Result reference = Reference(c.h, c.w, c.targets);
  for (bool fused : {true, false}) {
    SCOPED_TRACE(fused ? "fused" : "composite");
    SetFusedKernelsEnabled(fused);
    ExpectClose(Fused(c.h, c.w, c.targets, 333), reference, 1e-4);
    const torch::Tensor none = torch::full_like(c.targets, kIgnoreTarget);
    const Result zero = Fused(c.h, c.w, none, 333);
    EXPECT_EQ(zero.loss.item<double>(), 0.0);
    EXPECT_EQ(zero.dh.abs().max().item<double>(), 0.0);
    EXPECT_EQ(zero.dw.abs().max().item<double>(), 0.0);
  }
  SetFusedKernelsEnabled(true);
}

}  // namespace
}  // namespace tessera::trainer

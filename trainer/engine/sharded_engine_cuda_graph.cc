// ShardedEngine's CUDA graph of a micro-batch (cuda_graphs): warm-up, capture, the check of the
// first replay against an eager run, and replay; the flat gradients prepared for accumulation
// and the per-unit gradient norms the check compares.
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#if TESSERA_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "absl/strings/str_cat.h"
#include "trainer/engine/sharded_engine.h"
#include "trainer/engine/sharded_engine_internal.h"

namespace tessera::trainer {

using sharded_engine_internal::AutocastScope;

void ShardedEngine::PrepareGradientsForAccumulation() {
  torch::NoGradGuard no_grad;
  for (Unit& unit : units_) {
    if (!unit.full_grad.defined()) continue;
    unit.full_grad.zero_();
    for (Entry& entry : unit.entries) entry.param.mutable_grad() = GradientView(unit, entry);
  }
  gradients_empty_ = false;
}

std::vector<double> ShardedEngine::GradientSignature() {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> norms;
  for (const Unit& unit : units_) {
    if (!unit.full_grad.defined()) continue;
    norms.push_back(unit.full_grad.abs().sum().to(at::kDouble));
    norms.push_back(unit.full_grad.norm().to(at::kDouble));
  }
  std::vector<double> values;
  if (norms.empty()) return values;
  const at::Tensor all = at::stack(norms).cpu();
  for (int64_t i = 0; i < all.numel(); ++i) values.push_back(all[i].item<double>());
  return values;
}

std::string ShardedEngine::CudaGraphStatus() const { return graph_status_; }

std::optional<at::Tensor> ShardedEngine::GraphForwardBackward(
    [[maybe_unused]] const at::Tensor& inputs, [[maybe_unused]] const at::Tensor& targets,
    [[maybe_unused]] double scale, const at::Tensor& positions) {
#if TESSERA_WITH_CUDA
  CudaGraph& g = *graph_;
  ++g.micro_batches;
  if (g.off || positions.defined()) return std::nullopt;
  if (g.live) {
    if (inputs.sizes() != g.inputs.sizes() || targets.sizes() != g.targets.sizes()) {
      return std::nullopt;  // another shape: eagerly
    }
    if (gradients_empty_) PrepareGradientsForAccumulation();
    torch::NoGradGuard no_grad;
    g.inputs.copy_(inputs, /*non_blocking=*/true);
    g.targets.copy_(targets, /*non_blocking=*/true);
    g.scale.fill_(scale);
    g.graph->replay();
    return g.loss.detach().clone();
  }
  // Warm up; then capture on the first micro-batch of a step, whose gradients start at zero.
  if (g.eager_micro_batches < CudaGraph::kWarmupMicroBatches || !gradients_empty_) {
    ++g.eager_micro_batches;
    return std::nullopt;
  }
  // The micro-batch eagerly, for the check; then zero gradients again for the capture's replay.
  PrepareGradientsForAccumulation();
  const double eager_loss = EagerForwardBackward(inputs, targets, scale, {}).item<double>();
  const std::vector<double> eager_grads = GradientSignature();
  PrepareGradientsForAccumulation();
  std::string why;
  {
    torch::NoGradGuard no_grad;
    g.inputs = inputs.clone();
    g.targets = targets.clone();
    g.scale = at::full({}, scale, inputs.options().dtype(at::kFloat));
  }
  const at::Device device = inputs.device();
  c10::cuda::device_synchronize();
  // Autocast must not cache casts made inside the capture (they would live in its pool).
  const bool autocast_cache = at::autocast::is_autocast_cache_enabled();
  at::autocast::set_autocast_cache_enabled(false);
  try {
    const c10::cuda::CUDAStreamGuard on_side_stream(
        c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index()));
    g.graph = std::make_unique<at::cuda::CUDAGraph>();
    // Thread-local: only this thread's calls are checked. A checkpoint's snapshot thread may be
    // waiting on its device-to-host copy meanwhile, and must not fail (or void the capture) for
    // it; the autograd engine's thread launches backward into the capturing stream either way.
    g.graph->capture_begin(/*pool=*/{0, 0}, cudaStreamCaptureModeThreadLocal);
    try {
      for (Unit& unit : units_) unit.ready = 0;
      {
        AutocastScope autocast(options_.bf16);
        g.loss = model_->Loss(g.inputs, g.targets);
      }
      (g.loss * g.scale).backward();
    } catch (...) {
      try {
        g.graph->capture_end();  // leaves capture mode; fails for an invalidated capture
      } catch (...) {
      }
      throw;
    }
    g.graph->capture_end();
  } catch (const std::exception& e) {
    why = absl::StrCat("the capture failed: ", e.what());
  }
  at::autocast::set_autocast_cache_enabled(autocast_cache);
  c10::cuda::device_synchronize();
  if (why.empty()) {
    g.graph->replay();
    const double graph_loss = g.loss.item<double>();
    const std::vector<double> graph_grads = GradientSignature();
    bool same = std::abs(graph_loss - eager_loss) <= 1e-5 * std::abs(eager_loss) + 1e-7 &&
                graph_grads.size() == eager_grads.size();
    for (size_t i = 0; same && i < eager_grads.size(); ++i) {
      same = std::abs(graph_grads[i] - eager_grads[i]) <= 1e-4 * std::abs(eager_grads[i]) + 1e-12;
    }
    if (same) {
      g.live = true;
      graph_status_ = absl::StrCat("replaying (captured at micro-batch ", g.micro_batches,
                                   "; its replay matched the eager run: loss ", graph_loss, " vs ",
                                   eager_loss, ")");
      return g.loss.detach().clone();
    }
    why = absl::StrCat("the replay differs from the eager run (loss ", graph_loss, " vs ",
                       eager_loss, ", or the gradient norms)");
  }
  // Off for good: this micro-batch again, eagerly.
  g.off = true;
  g.graph.reset();
  g.inputs = g.targets = g.scale = g.loss = at::Tensor();
  graph_status_ = "off: " + why;
  PrepareGradientsForAccumulation();
  return EagerForwardBackward(inputs, targets, scale, {});
#else
  return std::nullopt;
#endif
}

}  // namespace tessera::trainer

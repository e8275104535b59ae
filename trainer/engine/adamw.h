// AdamW that steps each parameter group with ATen's fused AdamW kernel
// (at::_fused_adamw_): on CUDA one multi-tensor kernel per group instead of a
// handful of kernels per parameter, on CPU a vectorized loop. The update is
// torch.optim.AdamW(fused=True)'s: decoupled weight decay, bias-corrected
// moments, no amsgrad.
#pragma once

#include <torch/serialize/archive.h>

#include <cstdint>
#include <vector>

#include "trainer/torch_pch.h"

namespace tessera::trainer {

struct AdamWGroup {
  // Parameters of the group; all on one device, float32.
  std::vector<at::Tensor> params;
  // Decoupled weight decay of the group (0 for biases and norms).
  double weight_decay = 0;
};

struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
};

// Thread safety: one thread at a time (the training loop's).
class FusedAdamW {
 public:
  FusedAdamW(std::vector<AdamWGroup> groups, const AdamWOptions& options);

  // One update at learning rate `lr`. Parameters without a gradient are left
  // alone (and their step counters do not advance).
  void Step(double lr);
  // Drops every gradient (set to undefined, as zero_grad(set_to_none=true)).
  void ZeroGrad();

  // Bytes of optimizer state allocated so far (moments and step counters; created at a
  // parameter's first step).
  int64_t StateBytes() const;

  struct State {
    at::Tensor exp_avg;
    at::Tensor exp_avg_sq;
    // float32 scalar on the parameter's device, as the fused kernel wants.
    at::Tensor step;
  };
  // The state of parameter `index` of group `group`, created (zero moments, step 0) if it has
  // none yet; for callers that save, restore or inspect it slice by slice.
  State& StateFor(size_t group, size_t index);

  // Moments and step counters, keyed by group and position in the group.
  void Save(torch::serialize::OutputArchive& archive) const;
  // The inverse of Save for the same parameter groups; tensors land on each
  // parameter's device. Throws c10::Error when the archive does not match.
  void Load(torch::serialize::InputArchive& archive);

 private:
  std::vector<AdamWGroup> groups_;
  AdamWOptions options_;
  std::vector<std::vector<State>> state_;
};

}  // namespace tessera::trainer

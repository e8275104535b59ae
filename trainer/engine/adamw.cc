#include "trainer/engine/adamw.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace tessera::trainer {

FusedAdamW::FusedAdamW(std::vector<AdamWGroup> groups, const AdamWOptions& options)
    : groups_(std::move(groups)), options_(options) {
  for (const auto& group : groups_) state_.emplace_back(group.params.size());
}

FusedAdamW::State& FusedAdamW::StateFor(size_t group, size_t index) {
  State& state = state_[group][index];
  if (!state.exp_avg.defined()) {
    const at::Tensor& param = groups_[group].params[index];
    state.exp_avg = at::zeros_like(param, at::MemoryFormat::Preserve);
    state.exp_avg_sq = at::zeros_like(param, at::MemoryFormat::Preserve);
    state.step = at::zeros({}, param.options().dtype(at::kFloat));
  }
  return state;
}

void FusedAdamW::Step(double lr) {
  at::NoGradGuard no_grad;
  for (size_t g = 0; g < groups_.size(); ++g) {
    std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
    for (size_t i = 0; i < groups_[g].params.size(); ++i) {
      const at::Tensor& param = groups_[g].params[i];
      if (!param.grad().defined()) continue;
      State& state = StateFor(g, i);
      params.push_back(param);
      grads.push_back(param.grad());
      exp_avgs.push_back(state.exp_avg);
      exp_avg_sqs.push_back(state.exp_avg_sq);
      steps.push_back(state.step);
    }
    if (params.empty()) continue;
    // The kernel reads the incremented step for bias correction.
    at::_foreach_add_(steps, 1);
    at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps, lr,
                      options_.beta1, options_.beta2, groups_[g].weight_decay, options_.eps,
                      /*amsgrad=*/false, /*maximize=*/false);
  }
}

int64_t FusedAdamW::StateBytes() const {
  int64_t bytes = 0;
  for (const auto& group : state_) {
    for (const State& state : group) {
      for (const at::Tensor* t : {&state.exp_avg, &state.exp_avg_sq, &state.step}) {
        if (t->defined()) bytes += static_cast<int64_t>(t->nbytes());
      }
    }
  }
  return bytes;
}

void FusedAdamW::ZeroGrad() {
  for (auto& group : groups_) {
    for (auto& param : group.params) param.mutable_grad().reset();
  }
}

void FusedAdamW::Save(torch::serialize::OutputArchive& archive) const {
  for (size_t g = 0; g < state_.size(); ++g) {
    for (size_t i = 0; i < state_[g].size(); ++i) {
      const State& state = state_[g][i];
      if (!state.exp_avg.defined()) continue;
      std::string key = absl::StrCat("g", g, ".p", i, ".");
      archive.write(key + "exp_avg", state.exp_avg, /*is_buffer=*/true);
      archive.write(key + "exp_avg_sq", state.exp_avg_sq, /*is_buffer=*/true);
      archive.write(key + "step", state.step, /*is_buffer=*/true);
    }
  }
}

void FusedAdamW::Load(torch::serialize::InputArchive& archive) {
  for (size_t g = 0; g < state_.size(); ++g) {
    for (size_t i = 0; i < state_[g].size(); ++i) {
      std::string key = absl::StrCat("g", g, ".p", i, ".");
      at::Tensor exp_avg, exp_avg_sq, step;
      if (!archive.try_read(key + "exp_avg", exp_avg, /*is_buffer=*/true)) continue;
      archive.read(key + "exp_avg_sq", exp_avg_sq, /*is_buffer=*/true);
      archive.read(key + "step", step, /*is_buffer=*/true);
      const at::Tensor& param = groups_[g].params[i];
      TORCH_CHECK(exp_avg.sizes() == param.sizes(), "optimizer state ", key, "exp_avg has shape ",
                  exp_avg.sizes(), " but the parameter has ", param.sizes());
      state_[g][i] = State{.exp_avg = exp_avg.to(param.device()),
                           .exp_avg_sq = exp_avg_sq.to(param.device()),
                           .step = step.to(param.device())};
    }
  }
}

}  // namespace tessera::trainer

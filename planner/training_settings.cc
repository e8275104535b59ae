#include "planner/training_settings.h"

#include "planner/model_config.h"

namespace tessera::planner {

v1::TrainingSettings ResolveTrainingSettings(const v1::JobSpec& spec) {
  const v1::OptimizerSpec& opt = spec.optimizer();
  auto or_default = [](double value, double fallback) { return value > 0 ? value : fallback; };
  v1::TrainingSettings settings;
  settings.set_seed(EffectiveSeed(spec.seed()));
  settings.set_init_std(or_default(spec.model().init_std(), kDefaultInitStd));
  settings.set_adam_beta1(or_default(opt.beta1(), kDefaultAdamBeta1));
  settings.set_adam_beta2(or_default(opt.beta2(), kDefaultAdamBeta2));
  settings.set_adam_epsilon(or_default(opt.epsilon(), kDefaultAdamEpsilon));
  settings.set_weight_decay(opt.weight_decay());
  settings.set_grad_clip_norm(opt.grad_clip_norm());
  settings.set_eval_batches(spec.data().eval_batches() > 0 ? spec.data().eval_batches()
                                                           : kDefaultEvalBatches);
  return settings;
}

v1::Precision ResolvePrecision(v1::Precision requested, bool gpus) {
  if (requested != v1::PRECISION_UNSPECIFIED) return requested;
  return gpus ? v1::PRECISION_BF16 : v1::PRECISION_FP32;
}

bool HasTrainingSettings(const v1::LayoutPlan& plan) {
  // The seed is never 0 once resolved.
  return plan.has_settings() && plan.settings().seed() != 0;
}

}  // namespace tessera::planner

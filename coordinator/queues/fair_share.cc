#include "coordinator/queues/fair_share.h"

#include <algorithm>
#include <cmath>
#include <utility>

namespace tessera::coordinator {

FairShareTracker::FairShareTracker(absl::Duration half_life, absl::Time start)
    : half_life_(half_life), last_(start) {}

void FairShareTracker::Accrue(absl::Time now, const std::map<std::string, Resources>& held) {
  if (now <= last_) return;
  const double elapsed = absl::ToDoubleSeconds(now - last_);
  const double half_life = absl::ToDoubleSeconds(half_life_);
  // Over an interval of length t, old usage decays by d = 2^(-t/h), and a constant holding x
  // adds the integral of x * 2^(-(t-s)/h) ds over [0, t] = x * (1 - d) * h / ln 2.
  const double decay = std::exp2(-elapsed / half_life);
  const double gain = (1 - decay) * half_life / std::log(2.0);
  for (auto& [queue, usage] : usage_) {
    usage.gpu_seconds *= decay;
    usage.cpu_slot_seconds *= decay;
  }
  for (const auto& [queue, resources] : held) {
    if (resources.gpus <= 0 && resources.cpu_slots <= 0) continue;
    DecayedUsage& usage = usage_[queue];
    usage.gpu_seconds += static_cast<double>(std::max<int64_t>(resources.gpus, 0)) * gain;
    usage.cpu_slot_seconds += static_cast<double>(std::max<int64_t>(resources.cpu_slots, 0)) * gain;
  }
  last_ = now;
}

DecayedUsage FairShareTracker::Usage(const std::string& queue) const {
  auto it = usage_.find(queue);
  return it == usage_.end() ? DecayedUsage{} : it->second;
}

double FairShareTracker::Share(const QueueConfig& config, const std::string& queue) const {
  const QueueSpec* spec = config.Find(queue);
  if (spec == nullptr) return 0;
  const Resources total = config.CohortNominal(*spec);
  const DecayedUsage usage = Usage(queue);
  double dominant = 0;
  if (total.gpus > 0) dominant = std::max(dominant, usage.gpu_seconds / total.gpus);
  if (total.cpu_slots > 0) dominant = std::max(dominant, usage.cpu_slot_seconds / total.cpu_slots);
  return dominant / spec->weight;
}

std::map<std::string, double> FairShareTracker::Shares(const QueueConfig& config) const {
  std::map<std::string, double> shares;
  for (const QueueSpec& queue : config.queues) shares[queue.name] = Share(config, queue.name);
  return shares;
}

void FairShareTracker::Restore(absl::Time as_of, std::map<std::string, DecayedUsage> usage) {
  last_ = as_of;
  usage_ = std::move(usage);
}

}  // namespace tessera::coordinator

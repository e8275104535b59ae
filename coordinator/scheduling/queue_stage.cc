#include "coordinator/scheduling/queue_stage.h"

#include <utility>

namespace tessera::coordinator {

FairShareTracker& QueueStage::Tracker(const QueueConfig& config, absl::Time now) {
  if (!fair_share_.has_value()) fair_share_.emplace(config.fair_share_half_life, now);
  fair_share_->set_half_life(config.fair_share_half_life);
  return *fair_share_;
}

void QueueStage::Accrue(absl::Time now, const std::map<std::string, Resources>& queue_use) {
  if (fair_share_.has_value()) fair_share_->Accrue(now, queue_use);
}

QueueStage::Held QueueStage::Admit(const QueueConfig& config,
                                   const std::map<std::string, Resources>& queue_use,
                                   const std::map<std::string, const v1::Job*>& jobs,
                                   std::vector<GangRequest>* requests) const {
  Held held;
  if (requests->empty()) return held;
  std::vector<QueuedRequest> queued;
  queued.reserve(requests->size());
  for (const GangRequest& request : *requests) {
    queued.push_back({.job_id = request.job_id,
                      .queue = CountingQueue(jobs.at(request.job_id)->queue(), config),
                      .priority = request.priority,
                      .submit_order = request.submit_order,
                      .use_gpus = request.use_gpus,
                      .devices = request.world_size});
  }
  const std::map<std::string, double> shares =
      fair_share_.has_value() ? fair_share_->Shares(config) : std::map<std::string, double>{};
  QuotaAdmission admission = AdmitByQuota(config, queue_use, shares, queued);
  for (QueuedRequest& request : queued) {
    if (admission.held.contains(request.job_id)) held.requests.push_back(std::move(request));
  }
  std::erase_if(*requests, [&](const GangRequest& request) {
    return admission.held.contains(request.job_id);
  });
  held.reasons = std::move(admission.held);
  return held;
}

double QueueStage::Share(const QueueConfig& config, const std::string& queue) const {
  return fair_share_.has_value() ? fair_share_->Share(config, queue) : 0;
}

}  // namespace tessera::coordinator

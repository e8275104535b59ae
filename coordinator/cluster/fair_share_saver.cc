#include "coordinator/cluster/fair_share_saver.h"

#include <algorithm>
#include <map>
#include <string>
#include <utility>

#include "coordinator/cluster/cluster_state.h"

namespace tessera::coordinator {

void FairShareSaver::RestoreInto(FairShareTracker* tracker) {
  if (restored_) return;
  absl::StatusOr<std::optional<SavedQueueUsage>> saved = store_->LoadQueueUsage();
  if (!saved.ok()) {
    LogRetried(saved.status(), "loading the queues' saved fair-share usage");
    return;
  }
  restored_ = true;
  if (!saved->has_value()) return;
  std::map<std::string, DecayedUsage> usage;
  for (const auto& [queue, queue_usage] : (*saved)->queues) {
    usage[queue] = {.gpu_seconds = queue_usage.gpu_seconds,
                    .cpu_slot_seconds = queue_usage.cpu_slot_seconds};
  }
  const absl::Time as_of = std::min((*saved)->as_of, tracker->last_observation());
  if (tracker->usage().empty()) {
    tracker->Restore(as_of, std::move(usage));
    return;
  }
  // The saved usage decayed to the tracker's last observation, plus what it accrued since.
  FairShareTracker saved_tracker(tracker->half_life(), as_of);
  saved_tracker.Restore(as_of, std::move(usage));
  saved_tracker.Accrue(tracker->last_observation(), {});
  std::map<std::string, DecayedUsage> merged = saved_tracker.usage();
  for (const auto& [queue, accrued] : tracker->usage()) {
    merged[queue].gpu_seconds += accrued.gpu_seconds;
    merged[queue].cpu_slot_seconds += accrued.cpu_slot_seconds;
  }
  tracker->Restore(tracker->last_observation(), std::move(merged));
}

void FairShareSaver::MaybeSave(absl::Time now, const FairShareTracker& tracker) {
  if (!restored_) return;
  if (last_attempt_.has_value() && now - *last_attempt_ < kSaveInterval) return;
  last_attempt_ = now;
  Save(tracker);
}

void FairShareSaver::Save(const FairShareTracker& tracker) {
  if (!restored_) return;
  SavedQueueUsage saved;
  saved.as_of = tracker.last_observation();
  for (const auto& [queue, usage] : tracker.usage()) {
    saved.queues[queue] = {.gpu_seconds = usage.gpu_seconds,
                           .cpu_slot_seconds = usage.cpu_slot_seconds};
  }
  LogRetried(store_->SaveQueueUsage(saved), "saving the queues' fair-share usage");
}

}  // namespace tessera::coordinator

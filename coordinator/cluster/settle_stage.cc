#include "coordinator/cluster/settle_stage.h"

namespace tessera::coordinator {

std::vector<AttemptFate::Ending> SettleLocked(
    GuardedLedger::Hold& held, AttemptFate& fate, bool count, absl::Time now,
    const absl::flat_hash_set<std::string_view>* active_ids) {
  std::vector<AttemptFate::Ending> endings;
  if (count) fate.ExpireNodesLocked(held, now);
  if (active_ids == nullptr) return endings;
  for (auto& [job_id, allocation] : held->all()) {
    // Placed by the previous pass and not yet stored (its job may still be listed PENDING, or
    // already cancelled): the store stage releases or takes it back first.
    if (allocation.storing) continue;
    if (!active_ids->contains(job_id)) {
      // Cancelled (or ended by a decision already recorded): stop what still runs.
      if (allocation.phase() != Allocation::Phase::kDraining)
        fate.DrainLocked(held, job_id, allocation);
      continue;
    }
    fate.PrepareLocked(held, job_id, allocation, now, &endings);
  }
  return endings;
}

bool FreeEndedLocked(GuardedLedger::Hold& held, AttemptFate& fate,
                     const std::vector<AttemptFate::Ending>& endings,
                     const absl::flat_hash_set<std::string_view>* active_ids) {
  fate.FinishLocked(held, endings);
  if (active_ids == nullptr) return false;
  bool relist = false;
  held->EraseIf([&](const std::string& job_id, const Allocation& allocation) {
    const bool ended = allocation.phase() == Allocation::Phase::kDraining &&
                       allocation.AllNodesEnded() && !allocation.success_pending;
    relist = relist || (ended && active_ids->contains(job_id));
    return ended;
  });
  return relist;
}

}  // namespace tessera::coordinator

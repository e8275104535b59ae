#include "coordinator/cluster/settle_stage.h"

namespace tessera::coordinator {

std::vector<AttemptFate::Ending> SettleLocked(
    ClusterState& state, AttemptFate& fate, bool count, absl::Time now,
    const absl::flat_hash_set<std::string_view>* active_ids) {
  fate.AssertLockHeld();
  std::vector<AttemptFate::Ending> endings;
  if (count) fate.ExpireNodesLocked(now);
  if (active_ids == nullptr) return endings;
  for (auto& [job_id, allocation] : state.allocations.all()) {
    // Placed by the previous pass and not yet stored (its job may still be listed PENDING, or
    // already cancelled): the store stage releases or takes it back first.
    if (allocation.storing) continue;
    if (!active_ids->contains(job_id)) {
      // Cancelled (or ended by a decision already recorded): stop what still runs.
      if (allocation.phase != Allocation::Phase::kDraining) fate.DrainLocked(job_id, allocation);
      continue;
    }
    fate.PrepareLocked(job_id, allocation, now, &endings);
  }
  return endings;
}

bool FreeEndedLocked(ClusterState& state, AttemptFate& fate,
                     const std::vector<AttemptFate::Ending>& endings,
                     const absl::flat_hash_set<std::string_view>* active_ids) {
  fate.AssertLockHeld();
  fate.FinishLocked(endings);
  if (active_ids == nullptr) return false;
  bool relist = false;
  state.allocations.EraseIf([&](const std::string& job_id, const Allocation& allocation) {
    const bool ended = allocation.phase == Allocation::Phase::kDraining &&
                       allocation.AllNodesEnded() && !allocation.success_pending;
    relist = relist || (ended && active_ids->contains(job_id));
    return ended;
  });
  return relist;
}

}  // namespace tessera::coordinator

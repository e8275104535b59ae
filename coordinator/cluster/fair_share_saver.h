// FairShareSaver: keeps the queues' fair-share usage (FairShareTracker, fair_share.h) across
// coordinator restarts in the Store (SaveQueueUsage / LoadQueueUsage). The scheduling pass
// restores the saved usage into its tracker when it creates it, as of the time it was saved, so
// the decay over the downtime applies at the tracker's next Accrue; it saves the usage at most
// once every kSaveInterval of the cluster's clock, and once more when the coordinator stops. A
// coordinator killed without stopping forgets at most kSaveInterval of usage.
//
// Store errors are logged (LogRetried) and never fatal: a failed save is tried again after
// kSaveInterval; a failed load is tried again on the next pass, and nothing is saved until a load
// succeeded, so that a read error never overwrites the saved usage with a fresh start.
//
// Thread safety: none; the owner serializes calls (SchedulingPass holds its pass lock).
#pragma once

#include <optional>

#include "absl/time/time.h"
#include "coordinator/queues/fair_share.h"
#include "coordinator/store/store.h"

namespace tessera::coordinator {

class FairShareSaver {
 public:
  // Fair-share half-lives are hours to days (7 d by default): 30 s of usage lost in a crash moves
  // no share measurably, and one small transaction every 30 s (next to a scheduling pass every
  // 200 ms) costs the store nothing. Saving every pass would add an fsync to each.
  static constexpr absl::Duration kSaveInterval = absl::Seconds(30);

  // `store` must outlive the saver.
  explicit FairShareSaver(Store* store) : store_(store) {}

  // Until a load has succeeded: loads the saved usage into `tracker`. A tracker that has accrued
  // nothing yet takes it as saved (Restore as of the saved time, or of the tracker's last
  // observation if that is earlier: time never goes back), so its next Accrue decays it over the
  // downtime and counts what the queues hold then as held throughout: the allocations a
  // restarted coordinator recovers are jobs whose workers ran on while it was down. A tracker
  // that already accrued usage (an earlier load failed) gets the saved usage decayed to its last
  // observation added to its own.
  void RestoreInto(FairShareTracker* tracker);
  // Saves `tracker`'s usage when kSaveInterval has passed (by `now`) since the previous save or
  // attempt, once the saved usage was restored.
  void MaybeSave(absl::Time now, const FairShareTracker& tracker);
  // Saves `tracker`'s usage now (the coordinator stopping), once the saved usage was restored.
  void Save(const FairShareTracker& tracker);

  bool restored() const { return restored_; }

 private:
  Store* const store_;
  bool restored_ = false;
  std::optional<absl::Time> last_attempt_;
};

}  // namespace tessera::coordinator

// The queue stage of a scheduling pass, with queues configured (--queue_file): each queue's fair
// share accrues what its allocations held since the previous pass (fair_share.h), and the pass's
// gang requests go through quota admission (queue_admission.h) in that light: those their
// queues' quotas hold back leave this pass's placement, with why, and are handed on to quota
// preemption. Without a queue file the pass skips it.
//
// It owns the fair-share tracker between passes; the pass restores the usage saved before a
// restart into it (FairShareSaver, which needs the store) and saves it now and then.
// Thread safety: not thread-safe; the scheduling pass owns one and runs one pass at a time.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "coordinator/queues/fair_share.h"
#include "coordinator/queues/queue_admission.h"
#include "coordinator/queues/queue_config.h"
#include "coordinator/scheduler/scheduler.h"
#include "tessera/v1/job.pb.h"

namespace tessera::coordinator {

class QueueStage {
 public:
  // The requests quota admission held back.
  struct Held {
    // By job id: why ("queue nlp: 30 of 32 GPUs in use, needs 4").
    std::map<std::string, std::string> reasons;
    // As admission saw them, for quota preemption.
    std::vector<QueuedRequest> requests;
  };

  // The tracker, with `config`'s half-life; created at `now` by the first call.
  FairShareTracker& Tracker(const QueueConfig& config, absl::Time now);
  // Adds to each queue's usage what it held (`queue_use`: by queue in force) since the previous
  // pass, as of `now`. Tracker() first.
  void Accrue(absl::Time now, const std::map<std::string, Resources>& queue_use);
  // Quota admission of `requests` (each job's stored queue in `jobs`, mapped to the queue it
  // counts against in `config`), with the queues' use `queue_use` and their fair shares:
  // removes from `requests` those held back, and returns them.
  Held Admit(const QueueConfig& config, const std::map<std::string, Resources>& queue_use,
             const std::map<std::string, const v1::Job*>& jobs,
             std::vector<GangRequest>* requests) const;
  // `queue`'s fair share now (FairShareTracker::Share); 0 before Tracker() was called.
  double Share(const QueueConfig& config, const std::string& queue) const;
  // Null before Tracker() was called.
  const FairShareTracker* tracker() const {
    return fair_share_.has_value() ? &*fair_share_ : nullptr;
  }

 private:
  std::optional<FairShareTracker> fair_share_;
};

}  // namespace tessera::coordinator

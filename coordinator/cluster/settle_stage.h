// The settle stage of the scheduling pass, in two holds of the cluster lock around the store
// writes of AttemptFate (attempt_fate.h): SettleLocked checks liveness (on a counted pass),
// drains the attempts of jobs no longer active and picks the attempts whose end is due;
// FreeEndedLocked, once their ends are stored, applies them and frees the devices of the
// attempts whose every task has ended.
//
// Thread safety: both need the cluster lock: a Hold of the ledger (guarded_ledger.h).
#pragma once

#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/time/time.h"
#include "coordinator/cluster/attempt_fate.h"
#include "coordinator/cluster/cluster_state.h"
#include "coordinator/cluster/guarded_ledger.h"

namespace tessera::coordinator {

// `active_ids`: the ids of the active jobs (Store::ListActiveJobSummaries); null when the listing
// failed, which leaves every allocation as it is. Liveness (a scan of every node) only when
// `count`: the regular passes do it.
std::vector<AttemptFate::Ending> SettleLocked(
    GuardedLedger::Hold& held, AttemptFate& fate, bool count, absl::Time now,
    const absl::flat_hash_set<std::string_view>* active_ids);

// Returns whether a freed allocation belongs to a job still active: it restarts, and the pass
// lists the waiting jobs again so that it can be placed in this pass.
bool FreeEndedLocked(GuardedLedger::Hold& held, AttemptFate& fate,
                     const std::vector<AttemptFate::Ending>& endings,
                     const absl::flat_hash_set<std::string_view>* active_ids);

}  // namespace tessera::coordinator

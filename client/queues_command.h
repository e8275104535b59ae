// `tessera queues`: the coordinator's queues (Coordinator.ListQueues) as a table: each queue's
// cohort, GPUs and CPU slots used against its nominal quota, what it borrows, its waiting and
// placed jobs, its fair share and the preemptions of its jobs. `--output=json` prints the response.
#pragma once

#include <string>

#include "tessera/v1/coordinator_service.pb.h"

namespace tessera::client {

// The table `tessera queues` prints: a header, one line per queue, then where the queues come
// from. Without a queue file the nominal columns read "-" (no quota).
std::string QueuesTable(const v1::ListQueuesResponse& response);

}  // namespace tessera::client

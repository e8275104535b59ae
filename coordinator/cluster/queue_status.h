// Coordinator.ListQueues' answer: the queue configuration in force (queue_file.h) joined with the
// figures of the latest scheduling pass (ClusterStats::queues). Pure conversion, no locks.
#pragma once

#include <map>
#include <string>

#include "coordinator/cluster/cluster_state.h"
#include "coordinator/queues/queue_config.h"
#include "tessera/v1/coordinator_service.pb.h"

namespace tessera::coordinator {

// Every queue of `config`, ordered by name, with its figures from `figures` (zero when a queue
// has none yet, e.g. before the first pass). Without queues (config.implicit()) one queue
// kImplicitQueue without quota, with figures[kImplicitQueue]. Preemptions are summed over reasons.
// `queue_file`: the path the configuration comes from ("" without one).
v1::ListQueuesResponse QueueStatuses(
    const QueueConfig& config, const std::map<std::string, ClusterStats::QueueFigures>& figures,
    const std::string& queue_file);

}  // namespace tessera::coordinator

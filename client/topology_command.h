// `tessera nodes --topology`: the cluster's topology (Coordinator.ListNodes' levels and domains)
// as a tree, highest level first, each domain with its free and total devices (GPUs, or CPU slots
// on a cluster without GPUs; drained and lost nodes' count as neither), then each level's
// figures: domains, wholly free domains, the largest free domain, fragmentation.
#pragma once

#include <string>

#include "tessera/v1/coordinator_service.pb.h"

namespace tessera::client {

std::string TopologyTree(const v1::ListNodesResponse& response);

}  // namespace tessera::client

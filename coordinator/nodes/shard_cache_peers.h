// Which workers keep a copy of a job's checkpoint shards in memory (recovery from peers' memory,
// worker/shard_cache.h): the job's nodes in a ring, each node's ranks replicating to the next
// node's worker, so that losing one node loses no shard; and every node's worker as a place the
// next attempt's ranks may find the previous attempt's shards. Pure: no gRPC, no store.
#pragma once

#include <map>
#include <string>

#include "tessera/v1/node_service.pb.h"

namespace tessera::coordinator {

// Fills TrainerTask.shard_replica_address and shard_cache_peers of every trainer of
// `assignments` (by node id) from `worker_addresses` (node id -> the worker's gRPC address): the
// replica of a node's ranks is the next node of the ring (node ids in order), none for a one-node
// job; the peers are the job's other nodes, the replica first (the rank's own worker looks in its
// own memory before asking them). Nodes without an address are left out of the ring.
void AssignShardCachePeers(const std::map<std::string, std::string>& worker_addresses,
                           std::map<std::string, v1::TaskAssignment>& assignments);

}  // namespace tessera::coordinator

#include "coordinator/nodes/shard_cache_peers.h"

#include <vector>

namespace tessera::coordinator {

void AssignShardCachePeers(const std::map<std::string, std::string>& worker_addresses,
                           std::map<std::string, v1::TaskAssignment>& assignments) {
  std::vector<std::string> ring;
  for (const auto& [node_id, assignment] : assignments) {
    auto address = worker_addresses.find(node_id);
    if (address != worker_addresses.end() && !address->second.empty()) ring.push_back(node_id);
  }
  for (size_t i = 0; i < ring.size(); ++i) {
    const std::string replica =
        ring.size() > 1 ? worker_addresses.at(ring[(i + 1) % ring.size()]) : std::string();
    for (v1::TrainerTask& task : *assignments[ring[i]].mutable_trainers()) {
      task.set_shard_replica_address(replica);
      task.clear_shard_cache_peers();
      // The replica first: it holds this node's ranks' copies when this node's worker lost them.
      for (size_t k = 1; k <= ring.size() - 1; ++k) {
        task.add_shard_cache_peers(worker_addresses.at(ring[(i + k) % ring.size()]));
      }
    }
  }
}

}  // namespace tessera::coordinator

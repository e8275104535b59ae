#include "coordinator/allocation_ledger.h"

#include <algorithm>

namespace tessera::coordinator {
namespace {

bool IsTaskEnded(v1::TaskState state) {
  return state == v1::TASK_STATE_SUCCEEDED || state == v1::TASK_STATE_FAILED ||
         state == v1::TASK_STATE_STOPPED;
}

}  // namespace

std::vector<std::string> Allocation::Nodes() const {
  std::vector<std::string> nodes;
  for (const auto& rank : ranks) {
    if (std::find(nodes.begin(), nodes.end(), rank.node_id()) == nodes.end()) {
      nodes.push_back(rank.node_id());
    }
  }
  return nodes;
}

bool Allocation::NodeEnded(const std::string& node_id) const {
  if (lost_nodes.contains(node_id)) return true;
  auto it = task_states.find(node_id);
  return it != task_states.end() && IsTaskEnded(it->second);
}

bool Allocation::AllNodesEnded() const {
  for (const auto& node : Nodes()) {
    if (!NodeEnded(node)) return false;
  }
  return true;
}

bool Allocation::AllNodesIn(v1::TaskState state) const {
  for (const auto& node : Nodes()) {
    auto it = task_states.find(node);
    if (it == task_states.end() || it->second != state) return false;
  }
  return true;
}

void Allocation::AddFailure(const v1::TrainerFailure& failure, absl::Time now) {
  for (const auto& seen : failures) {
    if (seen.rank() == failure.rank() && seen.node_id() == failure.node_id() &&
        seen.kind() == failure.kind() && seen.message() == failure.message()) {
      return;
    }
  }
  if (failures.empty()) first_failure_time = now;
  failures.push_back(failure);
}

Allocation* AllocationLedger::Find(const std::string& job_id) {
  auto it = allocations_.find(job_id);
  return it == allocations_.end() ? nullptr : &it->second;
}

Allocation& AllocationLedger::Add(const std::string& job_id, Allocation allocation) {
  return allocations_[job_id] = std::move(allocation);
}

UsedResources AllocationLedger::Used() const {
  UsedResources used;
  for (const auto& [job_id, allocation] : allocations_) {
    for (const auto& rank : allocation.ranks) {
      if (rank.gpu_index() >= 0) {
        used.gpus[rank.node_id()].insert(rank.gpu_index());
      } else {
        ++used.cpu_slots[rank.node_id()];
      }
    }
  }
  return used;
}

int AllocationLedger::FreeMasterPort(const std::string& node_id, int base) const {
  std::set<int> held;
  for (const auto& [job_id, allocation] : allocations_) {
    if (allocation.master_node == node_id) held.insert(allocation.master_port);
  }
  int port = base;
  while (held.contains(port)) ++port;
  return port;
}

std::vector<std::string> AllocationLedger::JobsOn(const std::string& node_id) const {
  std::vector<std::string> jobs;
  for (const auto& [job_id, allocation] : allocations_) {
    for (const auto& rank : allocation.ranks) {
      if (rank.node_id() == node_id) {
        jobs.push_back(job_id);
        break;
      }
    }
  }
  return jobs;
}

}  // namespace tessera::coordinator

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
  if (auto it = allocations_.find(job_id); it != allocations_.end()) Unindex(job_id, it->second);
  for (const auto& rank : allocation.ranks) jobs_by_node_[rank.node_id()].insert(job_id);
  return allocations_[job_id] = std::move(allocation);
}

void AllocationLedger::Unindex(const std::string& job_id, const Allocation& allocation) {
  for (const auto& rank : allocation.ranks) {
    auto it = jobs_by_node_.find(rank.node_id());
    if (it == jobs_by_node_.end()) continue;
    it->second.erase(job_id);
    if (it->second.empty()) jobs_by_node_.erase(it);
  }
}

void AllocationLedger::Erase(const std::string& job_id) {
  auto it = allocations_.find(job_id);
  if (it == allocations_.end()) return;
  Unindex(job_id, it->second);
  allocations_.erase(it);
}

size_t AllocationLedger::EraseIf(
    const std::function<bool(const std::string&, const Allocation&)>& pred) {
  size_t erased = 0;
  for (auto it = allocations_.begin(); it != allocations_.end();) {
    if (pred(it->first, it->second)) {
      Unindex(it->first, it->second);
      it = allocations_.erase(it);
      ++erased;
    } else {
      ++it;
    }
  }
  return erased;
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
  if (auto jobs = jobs_by_node_.find(node_id); jobs != jobs_by_node_.end()) {
    for (const auto& job_id : jobs->second) {
      const Allocation& allocation = allocations_.at(job_id);
      if (allocation.master_node == node_id) held.insert(allocation.master_port);
    }
  }
  int port = base;
  while (held.contains(port)) ++port;
  return port;
}

std::vector<std::string> AllocationLedger::JobsOn(const std::string& node_id) const {
  auto it = jobs_by_node_.find(node_id);
  if (it == jobs_by_node_.end()) return {};
  return std::vector<std::string>(it->second.begin(), it->second.end());
}

}  // namespace tessera::coordinator

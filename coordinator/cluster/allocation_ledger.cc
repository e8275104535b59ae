#include "coordinator/cluster/allocation_ledger.h"

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

bool Allocation::HasNode(const std::string& node_id) const {
  return std::any_of(ranks.begin(), ranks.end(),
                     [&](const v1::RankPlacement& rank) { return rank.node_id() == node_id; });
}

int Allocation::NodeCount() const {
  if (node_count_ < 0) node_count_ = static_cast<int>(Nodes().size());
  return node_count_;
}

void Allocation::SetTaskState(const std::string& node_id, v1::TaskState state) {
  if (!HasNode(node_id)) {
    task_states_[node_id] = state;
    return;
  }
  const bool ended_before = NodeEnded(node_id);
  auto [it, inserted] = task_states_.try_emplace(node_id, state);
  if (!inserted) {
    --nodes_in_state_[it->second];
    it->second = state;
  }
  ++nodes_in_state_[state];
  const bool ended = NodeEnded(node_id);
  if (ended != ended_before) nodes_ended_ += ended ? 1 : -1;
}

void Allocation::MarkLost(const std::string& node_id) {
  const bool ended_before = NodeEnded(node_id);
  lost_nodes_.insert(node_id);
  if (!ended_before && HasNode(node_id)) ++nodes_ended_;
}

bool Allocation::NodeEnded(const std::string& node_id) const {
  if (lost_nodes_.contains(node_id)) return true;
  auto it = task_states_.find(node_id);
  return it != task_states_.end() && IsTaskEnded(it->second);
}

bool Allocation::AllNodesEnded() const { return nodes_ended_ == NodeCount(); }

bool Allocation::AllNodesIn(v1::TaskState state) const {
  return nodes_in_state_[state] == NodeCount();
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
  QueueHold& queue = held_by_queue_[allocation.queue];
  ++queue.allocations;
  const std::string* refreshed = nullptr;
  for (const auto& rank : allocation.ranks) {
    jobs_by_node_[rank.node_id()].insert(job_id);
    if (rank.gpu_index() >= 0) {
      ++held_gpus_[rank.node_id()][rank.gpu_index()];
      ++queue.held.gpus;
    } else {
      ++held_cpu_slots_[rank.node_id()];
      ++queue.held.cpu_slots;
    }
    // A node's ranks are adjacent: its entry is rewritten once it has them all (or again, if
    // they are not).
    if (refreshed != nullptr && *refreshed != rank.node_id()) RefreshUsed(*refreshed);
    refreshed = &rank.node_id();
  }
  if (refreshed != nullptr) RefreshUsed(*refreshed);
  return allocations_[job_id] = std::move(allocation);
}

void AllocationLedger::RefreshUsed(const std::string& node_id) {
  auto it = std::lower_bound(
      used_.begin(), used_.end(), node_id,
      [](const UsedResources::Node& node, const std::string& id) { return node.node_id < id; });
  auto gpus = held_gpus_.find(node_id);
  auto slots = held_cpu_slots_.find(node_id);
  const bool holds = gpus != held_gpus_.end() || slots != held_cpu_slots_.end();
  if (it == used_.end() || it->node_id != node_id) {
    if (!holds) return;
    it = used_.insert(it, UsedResources::Node{.node_id = node_id});
  } else if (it->gpu_bits == 0 && it->other_gpus.empty() && it->cpu_slots == 0) {
    --empty_used_;
  }
  it->gpu_bits = 0;
  it->other_gpus.clear();
  if (gpus != held_gpus_.end()) {
    for (const auto& [gpu, holds_of_gpu] : gpus->second) it->AddGpu(gpu);  // ascending
  }
  it->cpu_slots = slots != held_cpu_slots_.end() ? slots->second : 0;
  if (holds) return;
  ++empty_used_;
  if (empty_used_ > 64 && 2 * empty_used_ > used_.size()) {
    std::erase_if(used_, [](const UsedResources::Node& node) {
      return node.gpu_bits == 0 && node.other_gpus.empty() && node.cpu_slots == 0;
    });
    empty_used_ = 0;
  }
}

void AllocationLedger::Unindex(const std::string& job_id, const Allocation& allocation) {
  // The queue and ranks are not changed once added (all() says so), so Add counted these.
  if (auto queue = held_by_queue_.find(allocation.queue); queue != held_by_queue_.end()) {
    for (const auto& rank : allocation.ranks) {
      --(rank.gpu_index() >= 0 ? queue->second.held.gpus : queue->second.held.cpu_slots);
    }
    if (--queue->second.allocations == 0) held_by_queue_.erase(queue);
  }
  for (const auto& rank : allocation.ranks) {
    if (auto it = jobs_by_node_.find(rank.node_id()); it != jobs_by_node_.end()) {
      it->second.erase(job_id);
      if (it->second.empty()) jobs_by_node_.erase(it);
    }
    // Ranks are not changed once added (all() says so), so each was counted by Add.
    if (rank.gpu_index() >= 0) {
      auto node = held_gpus_.find(rank.node_id());
      if (node == held_gpus_.end()) continue;
      auto gpu = node->second.find(rank.gpu_index());
      if (gpu != node->second.end() && --gpu->second == 0) node->second.erase(gpu);
      if (node->second.empty()) held_gpus_.erase(node);
    } else {
      auto node = held_cpu_slots_.find(rank.node_id());
      if (node != held_cpu_slots_.end() && --node->second == 0) held_cpu_slots_.erase(node);
    }
  }
  const std::string* refreshed = nullptr;
  for (const auto& rank : allocation.ranks) {
    if (refreshed != nullptr && *refreshed == rank.node_id()) continue;
    RefreshUsed(rank.node_id());
    refreshed = &rank.node_id();
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
  // A pass asks for this under the cluster lock with thousands of allocations held: a copy of
  // the entries kept by Add and Unindex, less those holding nothing.
  UsedResources used;
  used.nodes.reserve(used_.size() - empty_used_);
  for (const UsedResources::Node& node : used_) {
    if (node.gpu_bits != 0 || !node.other_gpus.empty() || node.cpu_slots != 0) {
      used.nodes.push_back(node);
    }
  }
  return used;
}

int AllocationLedger::FreeMasterPort(const std::string& node_id, int base, int avoid) const {
  std::set<int> held;
  if (auto jobs = jobs_by_node_.find(node_id); jobs != jobs_by_node_.end()) {
    for (const auto& job_id : jobs->second) {
      const Allocation& allocation = allocations_.at(job_id);
      if (allocation.master_node == node_id) held.insert(allocation.master_port);
    }
  }
  if (avoid > 0) held.insert(avoid);
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

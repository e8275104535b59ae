#include "coordinator/nodes/node_registry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "coordinator/auth/auth.h"
#include "google/protobuf/util/time_util.h"

namespace tessera::coordinator {
namespace {

google::protobuf::Timestamp ToProto(absl::Time time) {
  return google::protobuf::util::TimeUtil::NanosecondsToTimestamp(absl::ToUnixNanos(time));
}

std::string HostOf(const std::string& address) {
  size_t colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

}  // namespace

void NodeRegistry::SetTopologyLevels(std::vector<TopologyLevel> levels) {
  absl::MutexLock lock(&mu_);
  topology_ = TopologyIndex(std::move(levels));
}

std::vector<TopologyLevel> NodeRegistry::topology_levels() const {
  absl::MutexLock lock(&mu_);
  return topology_.levels();
}

absl::Status NodeRegistry::Load() {
  ASSIGN_OR_RETURN(auto nodes, store_->ListNodes());
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  for (auto& node : nodes) {
    Entry& entry = Insert(node.node_id());
    entry.node = std::move(node);
    // As stored: a label of a level no longer configured is kept on the record and ignored.
    const std::map<std::string, std::string> labels(entry.node.topology().begin(),
                                                    entry.node.topology().end());
    topology_.Add(entry.node.node_id(), labels);
    liveness_[entry.liveness].last_heartbeat = now;
    Summarize(entry);
    if (outbox_ != nullptr) {
      outbox_->Known(entry.node.node_id(), entry.node.state() == v1::NODE_STATE_LOST);
    }
  }
  return absl::OkStatus();
}

NodeRegistry::Entry& NodeRegistry::Insert(const std::string& node_id) {
  auto [it, inserted] = nodes_.try_emplace(node_id);
  if (inserted) {
    by_id_.emplace(node_id, &it->second);
    it->second.liveness = liveness_.size();
    liveness_.push_back({.entry = &it->second});
  }
  return it->second;
}

NodeRegistry::Entry* NodeRegistry::Lookup(const std::string& node_id) {
  auto it = by_id_.find(node_id);
  return it == by_id_.end() ? nullptr : it->second;
}

const NodeRegistry::Entry* NodeRegistry::Lookup(const std::string& node_id) const {
  auto it = by_id_.find(node_id);
  return it == by_id_.end() ? nullptr : it->second;
}

void NodeRegistry::Summarize(Entry& entry) {
  const v1::Node& node = entry.node;
  NodeCapacity& c = entry.capacity;
  c = NodeCapacity();
  c.node_id = node.node_id();
  c.host = HostOf(node.address());
  c.host_memory_bytes = node.resources().memory_bytes();
  c.total_gpus = node.resources().gpus_size();
  for (const auto& gpu : node.resources().gpus()) {
    c.free_gpus.push_back(gpu.index());
    if (c.gpu_name.empty()) {
      c.gpu_name = gpu.name();
      c.gpu_memory_bytes = gpu.memory_bytes();
    }
  }
  c.total_cpu_slots = node.resources().cpu_slots();
  c.free_cpu_slots = std::max(0, c.total_cpu_slots);
  c.labels.insert(node.labels().begin(), node.labels().end());
  c.topology.insert(node.topology().begin(), node.topology().end());
  // Highest level first: the order ranks are numbered in (scheduler.h).
  const std::vector<TopologyLevel>& levels = topology_.levels();
  for (auto level = levels.rbegin(); level != levels.rend(); ++level) {
    auto domain = c.topology.find(level->name);
    c.topology_path.push_back(domain != c.topology.end() ? domain->second : "");
  }
  c.schedulable = node.state() == v1::NODE_STATE_READY;
  entry.changed = ++generation_;
  Recount(entry);
}

void NodeRegistry::Recount(Entry& entry) {
  Entry::Counted& counted = entry.counted;
  if (counted.added) {
    if (--state_counts_[counted.state] == 0) state_counts_.erase(counted.state);
    gpus_total_ -= counted.gpus;
    cpu_slots_total_ -= counted.cpu_slots;
  }
  counted = {.state = entry.node.state(),
             .gpus = entry.capacity.total_gpus,
             .cpu_slots = entry.capacity.total_cpu_slots,
             .added = true};
  ++state_counts_[counted.state];
  gpus_total_ += counted.gpus;
  cpu_slots_total_ += counted.cpu_slots;
  liveness_[entry.liveness].lost = counted.state == v1::NODE_STATE_LOST;
}

absl::Status NodeRegistry::Persist(const std::string& node_id) {
  if (write_behind_) {
    dirty_.insert(node_id);
    return absl::OkStatus();
  }
  absl::Status status = store_->PutNode(by_id_.at(node_id)->node);
  if (status.ok()) {
    dirty_.erase(node_id);
  } else {
    dirty_.insert(node_id);
  }
  return status;
}

absl::Status NodeRegistry::Flush(const std::string& node_id) {
  absl::MutexLock write_lock(&write_mu_);
  std::vector<v1::Node> writes;
  {
    absl::MutexLock lock(&mu_);
    writes.reserve(dirty_.size());
    for (const auto& id : dirty_) writes.push_back(by_id_.at(id)->node);
    dirty_.clear();
  }
  absl::Status result;
  std::vector<std::string> failed;
  for (const v1::Node& record : writes) {
    absl::Status status = store_->PutNode(record);
    if (status.ok()) continue;
    failed.push_back(record.node_id());
    if (node_id.empty() || record.node_id() == node_id) result.Update(status);
  }
  if (!failed.empty()) {
    absl::MutexLock lock(&mu_);
    // Written again by a later call, unless removed meanwhile.
    for (const auto& id : failed) {
      if (by_id_.contains(id)) dirty_.insert(id);
    }
  }
  return result;
}

absl::Status NodeRegistry::Register(const v1::RegisterNodeRequest& request, bool* returning) {
  const std::string key_sha256 = TokenSha256(request.node_key());
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  if (const Entry* known = Lookup(request.node_id());
      known != nullptr && known->node.state() != v1::NODE_STATE_LOST &&
      // A record from before node keys binds to the first key it sees.
      !known->node.key_sha256().empty() && known->node.key_sha256() != key_sha256) {
    return absl::AlreadyExistsError(absl::StrCat(
        "node ", request.node_id(), " is registered by another worker (", known->node.address(),
        ", heard from ",
        absl::FormatDuration(
            absl::Trunc(now - liveness_[known->liveness].last_heartbeat, absl::Milliseconds(100))),
        " ago) with a different node key; a node id is taken over only once its node is LOST"));
  }
  // The node's place in the topology, checked against the others' with its own old labels out.
  const std::map<std::string, std::string> labels(request.topology().begin(),
                                                  request.topology().end());
  std::map<std::string, std::string> old_labels;
  if (const Entry* known = Lookup(request.node_id()); known != nullptr) {
    old_labels.insert(known->node.topology().begin(), known->node.topology().end());
  }
  topology_.Remove(request.node_id(), old_labels);
  if (absl::Status placed = topology_.Check(request.node_id(), labels); !placed.ok()) {
    topology_.Add(request.node_id(), old_labels);
    return placed;
  }
  topology_.Add(request.node_id(), labels);
  Entry& entry = Insert(request.node_id());
  v1::Node& node = entry.node;
  *returning = !node.node_id().empty();
  node.set_node_id(request.node_id());
  node.set_hostname(request.hostname());
  node.set_address(request.address());
  node.set_state(node.drained() ? v1::NODE_STATE_DRAINING : v1::NODE_STATE_READY);
  *node.mutable_resources() = request.resources();
  node.mutable_labels()->clear();
  for (const auto& [key, value] : request.labels()) (*node.mutable_labels())[key] = value;
  *node.mutable_topology() = request.topology();
  node.set_worker_version(request.worker_version());
  node.set_key_sha256(key_sha256);
  if (!*returning) *node.mutable_register_time() = ToProto(now);
  *node.mutable_last_heartbeat_time() = ToProto(now);
  liveness_[entry.liveness].last_heartbeat = now;
  Summarize(entry);
  if (outbox_ != nullptr) outbox_->Known(request.node_id(), /*lost=*/false);
  return Persist(request.node_id());
}

absl::StatusOr<bool> NodeRegistry::Touch(
    const std::string& node_id, const std::string& key_sha256,
    google::protobuf::RepeatedPtrField<v1::GpuMetrics>* gpu_metrics) {
  absl::MutexLock lock(&mu_);
  auto* const found = Lookup(node_id);
  if (found != nullptr && !found->node.key_sha256().empty() &&
      found->node.key_sha256() != key_sha256) {
    return absl::PermissionDeniedError(
        absl::StrCat("node ", node_id, " registered with another node key"));
  }
  const absl::Time now = clock_->Now();
  if (found == nullptr || found->node.state() == v1::NODE_STATE_LOST) return false;
  Entry& entry = *found;
  liveness_[entry.liveness].last_heartbeat = now;
  *entry.node.mutable_last_heartbeat_time() = ToProto(now);
  entry.node.mutable_gpu_metrics()->Swap(gpu_metrics);
  return true;
}

std::vector<std::pair<std::string, absl::Duration>> NodeRegistry::Expire() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  std::vector<std::pair<std::string, absl::Duration>> lost;
  for (Liveness& live : liveness_) {
    if (live.lost) continue;
    const absl::Duration silence = now - live.last_heartbeat;
    if (silence <= heartbeat_timeout_) continue;
    Entry& entry = *live.entry;
    const std::string& node_id = entry.node.node_id();
    entry.node.set_state(v1::NODE_STATE_LOST);
    Recount(entry);
    entry.capacity.schedulable = false;
    entry.changed = ++generation_;
    if (outbox_ != nullptr) outbox_->Lost(node_id);
    // A failed write leaves the record dirty: Flush (every tick) writes it again.
    Persist(node_id).IgnoreError();
    lost.emplace_back(node_id, silence);
  }
  // In node_id order, as a walk of the entries would give them.
  std::sort(lost.begin(), lost.end());
  return lost;
}

absl::StatusOr<v1::Node> NodeRegistry::SetDrained(const std::string& node_id, bool drained,
                                                  const std::string& reason) {
  absl::MutexLock lock(&mu_);
  Entry* const found = Lookup(node_id);
  if (found == nullptr) return absl::NotFoundError(absl::StrCat("node ", node_id, ": not registered"));
  v1::Node& node = found->node;
  node.set_drained(drained);
  if (drained) {
    node.set_drain_reason(reason);
    *node.mutable_drain_time() = ToProto(clock_->Now());
  } else {
    node.clear_drain_reason();
    node.clear_drain_time();
  }
  if (node.state() != v1::NODE_STATE_LOST) {
    node.set_state(drained ? v1::NODE_STATE_DRAINING : v1::NODE_STATE_READY);
  }
  Summarize(*found);
  RETURN_IF_ERROR(Persist(node_id));
  return node;
}

absl::Status NodeRegistry::CheckRemovable(const std::string& node_id) const {
  const Entry* const found = Lookup(node_id);
  if (found == nullptr) return absl::NotFoundError(absl::StrCat("node ", node_id, ": not registered"));
  if (found->node.state() != v1::NODE_STATE_LOST && !found->node.drained()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "node ", node_id, " is ", v1::NodeState_Name(found->node.state()),
        ": drain it first (tessera nodes drain ", node_id, "), or wait until it is LOST"));
  }
  return absl::OkStatus();
}

absl::Status NodeRegistry::Remove(const std::string& node_id,
                                  absl::FunctionRef<absl::Status()> in_use) {
  absl::MutexLock write_lock(&write_mu_);
  RETURN_IF_ERROR(in_use());
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckRemovable(node_id));
  }
  RETURN_IF_ERROR(store_->DeleteNode(node_id));
  // Checked again: the node may have been undrained (or given work) while its record was deleted;
  // its record is then stored again.
  absl::Status still = in_use();
  absl::MutexLock lock(&mu_);
  if (still.ok()) still = CheckRemovable(node_id);
  if (!still.ok()) {
    if (by_id_.contains(node_id)) Persist(node_id).IgnoreError();
    return still;
  }
  Entry& entry = *by_id_.at(node_id);
  topology_.Remove(node_id, std::map<std::string, std::string>(entry.node.topology().begin(),
                                                               entry.node.topology().end()));
  if (entry.counted.added) {
    if (--state_counts_[entry.counted.state] == 0) state_counts_.erase(entry.counted.state);
    gpus_total_ -= entry.counted.gpus;
    cpu_slots_total_ -= entry.counted.cpu_slots;
  }
  // The last liveness slot takes the removed one's place.
  const size_t slot = entry.liveness;
  if (slot + 1 != liveness_.size()) {
    liveness_[slot] = liveness_.back();
    liveness_[slot].entry->liveness = slot;
  }
  liveness_.pop_back();
  dirty_.erase(node_id);
  if (outbox_ != nullptr) outbox_->Forget(node_id);
  by_id_.erase(node_id);
  nodes_.erase(node_id);  // `entry` dangles from here
  ++generation_;          // Summaries() is rebuilt without it
  return absl::OkStatus();
}

absl::Status NodeRegistry::CheckKey(const std::string& node_id,
                                    const std::string& key_sha256) const {
  absl::MutexLock lock(&mu_);
  auto* const found = Lookup(node_id);
  if (found == nullptr || found->node.key_sha256().empty()) return absl::OkStatus();
  if (found->node.key_sha256() == key_sha256) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat("node ", node_id, " registered with another node key"));
}

bool NodeRegistry::Known(const std::string& node_id) const {
  absl::MutexLock lock(&mu_);
  return by_id_.contains(node_id);
}

bool NodeRegistry::IsLost(const std::string& node_id) const {
  absl::MutexLock lock(&mu_);
  auto* const found = Lookup(node_id);
  return found == nullptr || found->node.state() == v1::NODE_STATE_LOST;
}

bool UsedResources::Node::HoldsGpu(int index) const {
  if (index >= 0 && index < 64) return (gpu_bits >> index) & 1;
  return std::binary_search(other_gpus.begin(), other_gpus.end(), index);
}

void UsedResources::Node::AddGpu(int index) {
  if (index >= 0 && index < 64) {
    gpu_bits |= uint64_t{1} << index;
  } else {
    other_gpus.push_back(index);
  }
}

void UsedResources::Append(const std::string& node_id, const std::set<int>& gpus, int cpu_slots) {
  if (gpus.empty() && cpu_slots == 0) return;
  Node& node = nodes.emplace_back();
  node.node_id = node_id;
  for (int gpu : gpus) node.AddGpu(gpu);  // ascending: the set is
  node.cpu_slots = cpu_slots;
}

UsedResources UsedResources::FromMaps(const std::map<std::string, std::set<int>>& gpus,
                                      const std::map<std::string, int>& cpu_slots) {
  std::set<std::string> ids;
  for (const auto& [node_id, held] : gpus) ids.insert(node_id);
  for (const auto& [node_id, slots] : cpu_slots) ids.insert(node_id);
  UsedResources used;
  const std::set<int> none;
  for (const auto& node_id : ids) {
    auto held = gpus.find(node_id);
    auto slots = cpu_slots.find(node_id);
    used.Append(node_id, held == gpus.end() ? none : held->second,
                slots == cpu_slots.end() ? 0 : slots->second);
  }
  return used;
}

std::map<std::string, std::set<int>> UsedResources::GpuSets() const {
  std::map<std::string, std::set<int>> out;
  for (const Node& node : nodes) {
    if (node.gpu_bits == 0 && node.other_gpus.empty()) continue;
    std::set<int>& held = out[node.node_id];
    for (int i = 0; i < 64; ++i) {
      if ((node.gpu_bits >> i) & 1) held.insert(i);
    }
    held.insert(node.other_gpus.begin(), node.other_gpus.end());
  }
  return out;
}

std::map<std::string, int> UsedResources::CpuSlotCounts() const {
  std::map<std::string, int> out;
  for (const Node& node : nodes) {
    if (node.cpu_slots != 0) out[node.node_id] = node.cpu_slots;
  }
  return out;
}

std::optional<v1::Node> NodeRegistry::Find(const std::string& node_id) const {
  absl::MutexLock lock(&mu_);
  auto* const found = Lookup(node_id);
  if (found == nullptr) return std::nullopt;
  return found->node;
}

std::map<std::string, std::string> NodeRegistry::Addresses(
    const std::vector<std::string>& node_ids) const {
  absl::MutexLock lock(&mu_);
  std::map<std::string, std::string> addresses;
  for (const std::string& node_id : node_ids) {
    if (const Entry* entry = Lookup(node_id); entry != nullptr) {
      addresses[node_id] = entry->node.address();
    }
  }
  return addresses;
}

void NodeRegistry::IdentifyGpus(std::vector<v1::RankPlacement>& ranks) const {
  absl::MutexLock lock(&mu_);
  for (v1::RankPlacement& rank : ranks) {
    if (rank.gpu_index() < 0) continue;
    const Entry* entry = Lookup(rank.node_id());
    if (entry == nullptr) continue;
    for (const v1::GpuDevice& gpu : entry->node.resources().gpus()) {
      if (gpu.index() != rank.gpu_index()) continue;
      rank.set_gpu_uuid(gpu.uuid());
      rank.set_gpu_name(gpu.name());
    }
  }
}

std::vector<NodeCapacity> NodeRegistry::Capacity(const UsedResources& used) const {
  return Subtract(*Summaries().summaries, used);
}

NodeRegistry::Snapshot NodeRegistry::Summaries() const {
  absl::MutexLock lock(&mu_);
  if (summaries_ == nullptr || summaries_generation_ != generation_) {
    auto summaries = std::make_shared<std::vector<NodeCapacity>>();
    summaries->reserve(nodes_.size());
    for (const auto& [node_id, entry] : nodes_) summaries->push_back(entry.capacity);
    summaries_ = std::move(summaries);
    summaries_generation_ = generation_;
  }
  return {.summaries = summaries_, .generation = generation_};
}

uint64_t NodeRegistry::generation() const {
  absl::MutexLock lock(&mu_);
  return generation_;
}

std::vector<NodeCapacity> NodeRegistry::Subtract(const std::vector<NodeCapacity>& summaries,
                                                 const UsedResources& used) {
  std::vector<NodeCapacity> capacity;
  SubtractInto(summaries, used, &capacity);
  return capacity;
}

void NodeRegistry::SubtractInto(const std::vector<NodeCapacity>& summaries,
                                const UsedResources& used, std::vector<NodeCapacity>* capacity) {
  *capacity = summaries;  // element-wise assignment where sizes allow: strings, vectors and maps
                          // keep their storage
  // Both are in node_id order: walk them together instead of a lookup per node.
  auto held = used.nodes.begin();
  for (NodeCapacity& c : *capacity) {
    while (held != used.nodes.end() && held->node_id < c.node_id) ++held;
    if (held == used.nodes.end()) break;
    if (held->node_id != c.node_id) continue;
    std::erase_if(c.free_gpus, [&](int gpu) { return held->HoldsGpu(gpu); });
    if (held->cpu_slots > 0) c.free_cpu_slots = std::max(0, c.total_cpu_slots - held->cpu_slots);
  }
}

bool NodeRegistry::ChangedSince(const std::string& node_id, uint64_t generation) const {
  absl::MutexLock lock(&mu_);
  auto* const found = Lookup(node_id);
  return found == nullptr || found->changed > generation;
}

NodeRegistry::Tally NodeRegistry::Count(const UsedResources& used) const {
  // The totals are kept as nodes change (Recount); only the nodes holding something are looked
  // at. This runs once a second.
  absl::MutexLock lock(&mu_);
  Tally tally;
  tally.nodes = state_counts_;
  tally.gpus_total = gpus_total_;
  tally.cpu_slots_total = cpu_slots_total_;
  for (const UsedResources::Node& held : used.nodes) {
    const Entry* entry = Lookup(held.node_id);
    if (entry == nullptr) continue;
    // Only devices a node registered count as allocated (a rank on an unknown GPU index does
    // not).
    for (int gpu : entry->capacity.free_gpus) tally.gpus_allocated += held.HoldsGpu(gpu);
    const int total = entry->capacity.total_cpu_slots;
    tally.cpu_slots_allocated += total - std::max(0, total - held.cpu_slots);
  }
  return tally;
}

std::vector<TopologyNode> NodeRegistry::TopologyNodes(const UsedResources& used) const {
  absl::MutexLock lock(&mu_);
  bool gpus = false;
  for (const auto& [node_id, entry] : nodes_) gpus = gpus || entry.capacity.total_gpus > 0;
  std::vector<TopologyNode> out;
  out.reserve(nodes_.size());
  auto held = used.nodes.begin();
  for (const auto& [node_id, entry] : nodes_) {
    while (held != used.nodes.end() && held->node_id < node_id) ++held;
    const bool holds = held != used.nodes.end() && held->node_id == node_id;
    const NodeCapacity& c = entry.capacity;
    TopologyNode& node = out.emplace_back();
    node.node_id = node_id;
    node.labels.insert(entry.node.topology().begin(), entry.node.topology().end());
    node.schedulable = c.schedulable;
    if (gpus) {
      node.total = c.total_gpus;
      node.free = c.free_gpus.size();
      if (holds) {
        for (int gpu : c.free_gpus) node.free -= held->HoldsGpu(gpu);
      }
    } else {
      node.total = c.total_cpu_slots;
      node.free = std::max(0, c.total_cpu_slots - (holds ? held->cpu_slots : 0));
    }
  }
  return out;
}

std::vector<v1::Node> NodeRegistry::Nodes() const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::Node> nodes;
  for (const auto& [node_id, entry] : nodes_) nodes.push_back(entry.node);
  return nodes;
}

}  // namespace tessera::coordinator

// NodeRegistry: the coordinator's list of worker nodes and their liveness. It records what each
// node registered (address, GPUs, CPU slots, labels), refreshes it on every heartbeat, declares a
// node LOST once it has been silent for the heartbeat timeout, and tells the order outbox
// (order_outbox.h), which holds each node's orders, which nodes are known and which are lost.
// Store writes of node records that fail are kept as dirty and retried, never dropped. Written
// through (each change stored before the call returns), or, with `write_behind`, only marked dirty:
// the owner takes the changed records (TakeWrites) and stores them after releasing its lock, so
// that no fsync holds it (see ClusterState::WriteNodes).
//
// Not thread-safe: ClusterState holds it; it is used under the cluster lock. Time comes from the
// injected Clock (the cluster's), so tests drive liveness with a SimulatedClock, not sleeps.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "coordinator/nodes/order_outbox.h"
#include "coordinator/scheduler/scheduler.h"
#include "coordinator/store/store.h"
#include "tessera/v1/node_service.pb.h"

namespace tessera::coordinator {

// Devices jobs hold on each node, for NodeRegistry::Capacity: one flat entry per node, in node_id
// order. A pass takes this under the cluster lock with every node busy, so it holds no per-node
// containers for the usual GPU indices (a bit each).
struct UsedResources {
  struct Node {
    std::string node_id;
    uint64_t gpu_bits = 0;        // GPU index i (0 <= i < 64) is held: bit i
    std::vector<int> other_gpus;  // held indices outside 0..63, ascending (not expected)
    int cpu_slots = 0;
    bool HoldsGpu(int index) const;
    // Marks `index` held; indices outside the bits must come in ascending order.
    void AddGpu(int index);
  };
  std::vector<Node> nodes;  // ascending node_id, each at most once, none holding nothing

  // Adds a node's holdings; calls must come in ascending node_id order.
  void Append(const std::string& node_id, const std::set<int>& gpus, int cpu_slots);
  static UsedResources FromMaps(const std::map<std::string, std::set<int>>& gpus,
                                const std::map<std::string, int>& cpu_slots);
  // The same as maps (for tests and messages).
  std::map<std::string, std::set<int>> GpuSets() const;
  std::map<std::string, int> CpuSlotCounts() const;
};

class NodeRegistry {
 public:
  // `store` (must outlive the registry) persists node records; with `write_behind`, only through
  // the owner (TakeWrites), and Remove is replaced by CheckRemovable + DeleteNode + Forget.
  // `clock` (must outlive the registry) times heartbeats, registrations, drains and expiry.
  // `outbox` (may be null; must outlive the registry) is told which nodes are known and lost.
  NodeRegistry(Store* store, absl::Duration heartbeat_timeout, bool write_behind = false,
               Clock* clock = Clock::Real(), OrderOutbox* outbox = nullptr)
      : store_(store),
        clock_(clock),
        heartbeat_timeout_(heartbeat_timeout),
        write_behind_(write_behind),
        outbox_(outbox) {}
  // by_id_ points into nodes_.
  NodeRegistry(const NodeRegistry&) = delete;
  NodeRegistry& operator=(const NodeRegistry&) = delete;

  // Reloads stored nodes; each gets a fresh grace period from now.
  absl::Status Load();

  // Records (or replaces) a node's registration as READY (DRAINING when drained). Returns whether the node was known
  // before. ALREADY_EXISTS when the node is alive (not LOST) under another node key: the id
  // cannot be taken over. Store errors are returned; the node is kept dirty and written again by Flush.
  absl::Status Register(const v1::RegisterNodeRequest& request, bool* returning);

  // OK when `key_sha256` (TokenSha256 of the key a call carries) is that of the key `node_id`
  // registered with (or the node is unknown); PERMISSION_DENIED otherwise: heartbeats and
  // reports carry the key so that a worker cannot speak for another node. The caller hashes the
  // key before it takes the cluster lock.
  absl::Status CheckKey(const std::string& node_id, const std::string& key_sha256) const;

  // A heartbeat from `node_id`: false (and nothing recorded) when the node is unknown or LOST.
  // The node's GPU metrics are swapped with `gpu_metrics` (so a caller can copy them from the
  // request before it takes the cluster lock, and free the old ones after).
  bool Touch(const std::string& node_id,
             google::protobuf::RepeatedPtrField<v1::GpuMetrics>* gpu_metrics);

  // Marks every READY node silent for longer than the heartbeat timeout LOST (the outbox drops
  // its orders) and returns (node_id, silence) of each.
  std::vector<std::pair<std::string, absl::Duration>> Expire();

  // An operator's drain (or undrain, `drained` false): a drained node is not schedulable, and is
  // DRAINING while alive (LOST stays LOST until it registers again). Kept across registrations
  // and stored. NOT_FOUND for an unknown node; a store error is returned and the record is kept
  // dirty (Flush writes it again).
  absl::Status SetDrained(const std::string& node_id, bool drained, const std::string& reason);

  // Forgets a node: its record, queued orders and share of the counts, here and in the store.
  // NOT_FOUND for an unknown node; FAILED_PRECONDITION unless it is LOST or drained (the caller
  // checks that no job holds devices on it). A worker that registers later is a new node.
  absl::Status Remove(const std::string& node_id);

  // Writes the records whose last store write failed; returns the first error. Write-behind: a
  // no-op (the owner's TakeWrites takes them).
  absl::Status Flush();

  // Write-behind: copies of the records changed (or whose write failed) since the last call, in
  // node_id order; they are no longer dirty. The owner stores them, in the order it took them,
  // and hands each one that could not be stored back with WriteFailed.
  std::vector<v1::Node> TakeWrites();
  // Marks `node_id`'s record dirty again (its write failed), unless it was removed meanwhile.
  void WriteFailed(const std::string& node_id);
  // Remove's checks (NOT_FOUND, FAILED_PRECONDITION), without removing anything.
  absl::Status CheckRemovable(const std::string& node_id) const;
  // Remove without the store delete (the owner deleted the record): the node, its orders and its
  // share of the counts leave the registry. NOT_FOUND for an unknown node.
  absl::Status Forget(const std::string& node_id);

  bool Known(const std::string& node_id) const { return by_id_.contains(node_id); }
  bool IsLost(const std::string& node_id) const;
  // The registered node, or null.
  const v1::Node* Find(const std::string& node_id) const;

  // What each node offers, less `used`; LOST nodes are listed but not schedulable. In node_id
  // order. Built from a per-node summary kept with each record (see Entry::capacity), so a pass
  // over 10,000 nodes reads no protos.
  std::vector<NodeCapacity> Capacity(const UsedResources& used) const;

  // Every node's capacity with nothing allocated, in node_id order, shared and immutable: a pass
  // takes it under the owner's lock and subtracts the used devices (Subtract) after releasing it.
  // Rebuilt only after a registration or a state change.
  std::shared_ptr<const std::vector<NodeCapacity>> Summaries() const;
  // `summaries` (in node_id order) less `used`.
  static std::vector<NodeCapacity> Subtract(const std::vector<NodeCapacity>& summaries,
                                            const UsedResources& used);
  // The same into `capacity`, whose elements' storage is reused: a pass that keeps the vector
  // from one pass to the next copies 10,000 nodes without allocating for each.
  static void SubtractInto(const std::vector<NodeCapacity>& summaries, const UsedResources& used,
                           std::vector<NodeCapacity>* capacity);
  // Counts registrations and state changes; a placement computed from Summaries() taken at
  // generation g is still valid on `node_id` unless ChangedSince(node_id, g).
  uint64_t generation() const { return generation_; }
  bool ChangedSince(const std::string& node_id, uint64_t generation) const;

  // Node counts by state and device totals, less `used`: what Capacity would sum to, without
  // building it.
  struct Tally {
    std::map<v1::NodeState, int64_t> nodes;
    int64_t gpus_total = 0, gpus_allocated = 0;
    int64_t cpu_slots_total = 0, cpu_slots_allocated = 0;
  };
  Tally Count(const UsedResources& used) const;
  // The registered node records, in node_id order.
  std::vector<v1::Node> Nodes() const;

 private:
  struct Entry {
    v1::Node node;
    // `node` as the scheduler sees it with nothing allocated (every GPU free, in registration
    // order), kept in step with `node` by Summarize at each registration, load and state change.
    NodeCapacity capacity;
    // generation_ when `capacity` last changed.
    uint64_t changed = 0;
    // This node's slot in liveness_.
    size_t liveness = 0;
    // What this entry adds to the running totals Count reports (Recount keeps them).
    struct Counted {
      v1::NodeState state = v1::NODE_STATE_UNSPECIFIED;
      int64_t gpus = 0, cpu_slots = 0;
      bool added = false;  // whether the totals include it yet
    } counted;
  };
  absl::Status Persist(const std::string& node_id);
  // The entry of `node_id`, made empty when there is none. Entries leave only through Remove.
  Entry& Insert(const std::string& node_id);
  // The entry of `node_id` through by_id_; nullptr when there is none.
  Entry* Lookup(const std::string& node_id);
  const Entry* Lookup(const std::string& node_id) const;
  // Refreshes entry.capacity from entry.node and stamps it with a new generation.
  void Summarize(Entry& entry);
  // Moves the entry's share of the running totals to its current state and device counts, and
  // its liveness slot's `lost` to its state. Runs at every change of a node's state or devices.
  void Recount(Entry& entry);

  Store* store_;
  Clock* const clock_;
  const absl::Duration heartbeat_timeout_;
  const bool write_behind_;
  OrderOutbox* const outbox_;
  // In node_id order, for the walks beside UsedResources (Count, Summaries); looked up through
  // by_id_, since every heartbeat looks its node up several times under the cluster lock, and
  // a lookup in a map of 10,000 ids is about 14 string compares, most of them cache misses.
  std::map<std::string, Entry> nodes_;
  absl::flat_hash_map<std::string, Entry*> by_id_;
  // When each node was last heard from, one slot per entry, packed: Expire reads only this each
  // second (24 bytes a node, in order) under the cluster lock, instead of walking the entries,
  // a few cache misses each.
  struct Liveness {
    absl::Time last_heartbeat;
    Entry* entry = nullptr;
    // entry->node.state() == NODE_STATE_LOST, kept in step by Recount.
    bool lost = false;
  };
  std::vector<Liveness> liveness_;
  // Running totals over every entry, by Recount: nodes by state, registered GPUs and CPU slots.
  // Count reports them without a walk of the nodes.
  std::map<v1::NodeState, int64_t> state_counts_;
  int64_t gpus_total_ = 0, cpu_slots_total_ = 0;
  std::set<std::string> dirty_;
  uint64_t generation_ = 0;
  // Summaries() as of summaries_generation_.
  mutable std::shared_ptr<const std::vector<NodeCapacity>> summaries_;
  mutable uint64_t summaries_generation_ = 0;
};

}  // namespace tessera::coordinator

// NodeRegistry: the coordinator's list of worker nodes and their liveness. It records what each
// node registered (address, GPUs, CPU slots, labels), refreshes it on every heartbeat, declares a
// node LOST once it has been silent for the heartbeat timeout, and tells the order outbox
// (order_outbox.h), which holds each node's orders, which nodes are known and which are lost.
// Store writes of node records that fail are kept as dirty and retried, never dropped. Written
// through (each change stored before the call returns), or, with `write_behind`, only marked dirty
// and stored by Flush, which makes its store writes with the registry's lock released, so that no
// fsync holds up a heartbeat.
//
// Thread safety: the registry owns its lock; every public method may be called from any thread
// and takes it for the call only. Callers hold no lock of the registry's across calls: what a
// caller computes from a registry read is checked again where it matters (a placement computed
// from Snapshot() is re-checked with ChangedSince). Lock order: the cluster's lock (if the caller
// holds one) before the registry's, the registry's before the order outbox's. Time comes from the
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

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "coordinator/nodes/order_outbox.h"
#include "coordinator/scheduler/scheduler.h"
#include "coordinator/scheduler/topology.h"
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
  // `store` (must outlive the registry) persists node records: written through, or with
  // `write_behind` by Flush.
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

  // The cluster's topology levels (topology.h), lowest first: a registration names only these,
  // consistently nested (TopologyIndex). Before Load and the first registration; none by default
  // (a node then names no topology).
  void SetTopologyLevels(std::vector<TopologyLevel> levels) ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<TopologyLevel> topology_levels() const ABSL_LOCKS_EXCLUDED(mu_);

  // Reloads stored nodes; each gets a fresh grace period from now.
  absl::Status Load() ABSL_LOCKS_EXCLUDED(mu_);

  // Records (or replaces) a node's registration as READY (DRAINING when drained). Returns whether
  // the node was known before. ALREADY_EXISTS when the node is alive (not LOST) under another node
  // key: the id cannot be taken over. Written through: store errors are returned (the node is kept
  // dirty and written again by Flush).
  absl::Status Register(const v1::RegisterNodeRequest& request, bool* returning)
      ABSL_LOCKS_EXCLUDED(mu_);

  // OK when `key_sha256` (TokenSha256 of the key a call carries) is that of the key `node_id`
  // registered with (or the node is unknown); PERMISSION_DENIED otherwise: heartbeats and
  // reports carry the key so that a worker cannot speak for another node. The caller hashes the
  // key before the call: the hash is most of the work.
  absl::Status CheckKey(const std::string& node_id, const std::string& key_sha256) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // A heartbeat from `node_id` carrying `key_sha256` (CheckKey's errors): false (and nothing
  // recorded) when the node is unknown or LOST. The node's GPU metrics are swapped with
  // `gpu_metrics` (so a caller can copy them from the request before the call, and free the old
  // ones after).
  absl::StatusOr<bool> Touch(const std::string& node_id, const std::string& key_sha256,
                             google::protobuf::RepeatedPtrField<v1::GpuMetrics>* gpu_metrics)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Marks every READY node silent for longer than the heartbeat timeout LOST (the outbox drops
  // its orders) and returns (node_id, silence) of each, in node_id order.
  std::vector<std::pair<std::string, absl::Duration>> Expire() ABSL_LOCKS_EXCLUDED(mu_);

  // An operator's drain (or undrain, `drained` false): a drained node is not schedulable, and is
  // DRAINING while alive (LOST stays LOST until it registers again). Kept across registrations
  // and stored. NOT_FOUND for an unknown node. Returns the node as it is now; written through, a
  // store error is returned and the record is kept dirty (Flush writes it again).
  absl::StatusOr<v1::Node> SetDrained(const std::string& node_id, bool drained,
                                      const std::string& reason) ABSL_LOCKS_EXCLUDED(mu_);

  // Forgets a node: its record, queued orders and share of the counts, here and in the store.
  // NOT_FOUND for an unknown node; FAILED_PRECONDITION unless it is LOST or drained, or when
  // `in_use` (asked before the store delete and again after it, without the registry's lock)
  // returns an error: the caller's check that no job holds devices on it. The store delete is
  // made without the lock. A worker that registers later is a new node.
  absl::Status Remove(
      const std::string& node_id, absl::FunctionRef<absl::Status()> in_use = [] {
        return absl::OkStatus();
      }) ABSL_LOCKS_EXCLUDED(mu_, write_mu_);

  // Stores the records changed (write-behind) or whose write failed since the last call, in
  // node_id order, with the lock released; a record that cannot be stored is kept dirty for a
  // later call. Returns the status of `node_id`'s write (OK when none was made), or with
  // `node_id` empty the first error. Calls are serialized: a record taken later is stored later,
  // so an older copy never overwrites a newer one.
  absl::Status Flush(const std::string& node_id = "") ABSL_LOCKS_EXCLUDED(mu_, write_mu_);

  bool Known(const std::string& node_id) const ABSL_LOCKS_EXCLUDED(mu_);
  bool IsLost(const std::string& node_id) const ABSL_LOCKS_EXCLUDED(mu_);
  // A copy of the registered node, or nullopt.
  std::optional<v1::Node> Find(const std::string& node_id) const ABSL_LOCKS_EXCLUDED(mu_);
  // The address of each of `node_ids` that is registered.
  std::map<std::string, std::string> Addresses(const std::vector<std::string>& node_ids) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Names each GPU rank's device (RankPlacement.gpu_uuid, gpu_name) from its node's inventory.
  void IdentifyGpus(std::vector<v1::RankPlacement>& ranks) const ABSL_LOCKS_EXCLUDED(mu_);

  // What each node offers, less `used`; LOST nodes are listed but not schedulable. In node_id
  // order. Built from a per-node summary kept with each record (see Entry::capacity), so a pass
  // over 10,000 nodes reads no protos.
  std::vector<NodeCapacity> Capacity(const UsedResources& used) const ABSL_LOCKS_EXCLUDED(mu_);

  // Every node's capacity with nothing allocated, in node_id order, shared and immutable, and
  // the generation it was taken at, read together: a pass subtracts the used devices
  // (Subtract) and checks its placements with ChangedSince(node, generation). Rebuilt only after
  // a registration or a state change.
  struct Snapshot {
    std::shared_ptr<const std::vector<NodeCapacity>> summaries;
    uint64_t generation = 0;
  };
  Snapshot Summaries() const ABSL_LOCKS_EXCLUDED(mu_);
  // `summaries` (in node_id order) less `used`.
  static std::vector<NodeCapacity> Subtract(const std::vector<NodeCapacity>& summaries,
                                            const UsedResources& used);
  // The same into `capacity`, whose elements' storage is reused: a pass that keeps the vector
  // from one pass to the next copies 10,000 nodes without allocating for each.
  static void SubtractInto(const std::vector<NodeCapacity>& summaries, const UsedResources& used,
                           std::vector<NodeCapacity>* capacity);
  // Counts registrations and state changes; a placement computed from Summaries() taken at
  // generation g is still valid on `node_id` unless ChangedSince(node_id, g).
  uint64_t generation() const ABSL_LOCKS_EXCLUDED(mu_);
  bool ChangedSince(const std::string& node_id, uint64_t generation) const ABSL_LOCKS_EXCLUDED(mu_);

  // Node counts by state and device totals, less `used`: what Capacity would sum to, without
  // building it.
  struct Tally {
    std::map<v1::NodeState, int64_t> nodes;
    int64_t gpus_total = 0, gpus_allocated = 0;
    int64_t cpu_slots_total = 0, cpu_slots_allocated = 0;
  };
  Tally Count(const UsedResources& used) const ABSL_LOCKS_EXCLUDED(mu_);
  // The registered node records, in node_id order.
  std::vector<v1::Node> Nodes() const ABSL_LOCKS_EXCLUDED(mu_);
  // Every node's topology labels and devices, less `used` (GPUs, or CPU slots when no node has
  // a GPU), for BuildTopology; in node_id order.
  std::vector<TopologyNode> TopologyNodes(const UsedResources& used) const ABSL_LOCKS_EXCLUDED(mu_);

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
  // Written through: stores the record now (under the lock: only tests and tools write
  // through). Write-behind: marks it dirty for Flush.
  absl::Status Persist(const std::string& node_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The entry of `node_id`, made empty when there is none. Entries leave only through Remove.
  Entry& Insert(const std::string& node_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The entry of `node_id` through by_id_; nullptr when there is none.
  Entry* Lookup(const std::string& node_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const Entry* Lookup(const std::string& node_id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Refreshes entry.capacity from entry.node and stamps it with a new generation.
  void Summarize(Entry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves the entry's share of the running totals to its current state and device counts, and
  // its liveness slot's `lost` to its state. Runs at every change of a node's state or devices.
  void Recount(Entry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Remove's checks of the node itself (NOT_FOUND, FAILED_PRECONDITION).
  absl::Status CheckRemovable(const std::string& node_id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Store* store_;
  Clock* const clock_;
  // Serializes Flush and Remove's store writes. Taken before mu_, and before the cluster's lock
  // (Remove's `in_use` takes it): a caller holding that lock never flushes nor removes.
  absl::Mutex write_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  mutable absl::Mutex mu_;
  const absl::Duration heartbeat_timeout_;
  const bool write_behind_;
  OrderOutbox* const outbox_;
  // In node_id order, for the walks beside UsedResources (Count, Summaries); looked up through
  // by_id_, since every heartbeat looks its node up several times under the registry's lock, and
  // a lookup in a map of 10,000 ids is about 14 string compares, most of them cache misses.
  std::map<std::string, Entry> nodes_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Entry*> by_id_ ABSL_GUARDED_BY(mu_);
  // When each node was last heard from, one slot per entry, packed: Expire reads only this each
  // second (24 bytes a node, in order) under the lock, instead of walking the entries,
  // a few cache misses each.
  struct Liveness {
    absl::Time last_heartbeat;
    Entry* entry = nullptr;
    // entry->node.state() == NODE_STATE_LOST, kept in step by Recount.
    bool lost = false;
  };
  std::vector<Liveness> liveness_ ABSL_GUARDED_BY(mu_);
  // Running totals over every entry, by Recount: nodes by state, registered GPUs and CPU slots.
  // Count reports them without a walk of the nodes.
  std::map<v1::NodeState, int64_t> state_counts_ ABSL_GUARDED_BY(mu_);
  int64_t gpus_total_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t cpu_slots_total_ ABSL_GUARDED_BY(mu_) = 0;
  std::set<std::string> dirty_ ABSL_GUARDED_BY(mu_);
  // The levels and what the registered nodes say of the domains' nesting.
  TopologyIndex topology_ ABSL_GUARDED_BY(mu_);
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  // Summaries() as of summaries_generation_.
  mutable std::shared_ptr<const std::vector<NodeCapacity>> summaries_ ABSL_GUARDED_BY(mu_);
  mutable uint64_t summaries_generation_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace tessera::coordinator

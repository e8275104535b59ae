// The gang scheduler: one pass decides which pending jobs start now on the free capacity of the
// registered nodes, and where each rank runs. It is pure logic (no gRPC, no store, no threads, no
// clock) so the coordinator can call it under its own lock after any change (submission, a job
// ending, a node joining or draining) and tests can drive it with plain structs.
//
// Policy, in the order it is applied:
//
// * Order. Requests are considered by priority (higher first), then submit_order (smaller, i.e.
//   older, first), then job_id so equal keys still give one answer.
// * Strict gangs. A request places all world_size ranks at once or nothing.
// * Eligible nodes. A node is used only when it is schedulable (READY), carries every label of
//   node_selector, and, for GPU requests, has GPUs whose gpu_name contains gpu_type. CPU requests
//   (use_gpus == false) take free_cpu_slots and ignore gpu_type; GPU and CPU slots are separate
//   resources, so a CPU gang never competes with a GPU gang.
// * Tensor-parallel groups. Ranks [k*tp, (k+1)*tp) always share one node, so a node offers
//   floor(free / tp) groups and the leftover slots are useless to this request.
// * Packing. The gang uses as few nodes as possible, and among those the tightest fit: if one
//   node holds the whole gang, the eligible node with the fewest free slots that does is chosen;
//   otherwise the node offering the most groups is filled first and the remainder goes to the
//   tightest node that holds it. Ties go to the smaller node_id. Leaving big nodes whole is what
//   lets the next large gang fit. Ranks are numbered node by node in that order, local_rank counts
//   0.. per node in rank order, GPU indexes are the node's lowest free ones, ascending; CPU ranks
//   get gpu_index -1. master_addr is the host of rank 0's node. On a cluster with topology levels
//   the gang's nodes are numbered domain by domain (their topology_path, highest level first;
//   the packing order within a domain), so consecutive ranks (the neighbours of a data-parallel
//   ring, the stages of a pipeline) cross as few domain boundaries as the nodes allow.
// * Backfill with a reservation. The first request in the order that cannot be placed (the head)
//   reserves the slots it would take if every eligible schedulable node were empty: its placement
//   on TOTAL capacity, by the packing rule above. Because that placement depends only on the
//   nodes' totals, it is the same on every pass while the node set is unchanged, so the head's
//   reservation does not wander. A later request may start only on what is free beyond the
//   reservation (node by node: free minus reserved), so every job it starts ran on slots the head
//   does not need: once the jobs running on reserved slots at the time finish, the head fits, and
//   backfill can never starve it. This is conservative (it does not know run times, so it never
//   lets a backfilled job borrow reserved slots even briefly). Only the head holds a reservation;
//   later blocked requests are backfilled against the remaining capacity and reserve nothing. A
//   request that could not run even on empty schedulable nodes reserves nothing either (it would
//   only idle the cluster); it waits, with a reason, for nodes to join or return.
//
// * Topology. A request with a placement level (JobSpec.placement; levels and a node's domains:
//   topology.h) is packed inside one domain of that level: among the domains whose eligible nodes
//   hold the gang, the one offering the fewest slots (best fit: emptier domains stay whole for
//   larger gangs), ties to the smaller domain name, then by the packing rule inside it. A node
//   naming no domain at the level is a domain of its own. `required`: no domain with room, no
//   placement (its reservation, as the head, is one domain's too); `preferred`: the request is
//   then placed as if it had no level.
//
// Every request not placed gets a reason a person can read; a request that would fit on the free
// capacity but for the reservation names the job it waits behind; one whose required level has
// no domain with room names the level and the largest free domain.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "tessera/v1/job.pb.h"

namespace tessera::coordinator {

// What one node can offer this pass.
struct NodeCapacity {
  std::string node_id;
  // Host part of the worker address; becomes MASTER_ADDR when rank 0 lands here.
  std::string host;
  // GPU indexes not held by any job (any order; duplicates are ignored).
  std::vector<int> free_gpus;
  // E.g. "NVIDIA H100 80GB HBM3"; "" on CPU-only nodes.
  std::string gpu_name;
  // Memory of one GPU as registered; 0 when unknown or CPU-only.
  int64_t gpu_memory_bytes = 0;
  // The node's host memory as registered; 0 when unknown.
  int64_t host_memory_bytes = 0;
  int total_gpus = 0;
  int free_cpu_slots = 0;
  int total_cpu_slots = 0;
  std::map<std::string, std::string> labels;
  // Level -> the domain this node is in there (its --topology labels).
  std::map<std::string, std::string> topology;
  // Its domains from the highest level down ("" where it names none): a gang's ranks are
  // numbered domain by domain in this order.
  std::vector<std::string> topology_path;
  // READY: neither draining nor lost.
  bool schedulable = true;
};

// One pending job attempt.
struct GangRequest {
  std::string job_id;
  // Higher first.
  int priority = 0;
  // FIFO tiebreak within a priority: smaller = older.
  int64_t submit_order = 0;
  // Ranks to place, all at once or none.
  int world_size = 1;
  // False: ranks take CPU slots.
  bool use_gpus = true;
  // Ranks [k*tp, (k+1)*tp) must share one node (one tensor-parallel group).
  int tensor_parallel = 1;
  // Substring of gpu_name to require; "" = any.
  std::string gpu_type;
  // The node must carry all of these labels.
  std::map<std::string, std::string> node_selector;
  // A topology level the gang is kept inside one domain of (Topology above); "" for none.
  std::string placement_level;
  // Whether it must be (JobSpec.placement.required) or is only tried first (preferred).
  bool placement_required = false;
};

// Where one gang runs.
struct GangPlacement {
  std::string job_id;
  // Rank 0..world-1, in rank order: node_id, local_rank (0.. per node, in rank order), gpu_index
  // (-1 for CPU).
  std::vector<v1::RankPlacement> ranks;
  // Host of rank 0's node.
  std::string master_addr;
  // node_id -> host of every node of the gang (where its ranks' peers reach them).
  std::map<std::string, std::string> node_hosts;
};

struct ScheduleResult {
  // Gangs to start now, in scheduling order.
  std::vector<GangPlacement> placed;
  // For every request not placed, keyed by job_id: why, e.g. "needs 8 GPUs, largest free gang is
  // 4" or "waiting behind higher-priority job job-0003 (backfill would delay it)".
  std::map<std::string, std::string> pending_reasons;
};

// Requests with equal keys may use exactly the same nodes: the key covers use_gpus, gpu_type and
// node_selector.
std::string NodeKindKey(const GangRequest& request);

// One scheduling pass: decides which pending gangs start now on the free capacity, by the policy
// above. Pure and deterministic: the result depends on the contents of the inputs, not on their
// order. Node ids must be unique.
ScheduleResult Schedule(std::vector<GangRequest> pending, const std::vector<NodeCapacity>& nodes);

// Why `request` can never run on `nodes` even when all of them are empty (invalid shape, more
// ranks than the matching nodes hold, a tensor-parallel group larger than any node, no node
// matching node_selector or gpu_type); nullopt when it could. Every node given counts, schedulable
// or not, since a draining node may come back; leave out nodes that are gone for good. Used at
// submission to reject with FAILED_PRECONDITION.
std::optional<std::string> Unsatisfiable(const GangRequest& request,
                                         const std::vector<NodeCapacity>& nodes);

}  // namespace tessera::coordinator

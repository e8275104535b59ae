// The cluster's shape: an ordered list of topology levels (lowest first, e.g. nvlink-domain <
// rack < block < zone), each with the bandwidth a group confined to one of its domains gets, and
// each node's domain at each level, from the labels its worker registered with
// (`--topology=rack=r17,block=b3`). A node without a label at a level is a domain of its own there.
//
// TopologyIndex keeps the domains' nesting consistent as nodes register: a rack is in one block,
// whichever of its nodes says so. BuildTopology turns nodes and their free devices into the tree
// `tessera nodes --topology` prints and the figures /metrics exports per level: how many domains,
// the largest free one, and how fragmented the free devices are.
//
// Pure functions and a value type; not thread-safe (the node registry holds the index under its
// lock).
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tessera::coordinator {

struct TopologyLevel {
  std::string name;
  // What a group confined to one domain of this level gets, per device, in GB/s (for the
  // planner's step-time model); 0 when not given.
  double bandwidth_gbps = 0;
};

// "--topology_levels": comma-separated level names, lowest first, each optionally with its
// bandwidth ("nvlink-domain:900,rack:200,block:50,zone"). Empty: no levels. INVALID_ARGUMENT for
// an empty or repeated name, a name that is not [a-z0-9-], or a bad bandwidth.
absl::StatusOr<std::vector<TopologyLevel>> ParseTopologyLevels(absl::string_view flag);

// Checks a node's labels against the levels and the nodes registered before it, and keeps what
// they say of the domains' nesting.
class TopologyIndex {
 public:
  explicit TopologyIndex(std::vector<TopologyLevel> levels = {}) : levels_(std::move(levels)) {}

  const std::vector<TopologyLevel>& levels() const { return levels_; }

  // OK when `labels` can be `node_id`'s: every level is a configured one (a cluster without
  // levels takes none), and each domain the node names sits in the same domain at every higher
  // level the node names as the other nodes of that domain say. INVALID_ARGUMENT naming the node
  // and the label otherwise, e.g. "node n7: topology rack=r17 is in block=b3 (node n2 says so),
  // not block=b4".
  absl::Status Check(const std::string& node_id,
                     const std::map<std::string, std::string>& labels) const;
  // Records (Add) or forgets (Remove) a node's labels, Check'ed before. A node registering again
  // is removed with its old labels first.
  void Add(const std::string& node_id, const std::map<std::string, std::string>& labels);
  void Remove(const std::string& node_id, const std::map<std::string, std::string>& labels);

 private:
  // The labels of configured levels as (level index, domain), lowest level first.
  std::vector<std::pair<size_t, std::string>> Named(
      const std::map<std::string, std::string>& labels) const;

  struct Parent {
    std::string domain;
    std::set<std::string> nodes;  // the nodes that say so
  };
  std::vector<TopologyLevel> levels_;
  // (level index, domain) -> (higher level index -> the domain it sits in there).
  std::map<std::pair<size_t, std::string>, std::map<size_t, Parent>> parents_;
};

// OK when the levels a spec's placement names (JobSpec.placement) are among the cluster's
// `levels`; FAILED_PRECONDITION naming the field and the cluster's levels otherwise. A name that
// is not a level name at all is left to the spec's validation (INVALID_ARGUMENT).
absl::Status CheckPlacementLevels(const std::string& required, const std::string& preferred,
                                  const std::vector<TopologyLevel>& levels);

// A node as BuildTopology sees it.
struct TopologyNode {
  std::string node_id;
  std::map<std::string, std::string> labels;  // level -> domain
  // Devices: its GPUs, or its CPU slots on a cluster without GPUs.
  int64_t free = 0;
  int64_t total = 0;
  // Takes placements (READY): the devices of a node that does not count as neither free nor
  // total.
  bool schedulable = true;
};

// One domain of one level, with what its schedulable nodes hold.
struct TopologyDomain {
  size_t level = 0;  // index into the levels
  std::string domain;
  // The domain it sits in at the next level up: "" at the top level, or where its nodes name
  // none; a node's own domain (its node_id) where the node names neither level.
  std::string parent;
  // Without a label at this level, a node is its own domain: domain = its node_id.
  bool node_only = false;
  int64_t free = 0, total = 0;
  std::vector<std::string> nodes;  // node_ids, ascending
};

// Per level: what a large gang finds.
struct TopologyLevelFigures {
  std::string level;
  int64_t domains = 0;
  // Domains whose devices are all free.
  int64_t whole_free_domains = 0;
  // The most free devices in one domain.
  int64_t largest_free = 0;
  // Free devices in all, and the share of them in domains that are partly used: 0 when every
  // free device sits in a wholly free domain (a large gang can have it), 1 when none does.
  int64_t free = 0;
  double fragmentation = 0;
};

struct TopologyView {
  // Level by level, lowest first; within a level by (parent, domain).
  std::vector<TopologyDomain> domains;
  std::vector<TopologyLevelFigures> levels;
};

TopologyView BuildTopology(const std::vector<TopologyLevel>& levels,
                           const std::vector<TopologyNode>& nodes);

}  // namespace tessera::coordinator

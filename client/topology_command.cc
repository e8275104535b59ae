#include "client/topology_command.h"

#include <map>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tessera::client {
namespace {

struct Tree {
  const v1::ListNodesResponse& response;
  // (level, parent) -> the domains under it, in the response's order.
  std::map<std::pair<int, std::string>, std::vector<const v1::TopologyDomainStatus*>> children;
  std::set<const v1::TopologyDomainStatus*> printed;
  std::string out;

  void Line(int indent, const std::string& name, int64_t free, int64_t total) {
    out += absl::StrFormat("%-44s %6d/%-6d free\n", std::string(indent, ' ') + name, free, total);
  }

  void Print(const v1::TopologyDomainStatus& d, int indent) {
    printed.insert(&d);
    const std::string& level = response.topology_levels(d.level()).name();
    Line(indent,
         d.node_only() ? absl::StrCat("node ", d.domain(), " (no ", level, " label)")
                       : absl::StrCat(level, " ", d.domain()),
         d.free(), d.total());
    if (d.level() == 0) {
      if (d.node_only()) return;
      for (const std::string& node : d.node_ids())
        out += std::string(indent + 2, ' ') + node + "\n";
      return;
    }
    auto below = children.find({d.level() - 1, d.domain()});
    if (below == children.end()) return;
    for (const v1::TopologyDomainStatus* child : below->second) Print(*child, indent + 2);
  }
};

}  // namespace

std::string TopologyTree(const v1::ListNodesResponse& response) {
  if (response.topology_levels().empty()) {
    return "no topology: the coordinator runs without --topology_levels\n";
  }
  bool gpus = false;
  for (const v1::Node& node : response.nodes()) gpus = gpus || node.resources().gpus_size() > 0;
  Tree tree{.response = response};
  for (const v1::TopologyDomainStatus& d : response.topology_domains()) {
    tree.children[{d.level(), d.parent()}].push_back(&d);
  }
  const int top = response.topology_levels_size() - 1;
  tree.out = absl::StrCat("topology, ", gpus ? "GPUs" : "CPU slots", " of ready nodes:\n");
  for (const v1::TopologyDomainStatus& d : response.topology_domains()) {
    if (d.level() == top) tree.Print(d, 2);
  }
  // Domains whose nodes name nothing at the level above: under no domain there.
  for (int level = top - 1; level >= 0; --level) {
    for (const v1::TopologyDomainStatus& d : response.topology_domains()) {
      if (d.level() != level || tree.printed.contains(&d)) continue;
      tree.Print(d, 2);
    }
  }
  tree.out += absl::StrFormat("\n%-16s %8s %11s %13s %8s %14s\n", "level", "domains", "whole free",
                              "largest free", "free", "fragmentation");
  for (const v1::TopologyLevelStatus& level : response.topology_levels()) {
    tree.out += absl::StrFormat("%-16s %8d %11d %13d %8d %14.2f\n", level.name(), level.domains(),
                                level.whole_free_domains(), level.largest_free(), level.free(),
                                level.fragmentation());
  }
  return tree.out;
}

}  // namespace tessera::client

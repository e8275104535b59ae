#include "coordinator/scheduler/topology.h"

#include <algorithm>
#include <set>
#include <tuple>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace tessera::coordinator {
namespace {

bool ValidName(absl::string_view name) {
  if (name.empty()) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return absl::ascii_islower(c) || absl::ascii_isdigit(c) || c == '-';
  });
}

std::string LevelNames(const std::vector<TopologyLevel>& levels) {
  std::vector<std::string> names;
  for (const TopologyLevel& level : levels) names.push_back(level.name);
  return absl::StrJoin(names, " < ");
}

}  // namespace

absl::StatusOr<std::vector<TopologyLevel>> ParseTopologyLevels(absl::string_view flag) {
  std::vector<TopologyLevel> levels;
  if (absl::StripAsciiWhitespace(flag).empty()) return levels;
  std::set<std::string> seen;
  for (absl::string_view item : absl::StrSplit(flag, ',')) {
    item = absl::StripAsciiWhitespace(item);
    TopologyLevel level;
    std::vector<absl::string_view> parts = absl::StrSplit(item, absl::MaxSplits(':', 1));
    level.name = std::string(absl::StripAsciiWhitespace(parts[0]));
    if (!ValidName(level.name)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--topology_levels: level '", level.name,
                       "': a name of lowercase letters, digits and '-' is needed (e.g. rack)"));
    }
    if (!seen.insert(level.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("--topology_levels: level ", level.name, " is given twice"));
    }
    if (parts.size() == 2 &&
        (!absl::SimpleAtod(absl::StripAsciiWhitespace(parts[1]), &level.bandwidth_gbps) ||
         !(level.bandwidth_gbps > 0) || level.bandwidth_gbps > 1e6)) {
      return absl::InvalidArgumentError(absl::StrCat("--topology_levels: level ", level.name,
                                                     ": bandwidth '", parts[1],
                                                     "' is not a number of GB/s > 0"));
    }
    levels.push_back(std::move(level));
  }
  return levels;
}

absl::Status CheckPlacementLevels(const std::string& required, const std::string& preferred,
                                  const std::vector<TopologyLevel>& levels) {
  const std::pair<const char*, const std::string*> named[] = {{"placement.required", &required},
                                                              {"placement.preferred", &preferred}};
  for (const auto& entry : named) {
    const std::string& level = *entry.second;
    if (level.empty() || !ValidName(level)) continue;
    const bool known = std::any_of(levels.begin(), levels.end(),
                                   [&](const TopologyLevel& known) { return known.name == level; });
    if (known) continue;
    std::vector<std::string> names;
    for (const TopologyLevel& known : levels) names.push_back(known.name);
    return absl::FailedPreconditionError(absl::StrCat(
        entry.first, ": '", level, "' is not a topology level of this cluster (",
        names.empty() ? "it has none" : absl::StrCat("its levels: ", absl::StrJoin(names, ", ")),
        "; the coordinator's --topology_levels)"));
  }
  return absl::OkStatus();
}

absl::Status TopologyIndex::Check(const std::string& node_id,
                                  const std::map<std::string, std::string>& labels) const {
  std::vector<std::pair<size_t, std::string>> named;
  for (const auto& [level, domain] : labels) {
    auto it = std::find_if(levels_.begin(), levels_.end(),
                           [name = level](const TopologyLevel& l) { return l.name == name; });
    if (it == levels_.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "node ", node_id, ": topology ", level, "=", domain, ": unknown level ", level,
          levels_.empty() ? " (the coordinator has no --topology_levels)"
                          : absl::StrCat(" (levels: ", LevelNames(levels_), ")")));
    }
    if (domain.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("node ", node_id, ": topology ", level, "=: the domain is empty"));
    }
    named.emplace_back(it - levels_.begin(), domain);
  }
  std::sort(named.begin(), named.end());
  for (size_t a = 0; a < named.size(); ++a) {
    auto known = parents_.find(named[a]);
    if (known == parents_.end()) continue;
    for (size_t b = a + 1; b < named.size(); ++b) {
      auto parent = known->second.find(named[b].first);
      if (parent == known->second.end() || parent->second.domain == named[b].second) continue;
      const std::string& upper = levels_[named[b].first].name;
      return absl::InvalidArgumentError(absl::StrCat(
          "node ", node_id, ": topology ", levels_[named[a].first].name, "=", named[a].second,
          " is in ", upper, "=", parent->second.domain, " (node ", *parent->second.nodes.begin(),
          " says so), not ", upper, "=", named[b].second));
    }
  }
  return absl::OkStatus();
}

std::vector<std::pair<size_t, std::string>> TopologyIndex::Named(
    const std::map<std::string, std::string>& labels) const {
  std::vector<std::pair<size_t, std::string>> named;
  for (size_t i = 0; i < levels_.size(); ++i) {
    if (auto it = labels.find(levels_[i].name); it != labels.end()) {
      named.emplace_back(i, it->second);
    }
  }
  return named;
}

void TopologyIndex::Add(const std::string& node_id,
                        const std::map<std::string, std::string>& labels) {
  const std::vector<std::pair<size_t, std::string>> named = Named(labels);
  for (size_t a = 0; a < named.size(); ++a) {
    for (size_t b = a + 1; b < named.size(); ++b) {
      Parent& parent = parents_[named[a]][named[b].first];
      if (parent.nodes.empty()) parent.domain = named[b].second;
      parent.nodes.insert(node_id);
    }
  }
}

void TopologyIndex::Remove(const std::string& node_id,
                           const std::map<std::string, std::string>& labels) {
  const std::vector<std::pair<size_t, std::string>> named = Named(labels);
  for (size_t a = 0; a < named.size(); ++a) {
    auto known = parents_.find(named[a]);
    if (known == parents_.end()) continue;
    for (size_t b = a + 1; b < named.size(); ++b) {
      auto parent = known->second.find(named[b].first);
      if (parent == known->second.end()) continue;
      parent->second.nodes.erase(node_id);
      if (parent->second.nodes.empty()) known->second.erase(parent);
    }
    if (known->second.empty()) parents_.erase(known);
  }
}

TopologyView BuildTopology(const std::vector<TopologyLevel>& levels,
                           const std::vector<TopologyNode>& nodes) {
  TopologyView view;
  for (size_t l = 0; l < levels.size(); ++l) {
    std::map<std::pair<std::string, std::string>, TopologyDomain> domains;  // (parent, domain)
    std::map<std::string, std::string> parent_of;  // domain -> parent: the first node's
    for (const TopologyNode& node : nodes) {
      auto label = node.labels.find(levels[l].name);
      const bool node_only = label == node.labels.end();
      const std::string domain = node_only ? node.node_id : label->second;
      std::string parent;
      if (l + 1 < levels.size()) {
        if (auto up = node.labels.find(levels[l + 1].name); up != node.labels.end()) {
          parent = up->second;
        } else if (node_only) {
          parent = node.node_id;  // its own domain at both levels
        }
      }
      // Nodes agree on a domain's parent (TopologyIndex); a node that names none joins its
      // domain's.
      auto [known, inserted] = parent_of.emplace(domain, parent);
      if (!inserted && parent.empty()) parent = known->second;
      TopologyDomain& d = domains[{parent, domain}];
      d.level = l;
      d.domain = domain;
      d.parent = parent;
      d.node_only = node_only;
      d.nodes.push_back(node.node_id);
      if (node.schedulable) {
        d.free += node.free;
        d.total += node.total;
      }
    }
    TopologyLevelFigures figures;
    figures.level = levels[l].name;
    int64_t free_in_partial = 0;
    for (auto& [key, d] : domains) {
      std::sort(d.nodes.begin(), d.nodes.end());
      ++figures.domains;
      figures.free += d.free;
      figures.largest_free = std::max(figures.largest_free, d.free);
      if (d.total > 0 && d.free == d.total) {
        ++figures.whole_free_domains;
      } else {
        free_in_partial += d.free;
      }
      view.domains.push_back(std::move(d));
    }
    figures.fragmentation =
        figures.free > 0 ? static_cast<double>(free_in_partial) / figures.free : 0.0;
    view.levels.push_back(std::move(figures));
  }
  return view;
}

}  // namespace tessera::coordinator

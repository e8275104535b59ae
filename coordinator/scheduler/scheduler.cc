#include "coordinator/scheduler/scheduler.h"

#include <algorithm>
#include <limits>
#include <map>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tessera::coordinator {
namespace {

// Tensor-parallel groups a gang puts on one node. `node` indexes the node vector, which Schedule
// sorts by node_id, so a smaller index is a smaller id.
struct Share {
  int node = 0;
  int groups = 0;
};

// What the capacity in a shortfall message means; the wording must say which, or a person reads
// "largest node has 4" and wonders why a node with 8 GPUs does not count.
enum class Basis { kFree, kEmptySchedulable, kEmptyAll };

std::string Amount(const GangRequest& request, int count) {
  if (!request.use_gpus) return absl::StrCat(count, count == 1 ? " CPU slot" : " CPU slots");
  std::string text = absl::StrCat(count, count == 1 ? " GPU" : " GPUs");
  if (!request.gpu_type.empty()) absl::StrAppend(&text, " of type ", request.gpu_type);
  return text;
}

std::string FormatLabels(const std::map<std::string, std::string>& labels) {
  return absl::StrCat("{", absl::StrJoin(labels, ", ", absl::PairFormatter("=")), "}");
}

std::optional<std::string> ShapeProblem(const GangRequest& request) {
  if (request.world_size < 1) {
    return absl::StrCat("world_size must be at least 1, got ", request.world_size);
  }
  if (request.tensor_parallel < 1) {
    return absl::StrCat("tensor_parallel must be at least 1, got ", request.tensor_parallel);
  }
  if (request.world_size % request.tensor_parallel != 0) {
    return absl::StrCat("tensor_parallel ", request.tensor_parallel, " does not divide world_size ",
                        request.world_size);
  }
  return std::nullopt;
}

bool CarriesLabels(const NodeCapacity& node, const std::map<std::string, std::string>& selector) {
  for (const auto& [key, value] : selector) {
    auto it = node.labels.find(key);
    if (it == node.labels.end() || it->second != value) return false;
  }
  return true;
}

// Capacity when empty. A node may report more free than total if its report raced a change;
// trusting the larger keeps the reservation from being smaller than what is visibly there.
int TotalSlots(const GangRequest& request, const NodeCapacity& node) {
  if (request.use_gpus) {
    return std::max(node.total_gpus, static_cast<int>(node.free_gpus.size()));
  }
  return std::max(node.total_cpu_slots, node.free_cpu_slots);
}

bool HasResource(const GangRequest& request, const NodeCapacity& node) {
  if (TotalSlots(request, node) <= 0) return false;
  if (!request.use_gpus || request.gpu_type.empty()) return true;
  return node.gpu_name.find(request.gpu_type) != std::string::npos;
}

// Fills `eligible` with the indexes of the nodes the request may use, or says why there are none.
std::optional<std::string> NoEligibleNode(const GangRequest& request,
                                          const std::vector<NodeCapacity>& nodes,
                                          bool schedulable_only, std::vector<int>* eligible) {
  const char* kind = schedulable_only ? "schedulable node" : "node";
  bool any_node = false;
  bool any_labelled = false;
  for (int i = 0; i < static_cast<int>(nodes.size()); ++i) {
    const NodeCapacity& node = nodes[i];
    if (schedulable_only && !node.schedulable) continue;
    any_node = true;
    if (!CarriesLabels(node, request.node_selector)) continue;
    any_labelled = true;
    if (HasResource(request, node)) eligible->push_back(i);
  }
  if (!eligible->empty()) return std::nullopt;
  if (!any_node) {
    return schedulable_only ? "no schedulable node (all draining or lost)" : "no node registered";
  }
  if (!any_labelled) {
    return absl::StrCat("no ", kind, " carries labels ", FormatLabels(request.node_selector));
  }
  std::string where = schedulable_only ? " on a schedulable node" : " registered";
  if (!request.node_selector.empty()) {
    absl::StrAppend(&where, " with labels ", FormatLabels(request.node_selector));
  }
  if (request.use_gpus && !request.gpu_type.empty()) {
    return absl::StrCat("needs ", Amount(request, request.world_size), ", none", where);
  }
  return absl::StrCat("needs ", Amount(request, request.world_size), ", no ",
                      request.use_gpus ? "GPUs" : "CPU slots", where);
}

// What a request with tensor-parallel groups of `group` can get from `offers`.
struct OfferSummary {
  int largest_node = 0;  // most slots on one node
  int gang = 0;          // slots usable in whole groups
};

// The slots (GPUs or CPU slots, whichever the request uses) a set of nodes offers, bucketed by slot
// count. Schedule keeps one per kind of node up to date as a pass commits gangs and reserves for
// its head: a placement then costs the nodes it touches, not a rescan of every eligible node, and
// Pack's tightest and largest nodes are the first of a bucket.
class OfferIndex {
 public:
  // `max_slots`: no offer exceeds it.
  explicit OfferIndex(int max_slots) : buckets_(max_slots + 1) {}

  // Nodes must be added in ascending order (the eligible list is).
  void Add(int node, int slots) { buckets_[slots].push_back(node); }
  void Move(int node, int from, int to) {
    if (from == to) return;
    std::vector<int>& source = buckets_[from];
    source.erase(std::lower_bound(source.begin(), source.end(), node));
    std::vector<int>& target = buckets_[to];
    target.insert(std::lower_bound(target.begin(), target.end(), node), node);
  }

  // What a request with tensor-parallel groups of `group` can get from these offers.
  OfferSummary Summary(int group) const {
    OfferSummary summary;
    for (int slots = static_cast<int>(buckets_.size()) - 1; slots >= 0; --slots) {
      if (buckets_[slots].empty()) continue;
      if (summary.largest_node == 0) summary.largest_node = slots;
      summary.gang += static_cast<int>(buckets_[slots].size()) * (slots / group * group);
    }
    return summary;
  }

  // The packing rule of scheduler.h on these offers: fewest nodes, tightest fit, ties to the
  // smaller node index. Greedy largest-first reaches the minimum node count because after taking
  // the j largest nodes the remainder fits one node exactly when the j+1 largest would have
  // covered the gang. nullopt when the offers hold too few whole groups.
  std::optional<std::vector<Share>> Pack(const GangRequest& request) const {
    const int group = request.tensor_parallel;
    int needed = request.world_size / group;
    if (Summary(group).gang / group < needed) return std::nullopt;
    const int size = static_cast<int>(buckets_.size());
    std::vector<int> taken;
    // The smallest node with `slots` free that the gang does not use yet; -1 when none.
    auto first = [&](int slots) {
      for (int node : buckets_[slots]) {
        if (std::find(taken.begin(), taken.end(), node) == taken.end()) return node;
      }
      return -1;
    };
    std::vector<Share> shares;
    while (needed > 0) {
      // The tightest node that holds the rest: fewest slots, then the smaller index.
      for (int slots = needed * group; slots < size; ++slots) {
        if (const int node = first(slots); node >= 0) {
          shares.push_back({node, needed});
          return shares;
        }
      }
      // Otherwise the node with the most groups; among equals, the fewest slots, then the
      // smaller index. The summary above guarantees there is one.
      int groups = 0;
      for (int slots = size - 1; slots >= group && groups == 0; --slots) {
        if (first(slots) >= 0) groups = slots / group;
      }
      for (int slots = groups * group; slots < size; ++slots) {
        if (const int node = first(slots); node >= 0) {
          shares.push_back({node, groups});
          taken.push_back(node);
          needed -= groups;
          break;
        }
      }
    }
    return shares;
  }

 private:
  // Slot count -> nodes offering that many, ascending. Sorted vectors: a pass builds one per
  // kind of node over every eligible node, and moves only a few nodes per placement.
  std::vector<std::vector<int>> buckets_;
};

// What the `eligible` nodes (ascending) offer `request` when empty.
OfferIndex EmptyOffers(const GangRequest& request, const std::vector<NodeCapacity>& nodes,
                       const std::vector<int>& eligible) {
  int max_slots = 0;
  for (int node : eligible) max_slots = std::max(max_slots, TotalSlots(request, nodes[node]));
  OfferIndex offers(max_slots);
  for (int node : eligible) offers.Add(node, TotalSlots(request, nodes[node]));
  return offers;
}

// Why Pack failed on offers summarised by `summary` (non-empty eligible nodes), in the terms of
// `basis`.
std::string Shortfall(const GangRequest& request, const OfferSummary& summary, Basis basis) {
  const int group = request.tensor_parallel;
  const int largest_node = summary.largest_node;
  const int gang = summary.gang;
  if (group > 1 && largest_node < group) {
    const char* largest_text =
        basis == Basis::kEmptySchedulable ? "largest schedulable node has " : "largest node has ";
    return absl::StrCat("tensor_parallel ", group, " needs ", Amount(request, group),
                        " on one node, ", largest_text, largest_node,
                        basis == Basis::kFree ? " free" : "");
  }
  std::string needs = absl::StrCat("needs ", Amount(request, request.world_size));
  if (group > 1) absl::StrAppend(&needs, " in tensor_parallel groups of ", group);
  switch (basis) {
    case Basis::kFree:
      return absl::StrCat(needs, ", largest free gang is ", gang);
    case Basis::kEmptySchedulable:
      return absl::StrCat(needs, ", schedulable nodes hold at most ", gang, " even when empty");
    case Basis::kEmptyAll:
      break;
  }
  return absl::StrCat(needs, ", matching nodes hold at most ", gang);
}

// Working copy of one node's free slots during a pass.
struct NodeState {
  std::vector<int> free_gpus;  // ascending, unique
  int free_cpu_slots = 0;
  int reserved_gpus = 0;  // held for the head request
  int reserved_cpu_slots = 0;

  int Free(bool gpus) const { return gpus ? static_cast<int>(free_gpus.size()) : free_cpu_slots; }
  int Reserved(bool gpus) const { return gpus ? reserved_gpus : reserved_cpu_slots; }
};

GangPlacement Commit(const GangRequest& request, std::vector<Share> shares,
                     const std::vector<NodeCapacity>& nodes, std::vector<NodeState>& states) {
  // Domain by domain, highest level first (scheduler.h); the packing order within one.
  std::stable_sort(shares.begin(), shares.end(), [&](const Share& a, const Share& b) {
    return nodes[a.node].topology_path < nodes[b.node].topology_path;
  });
  GangPlacement placement;
  placement.job_id = request.job_id;
  placement.master_addr = nodes[shares.front().node].host;
  int rank = 0;
  for (const Share& share : shares) {
    NodeState& state = states[share.node];
    placement.node_hosts[nodes[share.node].node_id] = nodes[share.node].host;
    const int count = share.groups * request.tensor_parallel;
    for (int local_rank = 0; local_rank < count; ++local_rank) {
      v1::RankPlacement& placed = placement.ranks.emplace_back();
      placed.set_rank(rank++);
      placed.set_node_id(nodes[share.node].node_id);
      placed.set_local_rank(local_rank);
      placed.set_gpu_index(request.use_gpus ? state.free_gpus[local_rank] : -1);
    }
    if (request.use_gpus) {
      state.free_gpus.erase(state.free_gpus.begin(), state.free_gpus.begin() + count);
    } else {
      state.free_cpu_slots -= count;
    }
  }
  return placement;
}

// The domain `node` is in at `level`: its label there, or the node itself when it names none.
std::string DomainOf(const NodeCapacity& node, const std::string& level) {
  auto it = node.topology.find(level);
  return it != node.topology.end() ? it->second : absl::StrCat("node ", node.node_id);
}

// The largest domain of a level for a request: its name and the slots it offers in whole groups.
struct LargestDomain {
  std::string domain;
  int gang = 0;
};

// `request` packed inside one domain of its placement level, on `slots_of(node)` slots of each
// `eligible` node (ascending; no more than `max_slots` each): among the domains whose nodes hold
// the gang, the one offering the fewest slots, ties to the smaller name (Topology in
// scheduler.h). nullopt when no domain holds it; `largest` (when given) gets the domain offering
// the most whole groups.
template <typename SlotsOf>
std::optional<std::vector<Share>> PackInOneDomain(const GangRequest& request,
                                                  const std::vector<NodeCapacity>& nodes,
                                                  const std::vector<int>& eligible,
                                                  const SlotsOf& slots_of, int max_slots,
                                                  LargestDomain* largest) {
  std::map<std::string, std::vector<int>> domains;
  for (int node : eligible) {
    domains[DomainOf(nodes[node], request.placement_level)].push_back(node);
  }
  const int group = request.tensor_parallel;
  std::optional<std::vector<Share>> best;
  int64_t best_slots = std::numeric_limits<int64_t>::max();
  for (const auto& [domain, members] : domains) {
    OfferIndex offers(max_slots);
    int64_t slots = 0;
    for (int node : members) {
      const int offered = std::min(max_slots, std::max(0, slots_of(node)));
      offers.Add(node, offered);
      slots += offered;
    }
    const OfferSummary summary = offers.Summary(group);
    if (largest != nullptr && summary.gang > largest->gang) *largest = {domain, summary.gang};
    if (summary.gang < request.world_size || slots >= best_slots) continue;
    if (auto shares = offers.Pack(request)) {
      best = std::move(shares);
      best_slots = slots;
    }
  }
  return best;
}

// Why no domain of the request's required level holds it, in the terms of `basis`.
std::string DomainShortfall(const GangRequest& request, const LargestDomain& largest, Basis basis) {
  std::string text = absl::StrCat("needs ", Amount(request, request.world_size), " inside one ",
                                  request.placement_level, " (placement.required)");
  if (largest.domain.empty())
    return absl::StrCat(text, "; no ", request.placement_level, " has room");
  switch (basis) {
    case Basis::kFree:
      return absl::StrCat(text, "; the largest free ", request.placement_level, ", ",
                          largest.domain, ", offers ", largest.gang);
    case Basis::kEmptySchedulable:
      return absl::StrCat(text, "; the largest ", request.placement_level, ", ", largest.domain,
                          ", holds ", largest.gang, " even when empty");
    case Basis::kEmptyAll:
      break;
  }
  return absl::StrCat(text, "; the largest matching ", request.placement_level, ", ",
                      largest.domain, ", holds ", largest.gang);
}

std::string WaitingBehind(const GangRequest& request, const GangRequest& head) {
  return absl::StrCat("waiting behind ",
                      head.priority > request.priority ? "higher-priority" : "older", " job ",
                      head.job_id, " (backfill would delay it)");
}

}  // namespace

std::string NodeKindKey(const GangRequest& request) {
  std::string key = absl::StrCat(request.use_gpus, "|", request.gpu_type);
  for (const auto& [label, value] : request.node_selector) {
    absl::StrAppend(&key, "|", label, "=", value);
  }
  return key;
}

ScheduleResult Schedule(std::vector<GangRequest> pending, const std::vector<NodeCapacity>& given) {
  // Sorting both inputs makes the answer independent of the order the caller happened to use.
  std::sort(pending.begin(), pending.end(), [](const GangRequest& a, const GangRequest& b) {
    return std::make_tuple(-static_cast<int64_t>(a.priority), a.submit_order, std::cref(a.job_id)) <
           std::make_tuple(-static_cast<int64_t>(b.priority), b.submit_order, std::cref(b.job_id));
  });
  auto by_id = [](const NodeCapacity& a, const NodeCapacity& b) { return a.node_id < b.node_id; };
  // The coordinator passes them in node_id order already: checking is cheaper than sorting, and
  // only nodes in another order are copied.
  std::vector<NodeCapacity> sorted;
  if (!std::is_sorted(given.begin(), given.end(), by_id)) {
    sorted = given;
    std::sort(sorted.begin(), sorted.end(), by_id);
  }
  const std::vector<NodeCapacity>& nodes = sorted.empty() ? given : sorted;

  std::vector<NodeState> states(nodes.size());
  for (size_t i = 0; i < nodes.size(); ++i) {
    std::vector<int>& gpus = states[i].free_gpus;
    gpus = nodes[i].free_gpus;
    std::sort(gpus.begin(), gpus.end());
    gpus.erase(std::unique(gpus.begin(), gpus.end()), gpus.end());
    states[i].free_cpu_slots = std::max(0, nodes[i].free_cpu_slots);
  }

  // The most slots any node holds: the offer indexes' bucket range.
  int max_slots = 0;
  for (const NodeCapacity& node : nodes) {
    max_slots = std::max({max_slots, node.total_gpus, node.total_cpu_slots,
                          static_cast<int>(node.free_gpus.size()), node.free_cpu_slots});
  }

  ScheduleResult result;
  std::optional<GangRequest> head;
  // Requests asking for the same kind of node share one scan for eligible nodes and one index of
  // their offers: a deep queue on a large cluster otherwise rescans every node for every request.
  struct Candidates {
    bool gpus = true;
    std::vector<int> nodes;
    // By node index: whether eligible, and the free and unreserved slots last indexed.
    std::vector<char> eligible;
    std::vector<int> free_slots;
    std::vector<int> unreserved_slots;
    OfferIndex free{0};
    OfferIndex unreserved{0};
  };
  std::map<std::string, Candidates> eligibility;
  // A commit or the head's reservation changed what `node` offers: re-index it everywhere.
  auto refresh = [&](int node) {
    const NodeState& state = states[node];
    for (auto& [key, candidates] : eligibility) {
      if (!candidates.eligible[node]) continue;
      const int free = state.Free(candidates.gpus);
      const int unreserved = std::max(0, free - state.Reserved(candidates.gpus));
      candidates.free.Move(node, candidates.free_slots[node], free);
      candidates.unreserved.Move(node, candidates.unreserved_slots[node], unreserved);
      candidates.free_slots[node] = free;
      candidates.unreserved_slots[node] = unreserved;
    }
  };
  for (const GangRequest& request : pending) {
    if (auto problem = ShapeProblem(request)) {
      result.pending_reasons[request.job_id] = *problem;
      continue;
    }
    const std::string key = NodeKindKey(request);
    auto cached = eligibility.find(key);
    if (cached == eligibility.end()) {
      Candidates found;
      (void)NoEligibleNode(request, nodes, /*schedulable_only=*/true, &found.nodes);
      found.gpus = request.use_gpus;
      found.eligible.assign(nodes.size(), 0);
      found.free_slots.assign(nodes.size(), 0);
      found.unreserved_slots.assign(nodes.size(), 0);
      found.free = OfferIndex(max_slots);
      found.unreserved = OfferIndex(max_slots);
      for (int node : found.nodes) {
        const NodeState& state = states[node];
        found.eligible[node] = 1;
        found.free_slots[node] = state.Free(found.gpus);
        found.unreserved_slots[node] =
            std::max(0, state.Free(found.gpus) - state.Reserved(found.gpus));
        found.free.Add(node, found.free_slots[node]);
        found.unreserved.Add(node, found.unreserved_slots[node]);
      }
      cached = eligibility.emplace(key, std::move(found)).first;
    }
    if (cached->second.nodes.empty()) {
      // The reason names this request's size, so it is worded per request.
      std::vector<int> none;
      result.pending_reasons[request.job_id] =
          NoEligibleNode(request, nodes, /*schedulable_only=*/true, &none).value_or("");
      continue;
    }
    const std::vector<int>& eligible = cached->second.nodes;
    const bool gpus = request.use_gpus;
    const Candidates& candidates = cached->second;
    const int group = request.tensor_parallel;
    auto reserve = [&](const std::vector<Share>& reservation) {
      head = request;
      for (const Share& share : reservation) {
        (gpus ? states[share.node].reserved_gpus : states[share.node].reserved_cpu_slots) +=
            share.groups * request.tensor_parallel;
        refresh(share.node);
      }
    };
    if (!request.placement_level.empty()) {
      auto unreserved = [&](int node) { return candidates.unreserved_slots[node]; };
      if (auto shares = PackInOneDomain(request, nodes, eligible, unreserved, max_slots, nullptr)) {
        result.placed.push_back(Commit(request, *shares, nodes, states));
        for (const Share& share : *shares) refresh(share.node);
        continue;
      }
      if (request.placement_required) {
        LargestDomain free_largest;
        auto free = [&](int node) { return candidates.free_slots[node]; };
        const bool fits_free =
            PackInOneDomain(request, nodes, eligible, free, max_slots, &free_largest).has_value();
        if (!head.has_value()) {
          LargestDomain empty_largest;
          auto total = [&](int node) { return TotalSlots(request, nodes[node]); };
          auto reservation =
              PackInOneDomain(request, nodes, eligible, total, max_slots, &empty_largest);
          if (!reservation.has_value()) {
            result.pending_reasons[request.job_id] =
                DomainShortfall(request, empty_largest, Basis::kEmptySchedulable);
            continue;
          }
          reserve(*reservation);
          result.pending_reasons[request.job_id] =
              DomainShortfall(request, free_largest, Basis::kFree);
          continue;
        }
        result.pending_reasons[request.job_id] =
            fits_free ? WaitingBehind(request, *head)
                      : DomainShortfall(request, free_largest, Basis::kFree);
        continue;
      }
      // Preferred: no domain has room, so anywhere.
    }
    // Pack succeeds exactly when the offers hold enough whole groups.
    if (auto shares = candidates.unreserved.Pack(request)) {
      result.placed.push_back(Commit(request, *shares, nodes, states));
      for (const Share& share : *shares) refresh(share.node);
      continue;
    }
    const OfferSummary free_summary = candidates.free.Summary(group);
    if (!head.has_value()) {
      const OfferIndex empty = EmptyOffers(request, nodes, eligible);
      auto reservation = empty.Pack(request);
      if (!reservation.has_value()) {
        // Reserving for a gang that cannot fit even on empty nodes would idle the cluster for
        // nothing; the next blocked request becomes the head instead.
        result.pending_reasons[request.job_id] =
            Shortfall(request, empty.Summary(group), Basis::kEmptySchedulable);
        continue;
      }
      reserve(*reservation);
      result.pending_reasons[request.job_id] = Shortfall(request, free_summary, Basis::kFree);
      continue;
    }
    result.pending_reasons[request.job_id] = free_summary.gang >= request.world_size
                                                 ? WaitingBehind(request, *head)
                                                 : Shortfall(request, free_summary, Basis::kFree);
  }
  return result;
}

std::optional<std::string> Unsatisfiable(const GangRequest& request,
                                         const std::vector<NodeCapacity>& nodes) {
  if (auto problem = ShapeProblem(request)) return problem;
  std::vector<int> eligible;
  if (auto problem = NoEligibleNode(request, nodes, /*schedulable_only=*/false, &eligible)) {
    return problem;
  }
  if (request.placement_required) {
    int max_slots = 0;
    for (int node : eligible) max_slots = std::max(max_slots, TotalSlots(request, nodes[node]));
    LargestDomain largest;
    auto total = [&](int node) { return TotalSlots(request, nodes[node]); };
    if (PackInOneDomain(request, nodes, eligible, total, max_slots, &largest).has_value()) {
      return std::nullopt;
    }
    return DomainShortfall(request, largest, Basis::kEmptyAll);
  }
  const OfferIndex empty = EmptyOffers(request, nodes, eligible);
  if (empty.Pack(request).has_value()) return std::nullopt;
  return Shortfall(request, empty.Summary(request.tensor_parallel), Basis::kEmptyAll);
}

}  // namespace tessera::coordinator

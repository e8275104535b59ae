// NodeRegistry's capacity summary against a recount from the node records: after random sequences
// of registrations (new and returning, with changed resources and labels), expiries, drains,
// undrains, removals and allocations, Capacity and Count must equal what the records and the used devices say, and
// ChangedSince must name exactly the nodes that registered or were lost (what the coordinator's
// commit of a pass computed without its lock relies on).
#include "coordinator/nodes/node_registry.h"

#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "coordinator/auth/auth.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::coordinator {
namespace {

// A heartbeat from `node_id` (registered with the node key "key"): whether it was taken.
bool Heard(NodeRegistry& registry, const std::string& node_id,
           google::protobuf::RepeatedPtrField<v1::GpuMetrics>* metrics) {
  absl::StatusOr<bool> touched = registry.Touch(node_id, TokenSha256("key"), metrics);
  EXPECT_TRUE(touched.ok()) << touched.status();
  return touched.value_or(false);
}

// The capacity of `nodes` less `used`, computed the slow way from the protos.
std::vector<NodeCapacity> Recount(const std::vector<v1::Node>& nodes,
                                  const std::map<std::string, std::set<int>>& used_gpus,
                                  const std::map<std::string, int>& used_slots) {
  std::vector<NodeCapacity> capacity;
  for (const v1::Node& node : nodes) {
    NodeCapacity& c = capacity.emplace_back();
    c.node_id = node.node_id();
    c.host = node.address().substr(0, node.address().rfind(':'));
    c.host_memory_bytes = node.resources().memory_bytes();
    c.total_gpus = node.resources().gpus_size();
    for (const auto& gpu : node.resources().gpus()) {
      auto held = used_gpus.find(node.node_id());
      if (held == used_gpus.end() || !held->second.contains(gpu.index())) {
        c.free_gpus.push_back(gpu.index());
      }
      if (c.gpu_name.empty()) {
        c.gpu_name = gpu.name();
        c.gpu_memory_bytes = gpu.memory_bytes();
      }
    }
    c.total_cpu_slots = node.resources().cpu_slots();
    auto slots = used_slots.find(node.node_id());
    c.free_cpu_slots =
        std::max(0, c.total_cpu_slots - (slots == used_slots.end() ? 0 : slots->second));
    c.labels.insert(node.labels().begin(), node.labels().end());
    c.schedulable = node.state() == v1::NODE_STATE_READY;
  }
  return capacity;
}

void ExpectSame(const NodeCapacity& a, const NodeCapacity& b) {
  EXPECT_EQ(a.node_id, b.node_id);
  EXPECT_EQ(a.host, b.host) << a.node_id;
  EXPECT_EQ(a.free_gpus, b.free_gpus) << a.node_id;
  EXPECT_EQ(a.gpu_name, b.gpu_name) << a.node_id;
  EXPECT_EQ(a.gpu_memory_bytes, b.gpu_memory_bytes) << a.node_id;
  EXPECT_EQ(a.host_memory_bytes, b.host_memory_bytes) << a.node_id;
  EXPECT_EQ(a.total_gpus, b.total_gpus) << a.node_id;
  EXPECT_EQ(a.free_cpu_slots, b.free_cpu_slots) << a.node_id;
  EXPECT_EQ(a.total_cpu_slots, b.total_cpu_slots) << a.node_id;
  EXPECT_EQ(a.labels, b.labels) << a.node_id;
  EXPECT_EQ(a.schedulable, b.schedulable) << a.node_id;
}

TEST(NodeRegistryTest, CapacityAndCountAgreeWithARecountAfterRandomChanges) {
  auto store = Store::Open(":memory:");
  ASSERT_TRUE(store.ok()) << store.status();
  const absl::Duration timeout = absl::Seconds(15);
  SimulatedClock clock(absl::FromUnixSeconds(1'000'000));
  NodeRegistry registry(store->get(), timeout, /*write_behind=*/false, &clock);
  std::mt19937 random(20261125);
  auto pick = [&](int n) { return static_cast<int>(random() % n); };
  std::map<std::string, absl::Time> last_seen;
  std::set<std::string> lost;
  std::map<std::string, std::set<int>> used_gpus;
  std::map<std::string, int> used_slots;

  for (int step = 0; step < 400; ++step) {
    const std::string node_id = absl::StrCat("node-", pick(40));
    const uint64_t generation = registry.generation();
    std::set<std::string> changed;
    switch (pick(7)) {
      case 0:
      case 1: {  // (re)register, possibly with other resources and labels
        v1::RegisterNodeRequest request;
        request.set_node_id(node_id);
        request.set_node_key("key");
        request.set_address(absl::StrCat("10.0.0.", pick(9), ":", 5000 + pick(3)));
        const int gpus = pick(3) == 0 ? 0 : 1 + pick(8);
        for (int i = 0; i < gpus; ++i) {
          auto* gpu = request.mutable_resources()->add_gpus();
          gpu->set_index(gpus - 1 - i);  // descending: the summary must not reorder
          gpu->set_name(pick(2) ? "NVIDIA H100 80GB HBM3" : "NVIDIA A100-SXM4-40GB");
          gpu->set_memory_bytes(int64_t{40 + pick(2) * 40} << 30);
        }
        request.mutable_resources()->set_cpu_slots(gpus == 0 ? 1 + pick(16) : pick(3));
        request.mutable_resources()->set_memory_bytes(int64_t{pick(512)} << 30);
        if (pick(2)) (*request.mutable_labels())["zone"] = absl::StrCat("z", pick(3));
        bool returning = false;
        const bool known = last_seen.contains(node_id);
        ASSERT_TRUE(registry.Register(request, &returning).ok());
        EXPECT_EQ(returning, known) << node_id;
        last_seen[node_id] = clock.Now();
        lost.erase(node_id);
        changed.insert(node_id);
        break;
      }
      case 2:  // time passes; heartbeats from some nodes; expiry
        clock.Advance(absl::Seconds(1 + pick(8)));
        for (auto& [id, seen] : last_seen) {
          google::protobuf::RepeatedPtrField<v1::GpuMetrics> no_metrics;
          if (pick(3) && Heard(registry, id, &no_metrics)) seen = clock.Now();
        }
        {
          // Exactly the nodes silent for longer than the timeout and not lost yet, in node_id
          // order, each with its silence.
          std::vector<std::string> expected_lost, actual_lost;
          for (const auto& [id, seen] : last_seen) {
            if (!lost.contains(id) && clock.Now() - seen > timeout) expected_lost.push_back(id);
          }
          for (const auto& [id, silence] : registry.Expire()) {
            actual_lost.push_back(id);
            EXPECT_EQ(silence, clock.Now() - last_seen[id]) << id;
            changed.insert(id);
            lost.insert(id);
          }
          EXPECT_EQ(actual_lost, expected_lost);
        }
        break;
      case 3:  // allocate (possibly GPUs the node does not have)
        if (pick(2)) {
          used_gpus[node_id].insert(pick(5) == 0 ? 60 + pick(10) : pick(10));
        } else {
          used_slots[node_id] += 1 + pick(4);
        }
        break;
      case 4:  // free
        if (pick(2)) {
          if (auto it = used_gpus.find(node_id); it != used_gpus.end() && !it->second.empty()) {
            it->second.erase(it->second.begin());
            if (it->second.empty()) used_gpus.erase(it);
          }
        } else {
          used_slots.erase(node_id);
        }
        break;
      case 5: {  // drain or undrain
        const bool drain = pick(2) == 0;
        const absl::Status status = registry.SetDrained(node_id, drain, "test").status();
        if (!last_seen.contains(node_id)) {
          EXPECT_TRUE(absl::IsNotFound(status)) << status;
          break;
        }
        ASSERT_TRUE(status.ok()) << status;
        const std::optional<v1::Node> node = registry.Find(node_id);
        EXPECT_EQ(node->drained(), drain);
        EXPECT_EQ(node->state(), lost.contains(node_id) ? v1::NODE_STATE_LOST
                                 : drain                ? v1::NODE_STATE_DRAINING
                                                        : v1::NODE_STATE_READY);
        changed.insert(node_id);
        break;
      }
      case 6: {  // remove: only a LOST or drained node
        const std::optional<v1::Node> node = registry.Find(node_id);
        const bool removable = node.has_value() && (lost.contains(node_id) || node->drained());
        const absl::Status status = registry.Remove(node_id);
        if (!node.has_value()) {
          EXPECT_TRUE(absl::IsNotFound(status)) << status;
        } else if (!removable) {
          EXPECT_TRUE(absl::IsFailedPrecondition(status)) << status;
        } else {
          ASSERT_TRUE(status.ok()) << status;
          EXPECT_FALSE(registry.Known(node_id));
          last_seen.erase(node_id);
          lost.erase(node_id);
        }
        break;
      }
    }
    const std::vector<v1::Node> records = registry.Nodes();
    const std::vector<NodeCapacity> expected = Recount(records, used_gpus, used_slots);
    const UsedResources used = UsedResources::FromMaps(used_gpus, used_slots);
    const std::vector<NodeCapacity> actual = registry.Capacity(used);
    ASSERT_EQ(actual.size(), expected.size());
    for (size_t i = 0; i < actual.size(); ++i) ExpectSame(actual[i], expected[i]);

    for (const auto& node : records) {
      EXPECT_EQ(registry.ChangedSince(node.node_id(), generation), changed.contains(node.node_id()))
          << node.node_id();
    }
    EXPECT_TRUE(registry.ChangedSince("never-registered", generation));

    const NodeRegistry::Tally tally = registry.Count(used);
    std::map<v1::NodeState, int64_t> states;
    int64_t gpus_total = 0, gpus_allocated = 0, slots_total = 0, slots_allocated = 0;
    for (const auto& node : records) ++states[node.state()];
    for (const auto& c : expected) {
      gpus_total += c.total_gpus;
      gpus_allocated += c.total_gpus - static_cast<int64_t>(c.free_gpus.size());
      slots_total += c.total_cpu_slots;
      slots_allocated += c.total_cpu_slots - c.free_cpu_slots;
    }
    EXPECT_EQ(tally.nodes, states);
    EXPECT_EQ(tally.gpus_total, gpus_total);
    EXPECT_EQ(tally.gpus_allocated, gpus_allocated);
    EXPECT_EQ(tally.cpu_slots_total, slots_total);
    EXPECT_EQ(tally.cpu_slots_allocated, slots_allocated);
    // The store holds exactly the registry's records (removals included).
    auto stored = (*store)->ListNodes();
    ASSERT_TRUE(stored.ok()) << stored.status();
    ASSERT_EQ(stored->size(), records.size());
    for (size_t i = 0; i < records.size(); ++i) {
      EXPECT_EQ((*stored)[i].node_id(), records[i].node_id());
      EXPECT_EQ((*stored)[i].drained(), records[i].drained()) << records[i].node_id();
    }
    if (HasFailure()) FAIL() << "after step " << step;
  }
}

v1::RegisterNodeRequest CpuNode(const std::string& node_id, const std::string& key = "key") {
  v1::RegisterNodeRequest request;
  request.set_node_id(node_id);
  request.set_node_key(key);
  request.set_address("10.0.0.1:5000");
  request.mutable_resources()->set_cpu_slots(4);
  return request;
}

// Liveness on the registry's clock: a node is LOST only once its silence exceeds the heartbeat
// timeout (exactly the timeout is still alive), a heartbeat restarts the count, and a LOST node's
// heartbeats are refused until it registers again. Simulated time: nothing sleeps.
TEST(NodeRegistryTest, ASilentNodeExpiresAfterTheHeartbeatTimeoutOnTheClock) {
  auto store = Store::Open(":memory:");
  ASSERT_TRUE(store.ok()) << store.status();
  SimulatedClock clock(absl::FromUnixSeconds(1'000'000));
  NodeRegistry registry(store->get(), absl::Seconds(15), /*write_behind=*/false, &clock);
  bool returning = false;
  ASSERT_TRUE(registry.Register(CpuNode("quiet"), &returning).ok());
  ASSERT_TRUE(registry.Register(CpuNode("chatty"), &returning).ok());
  EXPECT_EQ(registry.Find("quiet")->last_heartbeat_time().seconds(), 1'000'000);

  google::protobuf::RepeatedPtrField<v1::GpuMetrics> no_metrics;
  clock.Advance(absl::Seconds(10));
  ASSERT_TRUE(Heard(registry, "chatty", &no_metrics));
  EXPECT_TRUE(absl::IsPermissionDenied(
      registry.Touch("chatty", TokenSha256("another key"), &no_metrics).status()))
      << "a heartbeat speaks for its own node only";
  EXPECT_EQ(registry.Find("chatty")->last_heartbeat_time().seconds(), 1'000'010);
  clock.Advance(absl::Seconds(5));
  EXPECT_TRUE(registry.Expire().empty()) << "silent for exactly the timeout: still alive";
  clock.Advance(absl::Milliseconds(1));
  auto expired = registry.Expire();
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].first, "quiet");
  EXPECT_EQ(expired[0].second, absl::Seconds(15) + absl::Milliseconds(1));
  EXPECT_TRUE(registry.IsLost("quiet"));
  EXPECT_FALSE(registry.IsLost("chatty")) << "heard from 5 s ago";
  EXPECT_TRUE(registry.Expire().empty()) << "a node is lost once";
  EXPECT_FALSE(Heard(registry, "quiet", &no_metrics)) << "a LOST node must register again";

  clock.Advance(absl::Seconds(11));
  expired = registry.Expire();
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].first, "chatty");
  EXPECT_EQ(expired[0].second, absl::Seconds(16) + absl::Milliseconds(1));

  ASSERT_TRUE(registry.Register(CpuNode("quiet"), &returning).ok());
  EXPECT_TRUE(returning);
  EXPECT_FALSE(registry.IsLost("quiet"));
  EXPECT_TRUE(Heard(registry, "quiet", &no_metrics));
  clock.Advance(absl::Seconds(15));
  EXPECT_TRUE(registry.Expire().empty()) << "registering restarted the count";
}

// A drain is the operator's intent: it survives the worker registering again, the node being
// lost and coming back, and a coordinator restart (a registry loaded from the store).
TEST(NodeRegistryTest, ADrainOutlivesRegistrationsLossAndARestart) {
  auto store = Store::Open(":memory:");
  ASSERT_TRUE(store.ok()) << store.status();
  SimulatedClock clock(absl::FromUnixSeconds(1'000'000));
  bool returning = false;
  {
    NodeRegistry registry(store->get(), absl::Seconds(15), /*write_behind=*/false, &clock);
    ASSERT_TRUE(registry.Register(CpuNode("n1"), &returning).ok());
    ASSERT_TRUE(registry.Register(CpuNode("n2"), &returning).ok());
    ASSERT_TRUE(registry.SetDrained("n1", true, "kernel upgrade").ok());
    const std::vector<NodeCapacity> capacity = registry.Capacity(UsedResources());
    ASSERT_EQ(capacity.size(), 2u);
    EXPECT_FALSE(capacity[0].schedulable) << "a drained node takes no placement";
    EXPECT_TRUE(capacity[1].schedulable);
    EXPECT_EQ(registry.Find("n1")->drain_reason(), "kernel upgrade");

    ASSERT_TRUE(registry.Register(CpuNode("n1"), &returning).ok());
    EXPECT_EQ(registry.Find("n1")->state(), v1::NODE_STATE_DRAINING) << "kept on re-registering";
    clock.Advance(absl::Seconds(20));
    EXPECT_EQ(registry.Expire().size(), 2u) << "a drained node is lost like any other";
    EXPECT_EQ(registry.Find("n1")->state(), v1::NODE_STATE_LOST);
    EXPECT_TRUE(registry.Find("n1")->drained());
  }
  NodeRegistry restarted(store->get(), absl::Seconds(15), /*write_behind=*/false, &clock);
  ASSERT_TRUE(restarted.Load().ok());
  ASSERT_TRUE(restarted.Register(CpuNode("n1"), &returning).ok());
  EXPECT_TRUE(returning);
  EXPECT_EQ(restarted.Find("n1")->state(), v1::NODE_STATE_DRAINING);
  ASSERT_TRUE(restarted.SetDrained("n1", false, "").ok());
  EXPECT_EQ(restarted.Find("n1")->state(), v1::NODE_STATE_READY);
  EXPECT_TRUE(restarted.Find("n1")->drain_reason().empty());
  EXPECT_TRUE(restarted.Capacity(UsedResources())[0].schedulable);
  EXPECT_TRUE(absl::IsNotFound(restarted.SetDrained("n9", true, "").status()));
}

// Removing forgets the node everywhere: its count (the alert on LOST nodes reads it), its record
// in the store, its queued orders; a worker that comes back later is a new node, under any key.
TEST(NodeRegistryTest, RemovedNodesLeaveTheCountsAndTheStore) {
  auto store = Store::Open(":memory:");
  ASSERT_TRUE(store.ok()) << store.status();
  SimulatedClock clock(absl::FromUnixSeconds(1'000'000));
  OrderOutbox outbox;
  NodeRegistry registry(store->get(), absl::Seconds(15), /*write_behind=*/false, &clock, &outbox);
  bool returning = false;
  for (const char* id : {"a", "b", "c"}) {
    ASSERT_TRUE(registry.Register(CpuNode(id), &returning).ok());
  }
  EXPECT_TRUE(absl::IsFailedPrecondition(registry.Remove("b"))) << "READY: drain it first";
  EXPECT_TRUE(absl::IsNotFound(registry.Remove("zz")));
  clock.Advance(absl::Seconds(10));
  google::protobuf::RepeatedPtrField<v1::GpuMetrics> no_metrics;
  ASSERT_TRUE(Heard(registry, "b", &no_metrics));
  ASSERT_TRUE(Heard(registry, "c", &no_metrics));
  clock.Advance(absl::Seconds(10));
  ASSERT_EQ(registry.Expire().size(), 1u);  // a
  ASSERT_TRUE(registry.SetDrained("c", true, "").ok());
  outbox.QueueStop("c", "t1");
  EXPECT_EQ(registry.Count(UsedResources()).nodes.at(v1::NODE_STATE_LOST), 1);

  ASSERT_TRUE(registry.Remove("a").ok());
  ASSERT_TRUE(registry.Remove("c").ok());
  const NodeRegistry::Tally tally = registry.Count(UsedResources());
  EXPECT_EQ(tally.nodes, (std::map<v1::NodeState, int64_t>{{v1::NODE_STATE_READY, 1}}));
  EXPECT_EQ(tally.cpu_slots_total, 4);
  ASSERT_EQ(registry.Capacity(UsedResources()).size(), 1u);
  EXPECT_EQ(registry.Nodes().at(0).node_id(), "b");
  auto stored = (*store)->ListNodes();
  ASSERT_TRUE(stored.ok());
  ASSERT_EQ(stored->size(), 1u);
  EXPECT_EQ(stored->at(0).node_id(), "b");
  // b's liveness slot moved when a's was freed: it still expires on time, and only it.
  clock.Advance(absl::Seconds(16));
  auto expired = registry.Expire();
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].first, "b");

  ASSERT_TRUE(registry.Register(CpuNode("c", "another-key"), &returning).ok());
  EXPECT_FALSE(returning) << "a removed node comes back as a new one";
  EXPECT_FALSE(registry.Find("c")->drained());
  v1::HeartbeatResponse orders;
  outbox.TakeOrders("c", &orders);
  EXPECT_EQ(orders.stop_size(), 0) << "the removed node's orders went with it";
}

// A node's topology labels are checked against the others' as it registers (TopologyIndex): a
// node that registers again may move, a removed node no longer says where its rack is, and the
// labels survive a restart of the registry.
TEST(NodeRegistryTest, TopologyLabelsAreCheckedKeptAndForgotten) {
  auto store = Store::Open(":memory:");
  ASSERT_TRUE(store.ok()) << store.status();
  SimulatedClock clock(absl::FromUnixSeconds(1'000'000));
  NodeRegistry registry(store->get(), absl::Seconds(15), /*write_behind=*/false, &clock);
  registry.SetTopologyLevels(*ParseTopologyLevels("rack,block"));
  auto node = [](const std::string& id, const std::string& rack, const std::string& block) {
    v1::RegisterNodeRequest request = CpuNode(id);
    (*request.mutable_topology())["rack"] = rack;
    (*request.mutable_topology())["block"] = block;
    return request;
  };
  bool returning = false;
  ASSERT_TRUE(registry.Register(node("a", "r1", "b1"), &returning).ok());
  const absl::Status refused = registry.Register(node("b", "r1", "b2"), &returning);
  EXPECT_TRUE(absl::IsInvalidArgument(refused)) << refused;
  EXPECT_FALSE(registry.Known("b")) << "a refused registration records nothing";
  // a moves its rack to b2 (it was the only one saying where r1 is), then b may join it there.
  ASSERT_TRUE(registry.Register(node("a", "r1", "b2"), &returning).ok());
  ASSERT_TRUE(registry.Register(node("b", "r1", "b2"), &returning).ok());
  EXPECT_EQ(registry.Find("a")->topology().at("block"), "b2");
  // What the scheduler gets: the labels, and the domains highest level first.
  for (const NodeCapacity& capacity : *registry.Summaries().summaries) {
    EXPECT_EQ(capacity.topology.at("rack"), "r1") << capacity.node_id;
    EXPECT_THAT(capacity.topology_path, ::testing::ElementsAre("b2", "r1")) << capacity.node_id;
  }

  NodeRegistry restarted(store->get(), absl::Seconds(15), /*write_behind=*/false, &clock);
  restarted.SetTopologyLevels(*ParseTopologyLevels("rack,block"));
  ASSERT_TRUE(restarted.Load().ok());
  EXPECT_TRUE(absl::IsInvalidArgument(restarted.Register(node("c", "r1", "b1"), &returning)))
      << "the stored nodes still say r1 is in b2";
  ASSERT_TRUE(restarted.SetDrained("a", true, "").ok());
  ASSERT_TRUE(restarted.SetDrained("b", true, "").ok());
  ASSERT_TRUE(restarted.Remove("a").ok());
  ASSERT_TRUE(restarted.Remove("b").ok());
  EXPECT_TRUE(restarted.Register(node("c", "r1", "b1"), &returning).ok())
      << "once its nodes are gone, nothing says where r1 is";
}

}  // namespace
}  // namespace tessera::coordinator

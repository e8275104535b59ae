// PassFixture: the fixture of the scheduling pass's in-process tests (scheduling_pass_test.cc
// and the stages' own tests): a ClusterState, a GuardedLedger and a NodeRegistry whose nodes the
// test registers directly, an in-memory store, a job manager and an AttemptFate on one
// SimulatedClock. No Cluster, no threads, no sleeps.
//
// Thread safety: a gtest fixture, used from the test's thread.
#pragma once

#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "common/status_matchers.h"
#include "coordinator/cluster/attempt_fate.h"
#include "coordinator/cluster/cluster_state.h"
#include "coordinator/cluster/pass_snapshot.h"
#include "coordinator/cluster/reservation_stage.h"
#include "coordinator/cluster/store_stage.h"
#include "coordinator/jobs/job_manager.h"
#include "coordinator/scheduler/scheduler.h"
#include "coordinator/scheduling/plan_stage.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/job_specs.h"

namespace tessera::coordinator {

class PassFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    auto store = Store::Open(":memory:");
    ASSERT_THAT(store.status(), ::tessera::testing::IsOk());
    store_ = std::move(*store);
    jobs_ = std::make_unique<JobManager>(store_.get(), &clock_);
    ClusterOptions options;
    options.clock = &clock_;
    options.failure_settle = absl::Seconds(5);
    options.blame_grace = absl::Seconds(1);
    state_ = std::make_unique<ClusterState>(store_.get(), options);
    nodes_ = std::make_unique<NodeRegistry>(store_.get(), options.heartbeat_timeout,
                                            /*write_behind=*/true, &clock_, &state_->orders);
    fate_ = std::make_unique<AttemptFate>(state_.get(), nodes_.get(), jobs_.get());
  }

  void Register(const std::string& node, int slots) {
    v1::RegisterNodeRequest request;
    request.set_node_id(node);
    request.set_address(node + ":7000");
    request.mutable_resources()->set_cpu_slots(slots);
    bool returning = false;
    ASSERT_THAT(nodes_->Register(request, &returning), ::tessera::testing::IsOk());
  }

  std::string Submit(int slots, int max_restarts = 0, int priority = 0) {
    v1::JobSpec spec = ::tessera::testing::TinyCpuJobSpec("pass", slots, max_restarts);
    spec.set_priority(priority);
    auto job = jobs_->Submit(spec, "");
    EXPECT_THAT(job.status(), ::tessera::testing::IsOk());
    return job.ok() ? job->job_id() : "";
  }

  v1::Job Job(const std::string& job_id) {
    auto job = jobs_->Get(job_id);
    EXPECT_THAT(job.status(), ::tessera::testing::IsOk());
    return job.ok() ? *job : v1::Job();
  }

  // The orders a heartbeat from `node` would carry now.
  v1::HeartbeatResponse Orders(const std::string& node) {
    GuardedLedger::Hold held(ledger_.get());
    v1::HeartbeatResponse response;
    state_->orders.TakeOrders(node, &response);
    return response;
  }

  // Whether `job_id` holds devices, and whether its placement is still being stored.
  bool Allocated(const std::string& job_id, bool* storing = nullptr) {
    GuardedLedger::Hold held(ledger_.get());
    const Allocation* allocation = held->Find(job_id);
    if (allocation != nullptr && storing != nullptr) *storing = allocation->storing;
    return allocation != nullptr;
  }

  // The waiting jobs as a pass lists them, and the snapshot taken over them.
  PassSnapshot Snapshot(const std::vector<v1::Job>& waiting) {
    GuardedLedger::Hold held(ledger_.get());
    return TakePassSnapshotLocked(held, *state_, *nodes_, waiting, nullptr);
  }
  std::vector<v1::Job> Waiting() {
    auto waiting = store_->ListWaitingJobs();
    EXPECT_THAT(waiting.status(), ::tessera::testing::IsOk());
    return waiting.ok() ? *waiting : std::vector<v1::Job>();
  }

  // What the stages before the reservation make of the waiting jobs: listed, snapshot, planned
  // (scheduling/plan_stage.h) and scheduled. `planned` points into `listed`: keep the proposal.
  struct Proposal {
    std::vector<v1::Job> listed;
    PassSnapshot snapshot;
    PlanStage plan_stage;
    PlannedJobs planned;
    ScheduleResult result;
    PlacedJobs jobs() const { return {planned.jobs, planned.specs, planned.plans}; }
  };
  std::unique_ptr<Proposal> Propose() {
    auto proposal = std::make_unique<Proposal>();
    proposal->listed = Waiting();
    proposal->snapshot = Snapshot(proposal->listed);
    if (proposal->snapshot.waiting.empty()) return proposal;
    std::vector<NodeCapacity> capacity =
        NodeRegistry::Subtract(*proposal->snapshot.summaries, proposal->snapshot.used);
    proposal->planned =
        proposal->plan_stage.Run(proposal->listed, proposal->snapshot.waiting, capacity);
    proposal->result = Schedule(proposal->planned.requests, std::move(capacity));
    return proposal;
  }
  // The reservation stage over a proposal.
  Reservation Reserve(Proposal& proposal) {
    auto assignments = MakeAssignments(*state_, proposal.result.placed, proposal.jobs());
    GuardedLedger::Hold held(ledger_.get());
    return ReserveLocked(held, *state_, *nodes_, proposal.result.placed,
                         proposal.snapshot.generation, proposal.jobs(), std::move(assignments));
  }
  // The writes of a reservation's placements (as the pass makes them).
  PassWrites Writes(Proposal& proposal, const Reservation& reservation) {
    PassWrites pass;
    for (const GangPlacement* placement : reservation.placements) {
      const std::string& job_id = placement->job_id;
      pass.writes.push_back(PlacementWrite(
          *proposal.planned.jobs.at(job_id), proposal.planned.specs.at(job_id), *placement,
          proposal.planned.plans.at(job_id), reservation.master_ports.at(job_id)));
    }
    pass.placements = pass.writes.size();
    return pass;
  }
  // Places every job that fits now: proposed, reserved, stored and announced.
  std::set<std::string> PlaceAll() {
    std::unique_ptr<Proposal> proposal = Propose();
    const Reservation reservation = Reserve(*proposal);
    StoreStage store(state_.get(), ledger_.get(), jobs_.get());
    return store.Store(Writes(*proposal, reservation));
  }

  SimulatedClock clock_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<JobManager> jobs_;
  std::unique_ptr<ClusterState> state_;
  std::unique_ptr<GuardedLedger> ledger_ = std::make_unique<GuardedLedger>();
  std::unique_ptr<NodeRegistry> nodes_;
  std::unique_ptr<AttemptFate> fate_;
};

}  // namespace tessera::coordinator

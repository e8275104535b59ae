// LeaderElection (leader_election.h) on a private PostgreSQL server (tests/postgres_fixture.h):
// one of two electors leads; the other takes over only once the lease has expired, with the
// next epoch; the deposed one's renewal fails; a renewing leader keeps the lease; and the fence
// refuses every write of the deposed leader's store, leaving nothing of it stored.
//
// Thread safety: each test owns its electors and stores.
#include "coordinator/leader_election.h"

#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "common/status_matchers.h"
#include "coordinator/store.h"
#include "coordinator/store_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/postgres_fixture.h"

namespace tessera::coordinator {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::IsOkAndHolds;
using ::tessera::testing::PostgresCluster;
using ::tessera::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::SizeIs;

class LeaderElectionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    url_ = PostgresCluster::Shared().NewDatabase();
    if (url_.empty()) GTEST_SKIP() << PostgresCluster::Shared().Reason();
  }

  std::unique_ptr<LeaderElection> Elector(const std::string& address,
                                          absl::Duration lease = absl::Seconds(1),
                                          absl::Duration renew_interval = absl::ZeroDuration()) {
    LeaderElectionOptions options;
    options.url = url_;
    options.advertise_address = address;
    options.holder = address;
    options.lease = lease;
    options.renew_interval = renew_interval;
    auto election = LeaderElection::Connect(options);
    EXPECT_THAT(election.status(), IsOk());
    return election.ok() ? *std::move(election) : nullptr;
  }

  std::string url_;
};

TEST_F(LeaderElectionTest, OneOfTwoLeadsAndTheOtherSeesWhich) {
  auto a = Elector("10.0.0.1:50051", absl::Seconds(30));
  auto b = Elector("10.0.0.2:50051", absl::Seconds(30));
  ASSERT_THAT(a->TryAcquire(), IsOkAndHolds(true));
  EXPECT_EQ(a->epoch(), 1);
  EXPECT_TRUE(a->Valid());
  EXPECT_THAT(b->TryAcquire(), IsOkAndHolds(false));
  EXPECT_EQ(b->epoch(), 0);
  EXPECT_FALSE(b->Valid());
  absl::StatusOr<LeaderInfo> seen = b->Current();
  ASSERT_THAT(seen.status(), IsOk());
  EXPECT_EQ(seen->epoch, 1);
  EXPECT_EQ(seen->address, "10.0.0.1:50051");
  EXPECT_TRUE(seen->live);
  // Acquiring again keeps the epoch: it is still the same leadership.
  EXPECT_THAT(a->TryAcquire(), IsOkAndHolds(true));
  EXPECT_EQ(a->epoch(), 1);
  EXPECT_THAT(a->Renew(), IsOk());
}

TEST_F(LeaderElectionTest, TheStandbyTakesOverOnlyAfterTheLeaseAndTheOldRenewalFails) {
  auto a = Elector("a:1");
  auto b = Elector("b:1");
  ASSERT_THAT(a->TryAcquire(), IsOkAndHolds(true));
  const auto acquired = std::chrono::steady_clock::now();
  // Tried again and again before the lease ends, and refused each time.
  while (std::chrono::steady_clock::now() - acquired < std::chrono::milliseconds(700)) {
    ASSERT_THAT(b->TryAcquire(), IsOkAndHolds(false));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_FALSE(a->Valid()) << "a second without renewal is past a one-second lease";
  ASSERT_THAT(b->TryAcquire(), IsOkAndHolds(true));
  EXPECT_EQ(b->epoch(), 2);
  EXPECT_THAT(a->Renew(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                   HasSubstr("leadership epoch 1 was superseded by 2 at b:1")));
  EXPECT_THAT(a->TryAcquire(), IsOkAndHolds(false));
}

TEST_F(LeaderElectionTest, ARenewingLeaderKeepsTheLease) {
  auto a = Elector("a:1");
  auto b = Elector("b:1");
  ASSERT_THAT(a->TryAcquire(), IsOkAndHolds(true));
  absl::Mutex mu;
  std::string lost;
  a->StartRenewing([&](const std::string& message) {
    absl::MutexLock lock(&mu);
    lost = message;
  });
  for (int i = 0; i < 25; ++i) {
    ASSERT_THAT(b->TryAcquire(), IsOkAndHolds(false)) << "after " << i * 100 << " ms";
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(a->Valid());
  absl::MutexLock lock(&mu);
  EXPECT_EQ(lost, "");
}

TEST_F(LeaderElectionTest, TheDeposedLeadersWritesAreRefusedAndNothingOfThemIsStored) {
  // A renewal interval past the test: the leader never renews, as if paused.
  auto a = Elector("a:1", absl::Seconds(1), absl::Seconds(600));
  auto b = Elector("b:1");
  ASSERT_THAT(a->TryAcquire(), IsOkAndHolds(true));
  absl::StatusOr<std::unique_ptr<Store>> store_a = Store::Open(url_);
  ASSERT_THAT(store_a.status(), IsOk());
  LeaderElection* fence = a.get();
  (*store_a)->SetWriteFence([fence](DbConnection& writer) { return fence->Fence(writer); });
  // The fence reports a refusal through the loss callback StartRenewing installs.
  absl::Mutex mu;
  std::string lost;
  a->StartRenewing([&](const std::string& message) {
    absl::MutexLock lock(&mu);
    lost = message;
  });
  SubmitJob(**store_a, MakeJob("job-00000001", v1::JOB_STATE_PENDING, 1));

  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  ASSERT_THAT(b->TryAcquire(), IsOkAndHolds(true));
  ASSERT_EQ(b->epoch(), 2);

  JobWrite write;
  write.job = MakeJob("", v1::JOB_STATE_PENDING, 2);
  EXPECT_THAT((*store_a)->CommitNewJob(&write),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("store: fenced: leadership epoch 1 was superseded by 2")));
  EXPECT_EQ(write.job_id, "");
  EXPECT_THAT((*store_a)->PutNode([] {
    v1::Node node;
    node.set_node_id("node-1");
    return node;
  }()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("fenced")));
  {
    absl::MutexLock lock(&mu);
    EXPECT_EQ(lost, "lost leadership (epoch 1, now 2 at b:1)");
  }

  // What the new leader's store finds: the job written before the takeover, nothing after.
  absl::StatusOr<std::unique_ptr<Store>> store_b = Store::Open(url_);
  ASSERT_THAT(store_b.status(), IsOk());
  absl::StatusOr<JobPage> jobs = (*store_b)->ListJobs({}, 0, "");
  ASSERT_THAT(jobs.status(), IsOk());
  EXPECT_THAT(JobIds(jobs->jobs), ::testing::ElementsAre("job-00000001"));
  EXPECT_THAT((*store_b)->ListNodes(), IsOkAndHolds(SizeIs(0)));
  // The new leader's own fenced store writes.
  LeaderElection* fence_b = b.get();
  (*store_b)->SetWriteFence([fence_b](DbConnection& writer) { return fence_b->Fence(writer); });
  JobWrite next;
  next.job = MakeJob("", v1::JOB_STATE_PENDING, 3);
  EXPECT_THAT((*store_b)->CommitNewJob(&next), IsOk());
}

// A write transaction that holds the fence longer than the lease (a slow group commit on a loaded
// database) does not stop the leader's renewals: it keeps the lease.
TEST_F(LeaderElectionTest, ASlowFencedWriteDoesNotStarveTheRenewal) {
  auto a = Elector("a:1");
  ASSERT_THAT(a->TryAcquire(), IsOkAndHolds(true));
  absl::Mutex mu;
  std::string lost;
  a->StartRenewing([&](const std::string& message) {
    absl::MutexLock lock(&mu);
    lost = message;
  });
  absl::StatusOr<std::unique_ptr<Store>> store = Store::Open(url_);
  ASSERT_THAT(store.status(), IsOk());
  LeaderElection* elector = a.get();
  (*store)->SetWriteFence([elector](DbConnection& writer) {
    absl::Status fenced = elector->Fence(writer);
    // The transaction goes on holding the lease row for 1.5 leases.
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    return fenced;
  });
  SubmitJob(**store, MakeJob("job-00000001", v1::JOB_STATE_PENDING, 1));
  EXPECT_TRUE(a->Valid()) << "the renewal waited for the leader's own write";
  absl::MutexLock lock(&mu);
  EXPECT_EQ(lost, "");
}

// A standby cannot take over while a write fenced under the old epoch is in flight: its takeover
// waits until that write has committed.
TEST_F(LeaderElectionTest, ATakeoverWaitsForTheOldLeadersFencedWrite) {
  // The leader never renews: its lease runs out while its write holds the fence.
  auto a = Elector("a:1", absl::Seconds(1), absl::Seconds(600));
  auto b = Elector("b:1");
  ASSERT_THAT(a->TryAcquire(), IsOkAndHolds(true));
  absl::StatusOr<std::unique_ptr<Store>> store = Store::Open(url_);
  ASSERT_THAT(store.status(), IsOk());
  LeaderElection* elector = a.get();
  absl::Mutex mu;
  bool passed = false;
  std::chrono::steady_clock::time_point released;
  (*store)->SetWriteFence([&, elector](DbConnection& writer) {
    absl::Status fenced = elector->Fence(writer);
    {
      absl::MutexLock lock(&mu);
      passed = fenced.ok();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    absl::MutexLock lock(&mu);
    released = std::chrono::steady_clock::now();
    return fenced;
  });
  std::thread writer([&] { SubmitJob(**store, MakeJob("job-00000001", v1::JOB_STATE_PENDING, 1)); });
  {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(&passed));
  }
  absl::StatusOr<bool> taken = b->TryAcquire();
  while (!taken.ok() || !*taken) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    taken = b->TryAcquire();
  }
  const auto taken_at = std::chrono::steady_clock::now();
  writer.join();
  EXPECT_EQ(b->epoch(), 2);
  {
    absl::MutexLock lock(&mu);
    EXPECT_GT(taken_at, released) << "the standby took over under a write in flight";
  }
  absl::StatusOr<JobPage> jobs = (*store)->ListJobs({}, 0, "");
  ASSERT_THAT(jobs.status(), IsOk());
  EXPECT_THAT(JobIds(jobs->jobs), ::testing::ElementsAre("job-00000001"));
}

TEST_F(LeaderElectionTest, ALeaderThatStopsRenewingStepsDownByItsOwnClock) {
  auto a = Elector("a:1", absl::Milliseconds(600), absl::Milliseconds(900));
  ASSERT_THAT(a->TryAcquire(), IsOkAndHolds(true));
  absl::Mutex mu;
  std::string lost;
  a->StartRenewing([&](const std::string& message) {
    absl::MutexLock lock(&mu);
    lost = message;
  });
  // The first renewal is due after the lease is over: the leader gives up rather than renew.
  absl::MutexLock lock(&mu);
  EXPECT_TRUE(mu.AwaitWithTimeout(absl::Condition(
                                      +[](std::string* text) { return !text->empty(); }, &lost),
                                  absl::Seconds(5)));
  EXPECT_EQ(lost, "lost leadership (epoch 1, not renewed for 600ms)");
  EXPECT_FALSE(a->Valid());
}

}  // namespace
}  // namespace tessera::coordinator

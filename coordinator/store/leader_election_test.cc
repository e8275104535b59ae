// LeaderElection (leader_election.h) on a private PostgreSQL server (tests/postgres_fixture.h):
// one of two electors leads; the other takes over only once the lease has expired, with the
// next epoch; the deposed one's renewal fails; a renewing leader keeps the lease; and the fence
// refuses every write of the deposed leader's store, leaving nothing of it stored.
//
// Thread safety: each test owns its electors and stores.
#include "coordinator/store/leader_election.h"

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "common/status_matchers.h"
#include "coordinator/store/store.h"
#include "coordinator/store/store_fixture.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/postgres_fixture.h"
#include "tests/util/wait.h"

namespace tessera::coordinator {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::IsOkAndHolds;
using ::tessera::testing::PostgresCluster;
using ::tessera::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::SizeIs;

// What an elector reported through StartRenewing's loss callback.
//
// Thread safety: the callback writes from the renewal thread; readers hold mu_.
class LossLog {
 public:
  // Starts `elector`'s renewals; a loss goes into this log, which must outlive `elector`.
  void StartRenewing(LeaderElection& elector) {
    elector.StartRenewing([this](const std::string& message) {
      absl::MutexLock lock(&mu_);
      message_ = message;
    });
  }
  std::string message() const {
    absl::MutexLock lock(&mu_);
    return message_;
  }
  // Waits up to `timeout` for a loss to be reported; false if none was.
  bool AwaitLoss(absl::Duration timeout) const {
    absl::MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout(
        absl::Condition(+[](const std::string* text) { return !text->empty(); }, &message_),
        timeout);
  }

 private:
  mutable absl::Mutex mu_;
  std::string message_ ABSL_GUARDED_BY(mu_);
};

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

  // A leader "a:1" holding the lease at epoch 1 (one-second lease, renewed every
  // `leader_renew_interval`; zero: the default) and a standby "b:1" on the same database.
  void ElectLeaderWithStandby(absl::Duration leader_renew_interval = absl::ZeroDuration()) {
    leader_ = Elector("a:1", absl::Seconds(1), leader_renew_interval);
    standby_ = Elector("b:1");
    ASSERT_NE(leader_, nullptr);
    ASSERT_NE(standby_, nullptr);
    ASSERT_THAT(leader_->TryAcquire(), IsOkAndHolds(true));
    ASSERT_EQ(leader_->epoch(), 1);
  }

  // A store on the test database whose every write passes `elector`'s fence; `in_write`, when
  // given, runs next inside the write transaction with the fence's verdict (to hold it open).
  std::unique_ptr<Store> FencedStore(
      LeaderElection* elector, std::function<void(const absl::Status& fenced)> in_write = {}) {
    absl::StatusOr<std::unique_ptr<Store>> store = Store::Open(url_);
    EXPECT_THAT(store.status(), IsOk());
    if (!store.ok()) return nullptr;
    (*store)->SetWriteFence([elector, in_write](DbConnection& writer) {
      absl::Status fenced = elector->Fence(writer);
      if (in_write) in_write(fenced);
      return fenced;
    });
    return *std::move(store);
  }

  std::string url_;
  // Before the electors, so that it outlives their renewal threads.
  LossLog lost_;
  std::unique_ptr<LeaderElection> leader_;
  std::unique_ptr<LeaderElection> standby_;
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
  ASSERT_NO_FATAL_FAILURE(ElectLeaderWithStandby());
  LeaderElection* a = leader_.get();
  LeaderElection* b = standby_.get();
  const auto acquired = std::chrono::steady_clock::now();
  // Tried again and again before the lease ends, and refused each time.
  while (std::chrono::steady_clock::now() - acquired < std::chrono::milliseconds(700)) {
    ASSERT_THAT(b->TryAcquire(), IsOkAndHolds(false));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  // Past the one-second lease (1.5 s after it was taken, at the latest), without renewal.
  EXPECT_TRUE(testing::WaitUntil(
      [&] { return !a->Valid(); },
      absl::Milliseconds(1500) - absl::FromChrono(std::chrono::steady_clock::now() - acquired),
      absl::Milliseconds(10)))
      << "a second without renewal is past a one-second lease";
  ASSERT_THAT(b->TryAcquire(), IsOkAndHolds(true));
  EXPECT_EQ(b->epoch(), 2);
  EXPECT_THAT(a->Renew(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                   HasSubstr("leadership epoch 1 was superseded by 2 at b:1")));
  EXPECT_THAT(a->TryAcquire(), IsOkAndHolds(false));
}

TEST_F(LeaderElectionTest, ARenewingLeaderKeepsTheLease) {
  ASSERT_NO_FATAL_FAILURE(ElectLeaderWithStandby());
  lost_.StartRenewing(*leader_);
  for (int i = 0; i < 25; ++i) {
    ASSERT_THAT(standby_->TryAcquire(), IsOkAndHolds(false)) << "after " << i * 100 << " ms";
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(leader_->Valid());
  EXPECT_EQ(lost_.message(), "");
}

TEST_F(LeaderElectionTest, TheDeposedLeadersWritesAreRefusedAndNothingOfThemIsStored) {
  // A renewal interval past the test: the leader never renews, as if paused.
  ASSERT_NO_FATAL_FAILURE(ElectLeaderWithStandby(absl::Seconds(600)));
  std::unique_ptr<Store> store_a = FencedStore(leader_.get());
  ASSERT_NE(store_a, nullptr);
  // The fence reports a refusal through the loss callback StartRenewing installs.
  lost_.StartRenewing(*leader_);
  SubmitJob(*store_a, MakeJob("job-00000001", v1::JOB_STATE_PENDING, 1));

  // The standby takes over once the lease has run out.
  ASSERT_TRUE(testing::WaitUntil(
      [&] {
        absl::StatusOr<bool> taken = standby_->TryAcquire();
        return taken.ok() && *taken;
      },
      absl::Seconds(10), absl::Milliseconds(50)));
  ASSERT_EQ(standby_->epoch(), 2);

  JobWrite write;
  write.job = MakeJob("", v1::JOB_STATE_PENDING, 2);
  EXPECT_THAT(store_a->CommitNewJob(&write),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("store: fenced: leadership epoch 1 was superseded by 2")));
  EXPECT_EQ(write.job_id, "");
  EXPECT_THAT(store_a->PutNode([] {
    v1::Node node;
    node.set_node_id("node-1");
    return node;
  }()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("fenced")));
  EXPECT_EQ(lost_.message(), "lost leadership (epoch 1, now 2 at b:1)");

  // What the new leader's own fenced store finds: the job written before the takeover, nothing
  // after; and it writes.
  std::unique_ptr<Store> store_b = FencedStore(standby_.get());
  ASSERT_NE(store_b, nullptr);
  absl::StatusOr<JobPage> jobs = store_b->ListJobs({}, 0, "");
  ASSERT_THAT(jobs.status(), IsOk());
  EXPECT_THAT(JobIds(jobs->jobs), ::testing::ElementsAre("job-00000001"));
  EXPECT_THAT(store_b->ListNodes(), IsOkAndHolds(SizeIs(0)));
  JobWrite next;
  next.job = MakeJob("", v1::JOB_STATE_PENDING, 3);
  EXPECT_THAT(store_b->CommitNewJob(&next), IsOk());
}

// A write transaction that holds the fence longer than the lease (a slow group commit on a loaded
// database) does not stop the leader's renewals: it keeps the lease.
TEST_F(LeaderElectionTest, ASlowFencedWriteDoesNotStarveTheRenewal) {
  auto a = Elector("a:1");
  ASSERT_NE(a, nullptr);
  ASSERT_THAT(a->TryAcquire(), IsOkAndHolds(true));
  lost_.StartRenewing(*a);
  std::unique_ptr<Store> store = FencedStore(a.get(), [](const absl::Status&) {
    // The transaction goes on holding the lease row for 1.5 leases.
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  });
  ASSERT_NE(store, nullptr);
  SubmitJob(*store, MakeJob("job-00000001", v1::JOB_STATE_PENDING, 1));
  EXPECT_TRUE(a->Valid()) << "the renewal waited for the leader's own write";
  EXPECT_EQ(lost_.message(), "");
}

// A standby cannot take over while a write fenced under the old epoch is in flight: its takeover
// waits until that write has committed.
TEST_F(LeaderElectionTest, ATakeoverWaitsForTheOldLeadersFencedWrite) {
  // The leader never renews: its lease runs out while its write holds the fence.
  ASSERT_NO_FATAL_FAILURE(ElectLeaderWithStandby(absl::Seconds(600)));
  absl::Mutex mu;
  bool passed = false;
  std::chrono::steady_clock::time_point released;
  std::unique_ptr<Store> store = FencedStore(leader_.get(), [&](const absl::Status& fenced) {
    {
      absl::MutexLock lock(&mu);
      passed = fenced.ok();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    absl::MutexLock lock(&mu);
    released = std::chrono::steady_clock::now();
  });
  ASSERT_NE(store, nullptr);
  std::thread writer([&] { SubmitJob(*store, MakeJob("job-00000001", v1::JOB_STATE_PENDING, 1)); });
  {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(&passed));
  }
  ASSERT_TRUE(testing::WaitUntil(
      [&] {
        absl::StatusOr<bool> taken = standby_->TryAcquire();
        return taken.ok() && *taken;
      },
      absl::Seconds(30), absl::Milliseconds(50)));
  const auto taken_at = std::chrono::steady_clock::now();
  writer.join();
  EXPECT_EQ(standby_->epoch(), 2);
  {
    absl::MutexLock lock(&mu);
    EXPECT_GT(taken_at, released) << "the standby took over under a write in flight";
  }
  absl::StatusOr<JobPage> jobs = store->ListJobs({}, 0, "");
  ASSERT_THAT(jobs.status(), IsOk());
  EXPECT_THAT(JobIds(jobs->jobs), ::testing::ElementsAre("job-00000001"));
}

TEST_F(LeaderElectionTest, ALeaderThatStopsRenewingStepsDownByItsOwnClock) {
  auto a = Elector("a:1", absl::Milliseconds(600), absl::Milliseconds(900));
  ASSERT_NE(a, nullptr);
  ASSERT_THAT(a->TryAcquire(), IsOkAndHolds(true));
  lost_.StartRenewing(*a);
  // The first renewal is due after the lease is over: the leader gives up rather than renew.
  EXPECT_TRUE(lost_.AwaitLoss(absl::Seconds(5)));
  EXPECT_EQ(lost_.message(), "lost leadership (epoch 1, not renewed for 600ms)");
  EXPECT_FALSE(a->Valid());
}

}  // namespace
}  // namespace tessera::coordinator

// CoordinatorClient against fake coordinators on 127.0.0.1 that behave as the HA contract says
// (a standby answers UNAVAILABLE naming the leader in `tessera-leader`): unary calls reach the
// leader, and Watch resumes a stream that drops, on the same coordinator or on a new leader, from
// the last event it delivered, never delivering one twice or skipping one.
#include "client/coordinator_client.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/daemon/leader_channel.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"

namespace tessera::client {
namespace {

using ::tessera::testing::IsOk;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

constexpr int kEvents = 9;

// A coordinator whose job-1 has events 1..kEvents. While leading, a WatchJob stream sends the
// events after the request's after_sequence, dropping (UNAVAILABLE) after `drop_after` events
// when set, and ends OK after the last; `replay` sends from event 1 whatever was asked (a
// coordinator that does not honour after_sequence).
class FakeCoordinator final : public v1::Coordinator::Service {
 public:
  FakeCoordinator() {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
    address_ = absl::StrCat("127.0.0.1:", port);
  }
  ~FakeCoordinator() override { server_->Shutdown(); }
  const std::string& address() const { return address_; }

  void StandBy(const std::string& leader) {
    absl::MutexLock lock(&mu_);
    leading_ = false;
    leader_ = leader;
  }
  void Lead() {
    absl::MutexLock lock(&mu_);
    leading_ = true;
  }
  // The next streams drop after `events` events each (0: they do not drop); after the drop, the
  // coordinator stands by naming `then_leader` when set.
  void DropAfter(int events, std::string then_leader = "") {
    absl::MutexLock lock(&mu_);
    drop_after_ = events;
    then_leader_ = std::move(then_leader);
  }
  void Replay() {
    absl::MutexLock lock(&mu_);
    replay_ = true;
  }
  // after_sequence of each WatchJob this coordinator served as leader.
  std::vector<int64_t> watch_requests() {
    absl::MutexLock lock(&mu_);
    return watch_requests_;
  }

  grpc::Status GetJob(grpc::ServerContext* context, const v1::GetJobRequest* request,
                      v1::GetJobResponse* response) override {
    absl::MutexLock lock(&mu_);
    if (!leading_) return StandbyLocked(context);
    // Says who answered.
    response->mutable_job()->set_job_id(absl::StrCat(request->job_id(), "@", address_));
    return grpc::Status::OK;
  }

  grpc::Status WatchJob(grpc::ServerContext* context, const v1::WatchJobRequest* request,
                        grpc::ServerWriter<v1::JobEvent>* writer) override {
    absl::MutexLock lock(&mu_);
    if (!leading_) return StandbyLocked(context);
    watch_requests_.push_back(request->after_sequence());
    int sent = 0;
    for (int64_t sequence = replay_ ? 1 : request->after_sequence() + 1; sequence <= kEvents;
         ++sequence) {
      if (drop_after_ > 0 && sent == drop_after_) {
        drop_after_ = 0;
        if (!then_leader_.empty()) {
          leading_ = false;
          leader_ = then_leader_;
        }
        return grpc::Status(grpc::StatusCode::UNAVAILABLE, "stream dropped");
      }
      v1::JobEvent event;
      event.set_job_id(request->job_id());
      event.set_sequence(sequence);
      event.mutable_metrics()->set_step(sequence);
      writer->Write(event);
      ++sent;
    }
    return grpc::Status::OK;
  }

 private:
  grpc::Status StandbyLocked(grpc::ServerContext* context) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!leader_.empty()) context->AddTrailingMetadata(kLeaderMetadataKey, leader_);
    return grpc::Status(
        grpc::StatusCode::UNAVAILABLE,
        absl::StrCat("coordinator ", address_, " is a standby; ",
                     leader_.empty() ? "no leader is elected yet" : "the leader is at " + leader_));
  }

  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  absl::Mutex mu_;
  bool leading_ ABSL_GUARDED_BY(mu_) = true;
  std::string leader_ ABSL_GUARDED_BY(mu_);
  int drop_after_ ABSL_GUARDED_BY(mu_) = 0;
  std::string then_leader_ ABSL_GUARDED_BY(mu_);
  bool replay_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<int64_t> watch_requests_ ABSL_GUARDED_BY(mu_);
};

// The sequences Watch delivered, in order.
std::vector<int64_t> WatchAll(CoordinatorClient& client, absl::Status* status, int64_t after = 0) {
  std::vector<int64_t> seen;
  *status = client.Watch("job-1", after, [&](const v1::JobEvent& event) {
    seen.push_back(event.sequence());
    return true;
  });
  return seen;
}

std::vector<int64_t> Range(int64_t from, int64_t to) {
  std::vector<int64_t> range;
  for (int64_t i = from; i <= to; ++i) range.push_back(i);
  return range;
}

TEST(CoordinatorClientTest, UnaryCallsReachTheLeaderBehindAStandby) {
  FakeCoordinator standby, leader;
  standby.StandBy(leader.address());
  CoordinatorClient client({.address = absl::StrCat(standby.address(), ",", leader.address())});
  auto job = client.Get("job-1");
  ASSERT_THAT(job, IsOk());
  EXPECT_EQ(job->job_id(), "job-1@" + leader.address()) << "answered by the standby";
}

TEST(CoordinatorClientTest, NoLeaderNamesEveryAddress) {
  FakeCoordinator a, b;
  a.StandBy("");
  b.StandBy("");
  CoordinatorClient client(
      {.address = absl::StrCat(a.address(), ",", b.address()), .timeout = absl::Milliseconds(400)});
  auto job = client.Get("job-1");
  EXPECT_EQ(job.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(job.status().message(), HasSubstr(a.address()));
  EXPECT_THAT(job.status().message(), HasSubstr(b.address()));
  EXPECT_THAT(job.status().message(), HasSubstr("no leader is elected yet"));
}

TEST(CoordinatorClientTest, ABadAddressListNamesTheFlag) {
  CoordinatorClient client({.address = "a:1,b"});
  auto job = client.Get("job-1");
  EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(job.status().message(), HasSubstr("--coordinator"));
}

TEST(CoordinatorClientTest, WatchResumesADroppedStreamOnOneCoordinator) {
  FakeCoordinator coordinator;
  coordinator.DropAfter(4);
  CoordinatorClient client({.address = coordinator.address()});
  absl::Status status;
  EXPECT_THAT(WatchAll(client, &status), ElementsAreArray(Range(1, kEvents)));
  EXPECT_THAT(status, IsOk());
  EXPECT_THAT(coordinator.watch_requests(), ElementsAre(0, 4));
}

TEST(CoordinatorClientTest, WatchResumesOnTheNewLeaderAfterTheLastEventSeen) {
  FakeCoordinator old_leader, new_leader;
  new_leader.StandBy(old_leader.address());
  // The old leader steps down mid-stream and names the new one.
  old_leader.DropAfter(3, new_leader.address());
  CoordinatorClient client(
      {.address = absl::StrCat(old_leader.address(), ",", new_leader.address())});
  new_leader.Lead();
  absl::Status status;
  EXPECT_THAT(WatchAll(client, &status, 2), ElementsAreArray(Range(3, kEvents)));
  EXPECT_THAT(status, IsOk());
  EXPECT_THAT(old_leader.watch_requests(), ElementsAre(2));
  EXPECT_THAT(new_leader.watch_requests(), ElementsAre(5));
}

TEST(CoordinatorClientTest, WatchNeverDeliversAnEventTwice) {
  FakeCoordinator coordinator;
  coordinator.DropAfter(5);
  coordinator.Replay();
  CoordinatorClient client({.address = coordinator.address()});
  absl::Status status;
  EXPECT_THAT(WatchAll(client, &status), ElementsAreArray(Range(1, kEvents)));
  EXPECT_THAT(status, IsOk());
}

TEST(CoordinatorClientTest, WatchGivesUpAfterTheReconnectTimeout) {
  FakeCoordinator coordinator;
  coordinator.DropAfter(2, "");
  CoordinatorClient client(
      {.address = coordinator.address(), .reconnect_timeout = absl::Milliseconds(500)});
  std::vector<int64_t> seen;
  absl::Status status = client.Watch("job-1", 0, [&](const v1::JobEvent& event) {
    seen.push_back(event.sequence());
    // Once two events arrived, the coordinator goes away for good.
    if (seen.size() == 2) coordinator.StandBy("");
    return true;
  });
  EXPECT_THAT(seen, ElementsAre(1, 2));
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(status.message(), HasSubstr(coordinator.address()));
}

}  // namespace
}  // namespace tessera::client

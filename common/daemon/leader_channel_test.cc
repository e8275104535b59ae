// LeaderChannel against fake coordinators on 127.0.0.1 that behave as the HA contract says: a
// standby answers UNAVAILABLE with the leader's address in `tessera-leader` (or without it while
// none is elected), the leader answers.
#include "common/daemon/leader_channel.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "tessera/v1/node_service.grpc.pb.h"
#include "tests/util/wait.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

// A coordinator's NodeService that leads (answers RegisterNode with its epoch) or stands by.
class FakeCoordinator final : public v1::NodeService::Service {
 public:
  FakeCoordinator() {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
    address_ = "127.0.0.1:" + std::to_string(port);
  }
  ~FakeCoordinator() override { server_->Shutdown(); }

  const std::string& address() const { return address_; }

  void Lead(int64_t epoch) {
    absl::MutexLock lock(&mu_);
    leading_ = true;
    epoch_ = epoch;
  }
  // `leader` empty: no leader elected yet (no metadata).
  void StandBy(const std::string& leader) {
    absl::MutexLock lock(&mu_);
    leading_ = false;
    leader_ = leader;
  }
  int calls() const {
    absl::MutexLock lock(&mu_);
    return calls_;
  }

  grpc::Status RegisterNode(grpc::ServerContext* context, const v1::RegisterNodeRequest*,
                            v1::RegisterNodeResponse* response) override {
    absl::MutexLock lock(&mu_);
    ++calls_;
    if (leading_) {
      response->set_leader_epoch(epoch_);
      return grpc::Status::OK;
    }
    if (!leader_.empty()) context->AddTrailingMetadata(kLeaderMetadataKey, leader_);
    return grpc::Status(
        grpc::StatusCode::UNAVAILABLE,
        "coordinator " + address_ + " is a standby; " +
            (leader_.empty() ? "no leader is elected yet" : "the leader is at " + leader_));
  }

 private:
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  mutable absl::Mutex mu_;
  bool leading_ ABSL_GUARDED_BY(mu_) = false;
  int64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  std::string leader_ ABSL_GUARDED_BY(mu_);
  int calls_ ABSL_GUARDED_BY(mu_) = 0;
};

// A loopback address nothing listens on (a coordinator that is down).
std::string DeadAddress() {
  FakeCoordinator gone;
  return gone.address();
}

struct Answer {
  grpc::Status status;
  int64_t epoch = -1;
  std::string address;
};

Answer Register(LeaderChannel& channel, absl::Duration timeout = absl::Seconds(5)) {
  Answer answer;
  const absl::Time deadline = absl::Now() + timeout;
  answer.status = channel.Call(
      deadline,
      [deadline](grpc::ClientContext& context) {
        context.set_deadline(absl::ToChronoTime(deadline));
      },
      [&](grpc::ClientContext& context, const std::shared_ptr<grpc::Channel>& ch,
          const std::string& address) {
        v1::RegisterNodeResponse response;
        grpc::Status status = v1::NodeService::NewStub(ch)->RegisterNode(&context, {}, &response);
        answer.epoch = response.leader_epoch();
        answer.address = address;
        return status;
      });
  return answer;
}

TEST(ParseCoordinatorAddressesTest, SplitsTrimsAndNamesTheField) {
  auto parsed = ParseCoordinatorAddresses(" a:1, b:2,,c:3 ", "--coordinator");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_THAT(*parsed, ::testing::ElementsAre("a:1", "b:2", "c:3"));
  auto no_port = ParseCoordinatorAddresses("a:1,b", "--coordinator");
  EXPECT_EQ(no_port.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(no_port.status().message(), HasSubstr("--coordinator"));
  EXPECT_THAT(no_port.status().message(), HasSubstr("\"b\""));
  EXPECT_EQ(ParseCoordinatorAddresses(" , ", "coordinator").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(LeaderChannelTest, StandbyFirstSendsTheCallToTheLeaderItNames) {
  FakeCoordinator standby, leader;
  leader.Lead(7);
  standby.StandBy(leader.address());
  LeaderChannel channel({.addresses = {standby.address(), leader.address()}});
  Answer first = Register(channel);
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_EQ(first.epoch, 7);
  EXPECT_EQ(first.address, leader.address());
  EXPECT_EQ(channel.leader(), leader.address());
  // Later calls go to the leader directly.
  ASSERT_TRUE(Register(channel).status.ok());
  EXPECT_EQ(standby.calls(), 1);
  EXPECT_EQ(leader.calls(), 2);
}

TEST(LeaderChannelTest, StandbyWithoutLeaderAndDeadAddressMoveToTheNext) {
  FakeCoordinator standby, leader;
  standby.StandBy("");
  leader.Lead(1);
  LeaderChannel channel({.addresses = {DeadAddress(), standby.address(), leader.address()}});
  Answer answer = Register(channel);
  ASSERT_TRUE(answer.status.ok()) << answer.status.error_message();
  EXPECT_EQ(answer.address, leader.address());
  EXPECT_EQ(standby.calls(), 1);
}

TEST(LeaderChannelTest, FollowsTheLeaderWhenItMovesEvenOutsideTheList) {
  FakeCoordinator a, b, outside;
  a.Lead(1);
  b.StandBy(a.address());
  LeaderChannel channel({.addresses = {a.address(), b.address()}});
  ASSERT_TRUE(Register(channel).status.ok());
  EXPECT_EQ(channel.leader(), a.address());
  // A new leader that is not in the list takes over; the old one steps down and names it.
  outside.Lead(2);
  a.StandBy(outside.address());
  b.StandBy(outside.address());
  Answer moved = Register(channel);
  ASSERT_TRUE(moved.status.ok()) << moved.status.error_message();
  EXPECT_EQ(moved.epoch, 2);
  EXPECT_EQ(moved.address, outside.address());
  EXPECT_EQ(b.calls(), 0);
  // The old leader comes back as leader of epoch 3 after the outside one died.
  const std::string gone = outside.address();
  a.Lead(3);
  b.StandBy(a.address());
  // The outside one refuses without a hint: the list is tried from where it left off.
  outside.StandBy("");
  Answer back = Register(channel);
  ASSERT_TRUE(back.status.ok()) << back.status.error_message();
  EXPECT_EQ(back.epoch, 3);
  EXPECT_EQ(channel.leader(), a.address());
  EXPECT_NE(channel.leader(), gone);
}

TEST(LeaderChannelTest, NoLeaderUntilTheDeadlineNamesEveryAddressAndBacksOff) {
  FakeCoordinator a, b;
  a.StandBy("");
  b.StandBy("");
  const std::string dead = DeadAddress();
  LeaderChannel channel({.addresses = {a.address(), b.address(), dead}});
  const absl::Time start = absl::Now();
  Answer answer = Register(channel, absl::Milliseconds(700));
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(answer.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(answer.status.error_message(), HasSubstr("no coordinator answered as leader"));
  EXPECT_THAT(answer.status.error_message(), HasSubstr(a.address()));
  EXPECT_THAT(answer.status.error_message(), HasSubstr(b.address()));
  EXPECT_THAT(answer.status.error_message(), HasSubstr(dead));
  EXPECT_THAT(answer.status.error_message(), HasSubstr("no leader is elected yet"));
  EXPECT_GE(took, absl::Milliseconds(650));
  EXPECT_LT(took, absl::Seconds(3));
  // Backoff of 100, 200, 400 ms between rounds: a few rounds, not a busy loop.
  EXPECT_GE(a.calls(), 2);
  EXPECT_LE(a.calls(), 5);
}

// A coordinator that accepts connections and never answers (paused with SIGSTOP, say): the
// kernel completes the TCP handshake on the listening socket, nothing speaks HTTP/2.
class HungCoordinator {
 public:
  HungCoordinator() {
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t size = sizeof(addr);
    if (bind(fd_, reinterpret_cast<sockaddr*>(&addr), size) != 0 || listen(fd_, 16) != 0 ||
        getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &size) != 0) {
      ADD_FAILURE() << "cannot listen on loopback";
    }
    address_ = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
  }
  ~HungCoordinator() { close(fd_); }
  const std::string& address() const { return address_; }

 private:
  int fd_ = -1;
  std::string address_;
};

TEST(LeaderChannelTest, AHungCoordinatorCostsOneCallThenTheNextAddressIsTried) {
  HungCoordinator hung;
  FakeCoordinator leader;
  leader.Lead(4);
  LeaderChannel channel({.addresses = {hung.address(), leader.address()}});
  Answer stuck = Register(channel, absl::Milliseconds(500));
  EXPECT_EQ(stuck.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(channel.leader(), leader.address());
  Answer next = Register(channel);
  ASSERT_TRUE(next.status.ok()) << next.status.error_message();
  EXPECT_EQ(next.epoch, 4);
}

TEST(LeaderChannelTest, OneAddressMakesOneAttemptAsBefore) {
  const std::string dead = DeadAddress();
  LeaderChannel channel({.addresses = {dead}});
  const absl::Time start = absl::Now();
  Answer answer = Register(channel, absl::Seconds(5));
  EXPECT_EQ(answer.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(answer.status.error_message(), ::testing::Not(HasSubstr("answered as leader")));
  EXPECT_LT(absl::Now() - start, absl::Seconds(4));
}

TEST(LeaderChannelTest, AnErrorTheLeaderAnswersEndsTheCall) {
  FakeCoordinator leader, other;
  leader.Lead(1);
  other.Lead(1);
  LeaderChannel channel({.addresses = {leader.address(), other.address()}});
  int attempts = 0;
  grpc::Status status = channel.Call(
      absl::Now() + absl::Seconds(5), [](grpc::ClientContext&) {},
      [&](grpc::ClientContext&, const std::shared_ptr<grpc::Channel>&, const std::string&) {
        ++attempts;
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "spec.name: empty");
      });
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(), "spec.name: empty");
  EXPECT_EQ(attempts, 1);
}

TEST(LeaderChannelTest, ShutdownEndsTheBackoff) {
  FakeCoordinator a, b;
  a.StandBy("");
  b.StandBy("");
  LeaderChannel channel({.addresses = {a.address(), b.address()},
                         .initial_backoff = absl::Seconds(30),
                         .max_backoff = absl::Seconds(30)});
  std::thread stopper([&] {
    // Both standbys refused once: the channel is in its 30 s back-off.
    testing::WaitUntil([&] { return a.calls() >= 1 && b.calls() >= 1; }, absl::Seconds(10));
    channel.Shutdown();
  });
  const absl::Time start = absl::Now();
  Answer answer = Register(channel, absl::Seconds(20));
  stopper.join();
  EXPECT_EQ(answer.status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

}  // namespace
}  // namespace tessera

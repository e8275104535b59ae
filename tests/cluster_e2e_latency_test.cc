// The whole system over a slow network: the coordinator and two workers on hosts of their own
// (network namespaces, tests/util/netns.h), latency added with NetnsLab::Delay (NFQUEUE,
// tests/util/packet_delay.h). A worker 150 ms away from the coordinator, each way, sees a gRPC
// round trip of at least 300 ms, yet registers, heartbeats without being taken for lost, runs its
// rank and the job SUCCEEDS in one attempt; workers 100 ms apart train a two-rank job across the
// slow link (Gloo's traffic is held), and it SUCCEEDS too.
// Needs root (as CI runs); skips otherwise with the reason.

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/create_channel_posix.h"
#include "gtest/gtest.h"
#include "tests/cluster_e2e_fixture.h"

namespace tessera {
namespace {

using ::grpc::health::v1::Health;
using ::grpc::health::v1::HealthCheckRequest;
using ::grpc::health::v1::HealthCheckResponse;

constexpr int kCoordinatorHost = 0;
constexpr int kFirstWorkerHost = 1;
constexpr int kSecondWorkerHost = 2;

class LatencyTest : public TwoWorkerClusterTest {
 protected:
  void SetUp() override {
    auto lab = testing::NetnsLab::Create(3);
    if (!lab.ok()) GTEST_SKIP() << lab.status().message();
    lab_ = std::move(*lab);
    TwoWorkerClusterTest::SetUp();
  }

  // A job with one rank on each worker.
  v1::JobSpec TwoNodeSpec(int steps) {
    v1::JobSpec spec = Spec(steps);
    spec.mutable_resources()->set_cpu_slots(2);
    return spec;
  }

  void ExpectEveryStepOnce(const std::vector<v1::StepMetrics>& curve, int steps) {
    ASSERT_EQ(curve.size(), static_cast<size_t>(steps));
    for (int i = 0; i < steps; ++i) EXPECT_EQ(curve[i].step(), i + 1);
  }

  // Round trips of grpc.health.v1 Check to the coordinator from `host`'s side of the network (a
  // channel over a socket made on that host), after one call that sets the connection up;
  // sorted.
  std::vector<absl::Duration> HealthRoundTrips(int host, int calls) {
    const size_t colon = address_.rfind(':');
    auto fd =
        lab_->ConnectFrom(host, address_.substr(0, colon), std::stoi(address_.substr(colon + 1)));
    EXPECT_THAT(fd, IsOk());
    if (!fd.ok()) return {};
    // As on gRPC's own sockets: without it Nagle holds a call's second frame for the first's
    // ACK, a second round trip per call.
    const int one = 1;
    setsockopt(*fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    // The channel owns the socket from here.
    auto stub = Health::NewStub(grpc::CreateInsecureChannelFromFd("coordinator", *fd));
    std::vector<absl::Duration> rtts;
    for (int i = 0; i <= calls; ++i) {
      HealthCheckResponse response;
      const absl::Time start = absl::Now();
      const grpc::Status status = stub->Check(Context().get(), HealthCheckRequest(), &response);
      const absl::Duration took = absl::Now() - start;
      EXPECT_TRUE(status.ok()) << status.error_message();
      EXPECT_EQ(response.status(), HealthCheckResponse::SERVING);
      if (i > 0) rtts.push_back(took);
    }
    std::sort(rtts.begin(), rtts.end());
    return rtts;
  }

  // Runs a two-rank job of `steps` to SUCCEEDED in one attempt, every step reported once;
  // {its median step time in seconds}, or {} after a failed assertion.
  std::vector<double> MedianStepTime(int steps) {
    const std::string job_id = Submit(TwoNodeSpec(steps));
    v1::Job job = WaitFor(job_id, v1::JOB_STATE_SUCCEEDED, 240);
    EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
    EXPECT_EQ(job.attempts_size(), 1);
    if (job.state() != v1::JOB_STATE_SUCCEEDED || job.attempts(0).world_size() != 2) return {};
    const std::vector<v1::StepMetrics> curve = Curve(job_id);
    ExpectEveryStepOnce(curve, steps);
    std::vector<double> step_times;
    for (const v1::StepMetrics& point : curve) step_times.push_back(point.step_time_seconds());
    if (step_times.empty()) return {};
    std::sort(step_times.begin(), step_times.end());
    return {step_times[step_times.size() / 2]};
  }

  bool BothNodesReady() {
    v1::ListNodesResponse nodes;
    if (!stub_->ListNodes(Context().get(), {}, &nodes).ok()) return false;
    int ready = 0;
    for (const v1::Node& node : nodes.nodes()) ready += node.state() == v1::NODE_STATE_READY;
    return ready == 2;
  }
};

TEST_F(LatencyTest, AWorkerFarFromTheCoordinatorHeartbeatsTrainsAndSucceeds) {
  const absl::Duration delay = absl::Milliseconds(150);
  const std::vector<absl::Duration> near = HealthRoundTrips(kSecondWorkerHost, 3);
  ASSERT_FALSE(near.empty());
  EXPECT_LT(near.front(), absl::Milliseconds(100)) << "before any latency";

  ASSERT_THAT(
      lab_->Delay(kSecondWorkerHost, delay, absl::ZeroDuration(), lab_->Ip(kCoordinatorHost)),
      IsOk());
  // The added latency is what the worker's control plane sees: at least 2 * 150 ms per call,
  // and not much more (the median within 200 ms of it).
  const std::vector<absl::Duration> far = HealthRoundTrips(kSecondWorkerHost, 5);
  ASSERT_EQ(far.size(), 5u);
  EXPECT_GE(far.front(), 2 * delay);
  EXPECT_LT(far[far.size() / 2], 2 * delay + absl::Milliseconds(200));

  const std::string job_id = Submit(TwoNodeSpec(40));
  // Heartbeats every 500 ms, each 300 ms late, against a 3 s timeout: never taken for lost.
  bool always_ready = true;
  v1::Job job;
  ASSERT_TRUE(testing::WaitUntil(
      [&] {
        always_ready = always_ready && BothNodesReady();
        job = Get(job_id);
        return job.state() == v1::JOB_STATE_SUCCEEDED || job.state() == v1::JOB_STATE_FAILED;
      },
      absl::Seconds(240), absl::Milliseconds(250)))
      << job.ShortDebugString();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
  EXPECT_TRUE(always_ready) << "a node was not READY while the job ran";
  EXPECT_EQ(job.attempts_size(), 1) << "the latency cost the job a restart";
  ASSERT_EQ(job.attempts(0).world_size(), 2);
  const std::vector<v1::StepMetrics> curve = Curve(job_id);
  ExpectEveryStepOnce(curve, 40);
  EXPECT_GT(lab_->DelayedPackets(kSecondWorkerHost), 0);
  std::vector<double> step_times;
  for (const v1::StepMetrics& point : curve) step_times.push_back(point.step_time_seconds());
  std::sort(step_times.begin(), step_times.end());
  std::cout << "median step time, workers undelayed between them: "
            << step_times[step_times.size() / 2] << " s" << std::endl;
}

TEST_F(LatencyTest, WorkersFarFromEachOtherTrainAcrossTheSlowLinkAndSucceed) {
  constexpr int kSteps = 12;
  // The same two-rank job on the undelayed network, then across 100 ms each way between the
  // workers.
  const std::vector<double> near = MedianStepTime(kSteps);
  const absl::Duration delay = absl::Milliseconds(100);
  ASSERT_THAT(
      lab_->Delay(kFirstWorkerHost, delay, absl::ZeroDuration(), lab_->Ip(kSecondWorkerHost)),
      IsOk());
  const std::vector<double> far = MedianStepTime(kSteps);
  ASSERT_FALSE(near.empty());
  ASSERT_FALSE(far.empty());
  // The ranks' traffic crossed the delayed path (only packets between the two workers are
  // held). Their step times are printed, not asserted: on this shared machine the medians of
  // one run measured 1.25 s undelayed and 2.00 s delayed, another 1.61 s and 1.59 s (not yet
  // understood), a third 0.58 s and 2.65 s (about ten 200 ms round trips a step).
  EXPECT_GT(lab_->DelayedPackets(kFirstWorkerHost), 0);
  std::cout << "median step time undelayed: " << near[0]
            << " s; with 100 ms each way between the workers: " << far[0] << " s" << std::endl;
}

}  // namespace
}  // namespace tessera

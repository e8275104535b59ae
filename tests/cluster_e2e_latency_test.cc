// The whole system over a slow network: the coordinator and two workers on hosts of their own
// (network namespaces, tests/util/netns.h), latency added with NetnsLab::Delay (NFQUEUE,
// tests/util/packet_delay.h). A worker 150 ms away from the coordinator, each way, sees a gRPC
// round trip of at least 300 ms, yet registers, heartbeats without being taken for lost, runs its
// rank and the job SUCCEEDS in one attempt; workers 100 ms apart train a two-rank job whose steps
// take at least a round trip longer (Gloo's collectives cross the slow link), and it SUCCEEDS too.
// Needs root (as CI runs); skips otherwise with the reason.

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
  ExpectEveryStepOnce(Curve(job_id), 40);
  EXPECT_GT(lab_->DelayedPackets(kSecondWorkerHost), 0);
}

TEST_F(LatencyTest, WorkersFarFromEachOtherTrainSlowerStepsAndSucceed) {
  const absl::Duration delay = absl::Milliseconds(100);
  ASSERT_THAT(
      lab_->Delay(kFirstWorkerHost, delay, absl::ZeroDuration(), lab_->Ip(kSecondWorkerHost)),
      IsOk());
  const std::string job_id = Submit(TwoNodeSpec(30));
  v1::Job job = WaitFor(job_id, v1::JOB_STATE_SUCCEEDED, 240);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
  EXPECT_EQ(job.attempts_size(), 1);
  ASSERT_EQ(job.attempts(0).world_size(), 2);
  std::vector<v1::StepMetrics> curve = Curve(job_id);
  ExpectEveryStepOnce(curve, 30);
  // Each step all-reduces the gradients over the slow link: the ranks wait for each other's
  // data at least a round trip (2 * 100 ms), where the same step takes tens of milliseconds on
  // an undelayed network.
  std::vector<double> step_times;
  for (const v1::StepMetrics& point : curve) step_times.push_back(point.step_time_seconds());
  std::sort(step_times.begin(), step_times.end());
  EXPECT_GE(step_times[step_times.size() / 2], absl::ToDoubleSeconds(2 * delay));
  std::cout << "median step time with 100 ms between the workers: "
            << step_times[step_times.size() / 2] << " s" << std::endl;
}

}  // namespace
}  // namespace tessera

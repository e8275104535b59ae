// CoordinatorMetrics: the exposition text the coordinator serves on /metrics,
// its gRPC interceptor against a real server on 127.0.0.1, and promtool's
// lint of the whole exposition.

#include "coordinator/service/coordinator_metrics.h"

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "common/clock.h"
#include "common/status_matchers.h"
#include "coordinator/jobs/job_manager.h"
#include "coordinator/store/store.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "tessera/v1/worker_service.grpc.pb.h"
#include "tests/util/job_specs.h"
#include "tests/util/subprocess.h"
#include "tests/util/temp_dir.h"

namespace tessera::coordinator {
namespace {

using ::tessera::testing::IsOk;
using ::testing::AllOf;
using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kGetNode[] = "/tessera.v1.Worker/GetNode";
constexpr char kReadLogs[] = "/tessera.v1.Worker/ReadLogs";

// The registry's families and the per-job ones, as the daemon's exposer serves them.
std::string Exposition(prometheus::Registry& registry, const CoordinatorMetrics& metrics) {
  std::vector<prometheus::MetricFamily> families = registry.Collect();
  for (prometheus::MetricFamily& family : metrics.job_series()->Collect()) {
    families.push_back(std::move(family));
  }
  return prometheus::TextSerializer().Serialize(families);
}

// Every line of the exposition, so a test can match whole lines: a substring
// match would take `x{...} 10` for `x{...} 1`.
std::vector<std::string> Lines(const std::string& text) {
  return absl::StrSplit(text, '\n', absl::SkipEmpty());
}

class CoordinatorMetricsTest : public ::testing::Test {
 protected:
  std::vector<std::string> ExpositionLines() { return Lines(Exposition(registry_, metrics_)); }

  prometheus::Registry registry_;
  CoordinatorMetrics metrics_{registry_};
};

TEST_F(CoordinatorMetricsTest, EveryJobStateIsExposedFromTheStart) {
  const std::vector<std::string> lines = ExpositionLines();
  for (const char* state :
       {"pending", "scheduled", "running", "restarting", "succeeded", "failed", "cancelled"}) {
    EXPECT_THAT(lines, Contains(absl::StrCat("tessera_jobs{state=\"", state, "\"} 0")));
  }
  EXPECT_THAT(Exposition(registry_, metrics_), Not(HasSubstr("unspecified")));
}

TEST_F(CoordinatorMetricsTest, JobCountsAreSetWholesaleAndMissingStatesReadZero) {
  metrics_.SetJobCounts({{v1::JOB_STATE_PENDING, 3}, {v1::JOB_STATE_RUNNING, 2}});
  metrics_.SetJobCounts({{v1::JOB_STATE_RUNNING, 5}, {v1::JOB_STATE_SUCCEEDED, 11}});

  const std::vector<std::string> lines = ExpositionLines();
  EXPECT_THAT(lines, Contains("# HELP tessera_jobs Jobs known to the coordinator, by state."));
  EXPECT_THAT(lines, Contains("# TYPE tessera_jobs gauge"));
  EXPECT_THAT(lines, Contains("tessera_jobs{state=\"pending\"} 0"));
  EXPECT_THAT(lines, Contains("tessera_jobs{state=\"running\"} 5"));
  EXPECT_THAT(lines, Contains("tessera_jobs{state=\"succeeded\"} 11"));
  EXPECT_THAT(lines, Contains("tessera_jobs{state=\"failed\"} 0"));
}

TEST_F(CoordinatorMetricsTest, UnspecifiedStatesAreIgnored) {
  metrics_.SetJobCounts({{v1::JOB_STATE_UNSPECIFIED, 4}, {v1::JOB_STATE_FAILED, 1}});
  metrics_.SetNodeCounts({{v1::NODE_STATE_UNSPECIFIED, 4}, {v1::NODE_STATE_LOST, 1}});

  const std::string text = Exposition(registry_, metrics_);
  EXPECT_THAT(text, Not(HasSubstr("unspecified")));
  EXPECT_THAT(Lines(text), Contains("tessera_jobs{state=\"failed\"} 1"));
  EXPECT_THAT(Lines(text), Contains("tessera_nodes{state=\"lost\"} 1"));
}

TEST_F(CoordinatorMetricsTest, NodeCountsCoverEveryState) {
  metrics_.SetNodeCounts({{v1::NODE_STATE_READY, 7}, {v1::NODE_STATE_LOST, 1}});

  const std::vector<std::string> lines = ExpositionLines();
  EXPECT_THAT(lines, Contains("# TYPE tessera_nodes gauge"));
  EXPECT_THAT(lines, Contains("tessera_nodes{state=\"ready\"} 7"));
  EXPECT_THAT(lines, Contains("tessera_nodes{state=\"draining\"} 0"));
  EXPECT_THAT(lines, Contains("tessera_nodes{state=\"lost\"} 1"));
}

TEST_F(CoordinatorMetricsTest, GpusAndCpuSlotsAreCapacityAndAllocatedGauges) {
  metrics_.SetGpus(16, 12);
  metrics_.SetCpuSlots(64, 3);

  const std::vector<std::string> lines = ExpositionLines();
  EXPECT_THAT(lines, Contains("# TYPE tessera_gpus_capacity gauge"));
  EXPECT_THAT(lines, Contains("tessera_gpus_capacity 16"));
  EXPECT_THAT(lines, Contains("tessera_gpus_allocated 12"));
  EXPECT_THAT(lines, Contains("tessera_cpu_slots_capacity 64"));
  EXPECT_THAT(lines, Contains("tessera_cpu_slots_allocated 3"));
}

TEST_F(CoordinatorMetricsTest, QueuesHaveSeriesOfTheirOwnUntilTheyAreGone) {
  EXPECT_THAT(Exposition(registry_, metrics_), Not(HasSubstr("tessera_queue_used_gpus{")));
  ClusterStats::QueueFigures nlp;
  nlp.nominal = {.gpus = 8, .cpu_slots = 0};
  nlp.used = {.gpus = 12, .cpu_slots = 0};
  nlp.borrowed = {.gpus = 4, .cpu_slots = 0};
  nlp.waiting_jobs = 3;
  nlp.fair_share = 0.25;
  ClusterStats::QueueFigures vision;
  vision.nominal = {.gpus = 8, .cpu_slots = 2};
  metrics_.SetQueues({{"nlp", nlp}, {"vision", vision}});
  std::vector<std::string> lines = ExpositionLines();
  EXPECT_THAT(lines, Contains("# TYPE tessera_queue_used_gpus gauge"));
  EXPECT_THAT(lines, Contains("tessera_queue_nominal_gpus{queue=\"nlp\"} 8"));
  EXPECT_THAT(lines, Contains("tessera_queue_used_gpus{queue=\"nlp\"} 12"));
  EXPECT_THAT(lines, Contains("tessera_queue_borrowed_gpus{queue=\"nlp\"} 4"));
  EXPECT_THAT(lines, Contains("tessera_queue_waiting_jobs{queue=\"nlp\"} 3"));
  EXPECT_THAT(lines, Contains("tessera_queue_fair_share{queue=\"nlp\"} 0.25"));
  EXPECT_THAT(lines, Contains("tessera_queue_nominal_cpu_slots{queue=\"vision\"} 2"));
  EXPECT_THAT(lines, Contains("tessera_queue_used_gpus{queue=\"vision\"} 0"));

  // A queue removed from the file loses its series.
  metrics_.SetQueues({{"nlp", nlp}});
  lines = ExpositionLines();
  EXPECT_THAT(lines, Contains("tessera_queue_used_gpus{queue=\"nlp\"} 12"));
  EXPECT_THAT(Exposition(registry_, metrics_), Not(HasSubstr("vision")));
}

TEST_F(CoordinatorMetricsTest, QueuePreemptionsAdvanceByTheDifferenceAndRunningJobsAreAGauge) {
  ClusterStats::QueueFigures nlp;
  nlp.running_jobs = 4;
  metrics_.SetQueues({{"nlp", nlp}});
  std::vector<std::string> lines = ExpositionLines();
  EXPECT_THAT(lines, Contains("tessera_queue_running_jobs{queue=\"nlp\"} 4"));
  EXPECT_THAT(lines, Contains("# TYPE tessera_queue_preemptions_total counter"));
  // Every reason's counter exists at 0 from the queue's first figures.
  EXPECT_THAT(lines,
              Contains("tessera_queue_preemptions_total{queue=\"nlp\",reason=\"reclaim\"} 0"));
  EXPECT_THAT(lines,
              Contains("tessera_queue_preemptions_total{queue=\"nlp\",reason=\"priority\"} 0"));
  EXPECT_THAT(lines, Contains("tessera_queue_wait_seconds_count{queue=\"nlp\"} 0"));

  // Cumulative figures: the counters follow them, and a repeated figure adds nothing.
  nlp.preemptions = {{"reclaim", 2}};
  nlp.running_jobs = 1;
  metrics_.SetQueues({{"nlp", nlp}});
  nlp.preemptions = {{"reclaim", 3}, {"priority", 1}};
  metrics_.SetQueues({{"nlp", nlp}});
  metrics_.SetQueues({{"nlp", nlp}});
  lines = ExpositionLines();
  EXPECT_THAT(lines,
              Contains("tessera_queue_preemptions_total{queue=\"nlp\",reason=\"reclaim\"} 3"));
  EXPECT_THAT(lines,
              Contains("tessera_queue_preemptions_total{queue=\"nlp\",reason=\"priority\"} 1"));
  EXPECT_THAT(lines, Contains("tessera_queue_running_jobs{queue=\"nlp\"} 1"));
}

TEST_F(CoordinatorMetricsTest, QueueWaitsAreAHistogramPerQueueFromSecondsToDays) {
  metrics_.ObserveQueueWait("nlp", 0.05);
  metrics_.ObserveQueueWait("nlp", 90);
  metrics_.ObserveQueueWait("nlp", 2 * 86400.0);
  metrics_.ObserveQueueWait("vision", 3);
  const std::vector<std::string> lines = ExpositionLines();
  EXPECT_THAT(lines, Contains("# TYPE tessera_queue_wait_seconds histogram"));
  EXPECT_THAT(lines, Contains("tessera_queue_wait_seconds_count{queue=\"nlp\"} 3"));
  EXPECT_THAT(lines, Contains("tessera_queue_wait_seconds_bucket{queue=\"nlp\",le=\"0.1\"} 1"));
  EXPECT_THAT(lines, Contains("tessera_queue_wait_seconds_bucket{queue=\"nlp\",le=\"60\"} 1"));
  EXPECT_THAT(lines, Contains("tessera_queue_wait_seconds_bucket{queue=\"nlp\",le=\"300\"} 2"));
  EXPECT_THAT(lines, Contains("tessera_queue_wait_seconds_bucket{queue=\"nlp\",le=\"172800\"} 3"));
  EXPECT_THAT(lines, Contains("tessera_queue_wait_seconds_bucket{queue=\"nlp\",le=\"86400\"} 2"));
  EXPECT_THAT(lines, Contains("tessera_queue_wait_seconds_count{queue=\"vision\"} 1"));
}

v1::Job RunningJob(const std::string& job_id, int64_t step_seconds, int64_t checkpoint_seconds) {
  v1::Job job;
  job.set_job_id(job_id);
  job.set_state(v1::JOB_STATE_RUNNING);
  if (step_seconds > 0) {
    job.mutable_latest_metrics()->set_step(10);
    job.mutable_latest_metrics()->mutable_time()->set_seconds(step_seconds);
    job.mutable_latest_metrics()->mutable_time()->set_nanos(500000000);
  }
  if (checkpoint_seconds > 0) {
    job.mutable_latest_checkpoint()->set_path("/ckpt/step-10");
    job.mutable_latest_checkpoint()->mutable_create_time()->set_seconds(checkpoint_seconds);
  }
  return job;
}

TEST_F(CoordinatorMetricsTest, RunningJobsHaveTheirSeriesUntilTheyLeaveRunning) {
  EXPECT_THAT(Exposition(registry_, metrics_), Not(HasSubstr("tessera_job_running{")));
  metrics_.ObserveJob(RunningJob("job-a", 1700000000, 1699990000));
  // Running, but no step and no checkpoint yet: only the running series.
  metrics_.ObserveJob(RunningJob("job-b", 0, 0));
  std::vector<std::string> lines = ExpositionLines();
  EXPECT_THAT(lines, Contains("# TYPE tessera_job_running gauge"));
  EXPECT_THAT(lines, Contains("tessera_job_running{job_id=\"job-a\"} 1"));
  EXPECT_THAT(lines, Contains("tessera_job_running{job_id=\"job-b\"} 1"));
  EXPECT_THAT(lines,
              Contains("tessera_job_last_step_timestamp_seconds{job_id=\"job-a\"} 1700000000.5"));
  EXPECT_THAT(lines, Contains("tessera_job_last_checkpoint_timestamp_seconds{job_id=\"job-a\"} "
                              "1699990000"));
  EXPECT_THAT(Exposition(registry_, metrics_),
              Not(HasSubstr("tessera_job_last_step_timestamp_seconds{job_id=\"job-b\"}")));
  EXPECT_THAT(Exposition(registry_, metrics_),
              Not(HasSubstr("tessera_job_last_checkpoint_timestamp_seconds{job_id=\"job-b\"}")));

  // A newer step moves the gauge; the checkpoint's stays.
  metrics_.ObserveJob(RunningJob("job-a", 1700000060, 1699990000));
  lines = ExpositionLines();
  EXPECT_THAT(lines,
              Contains("tessera_job_last_step_timestamp_seconds{job_id=\"job-a\"} 1700000060.5"));
  EXPECT_THAT(lines, Contains("tessera_job_last_checkpoint_timestamp_seconds{job_id=\"job-a\"} "
                              "1699990000"));

  // job-a restarts: every series of it goes; job-b's stay.
  v1::Job restarting = RunningJob("job-a", 1700000060, 1699990000);
  restarting.set_state(v1::JOB_STATE_RESTARTING);
  metrics_.ObserveJob(restarting);
  const std::string text = Exposition(registry_, metrics_);
  EXPECT_THAT(text, Not(HasSubstr("job-a")));
  EXPECT_THAT(Lines(text), Contains("tessera_job_running{job_id=\"job-b\"} 1"));
  // Back to RUNNING: back with its figures.
  metrics_.ObserveJob(RunningJob("job-a", 1700000060, 1699990000));
  EXPECT_THAT(ExpositionLines(), Contains("tessera_job_running{job_id=\"job-a\"} 1"));
}

TEST_F(CoordinatorMetricsTest, SeededJobsShowUnlessACommitWasSeenSince) {
  // Committed after the metrics were made (so after the list the seed comes from may have been
  // read): the listed RUNNING copy of job-a is older and must not bring it back.
  v1::Job ended = RunningJob("job-a", 1700000000, 0);
  ended.set_state(v1::JOB_STATE_FAILED);
  metrics_.ObserveJob(ended);
  metrics_.SeedRunningJobs(
      {RunningJob("job-a", 1700000000, 0), RunningJob("job-s", 1600000000, 0)});
  std::string text = Exposition(registry_, metrics_);
  EXPECT_THAT(text, Not(HasSubstr("job-a")));
  // A stalled job that reports nothing after the restart still shows.
  EXPECT_THAT(Lines(text),
              Contains("tessera_job_last_step_timestamp_seconds{job_id=\"job-s\"} 1600000000.5"));
  // After the seed, commits apply as before.
  metrics_.ObserveJob(RunningJob("job-a", 1700000100, 0));
  EXPECT_THAT(ExpositionLines(), Contains("tessera_job_running{job_id=\"job-a\"} 1"));
}

// The series follow a JobManager's commits: RUNNING adds the job, its reports move the
// timestamps, its end removes it; no store read per scrape.
TEST_F(CoordinatorMetricsTest, JobSeriesFollowTheJobManagersCommits) {
  auto store = Store::Open(":memory:");
  ASSERT_THAT(store.status(), IsOk());
  SimulatedClock clock;
  JobManager jobs(store->get(), &clock);
  jobs.SetCommitObserver([this](const v1::Job& job) { metrics_.ObserveJob(job); });
  auto submitted = jobs.Submit(testing::TinyCpuJobSpec("job", 1, 0), "", "alice");
  ASSERT_THAT(submitted.status(), IsOk());
  const std::string id = submitted->job_id();
  EXPECT_THAT(Exposition(registry_, metrics_), Not(HasSubstr(id))) << "PENDING has no series";
  ASSERT_THAT(jobs.Transition(id, v1::JOB_STATE_RUNNING, "up").status(), IsOk());
  EXPECT_THAT(ExpositionLines(),
              Contains(absl::StrCat("tessera_job_running{job_id=\"", id, "\"} 1")));
  v1::StepMetrics point;
  point.set_step(1);
  point.mutable_time()->set_seconds(1700000123);
  v1::Checkpoint checkpoint;
  checkpoint.set_step(1);
  checkpoint.set_path("/ckpt/1");
  checkpoint.mutable_create_time()->set_seconds(1700000124);
  ASSERT_THAT(jobs.RecordReports(id, {point}, {}, {checkpoint}), IsOk());
  std::vector<std::string> lines = ExpositionLines();
  EXPECT_THAT(lines, Contains(absl::StrCat("tessera_job_last_step_timestamp_seconds{job_id=\"", id,
                                           "\"} 1700000123")));
  EXPECT_THAT(lines,
              Contains(absl::StrCat("tessera_job_last_checkpoint_timestamp_seconds{job_id=\"", id,
                                    "\"} 1700000124")));
  ASSERT_THAT(jobs.Transition(id, v1::JOB_STATE_SUCCEEDED, "done").status(), IsOk());
  EXPECT_THAT(Exposition(registry_, metrics_), Not(HasSubstr(id)));
}

TEST_F(CoordinatorMetricsTest, HistogramsCountObservationsIntoTheirBuckets) {
  metrics_.ObserveSchedulingLatency(0.0005);  // under the first bucket, 1 ms
  metrics_.ObserveSchedulingLatency(2.0);
  metrics_.ObserveSchedulingLatency(7200.0);  // beyond the last bucket, 1 h
  metrics_.ObserveSchedulingPass(0.003);
  metrics_.ObserveSchedulingPass(0.004);
  metrics_.ObserveStoreWrite(0.00005, 0.00004, 3);  // under the first bucket, 100 us
  metrics_.ObserveStoreWrite(0.02, 0.0005, 2);
  metrics_.ObserveSchedulingPassPhases({{"store", 0.2}, {"plan", 0.003}});
  metrics_.ObserveSchedulingPassPhases({{"store", 0.0004}});

  const std::vector<std::string> lines = ExpositionLines();
  EXPECT_THAT(lines, Contains("# TYPE tessera_scheduling_latency_seconds histogram"));
  EXPECT_THAT(lines, Contains("tessera_scheduling_latency_seconds_count 3"));
  EXPECT_THAT(lines, Contains("tessera_scheduling_latency_seconds_sum 7202.0005"));
  EXPECT_THAT(lines, Contains("tessera_scheduling_latency_seconds_bucket{le=\"0.001\"} 1"));
  EXPECT_THAT(lines, Contains("tessera_scheduling_latency_seconds_bucket{le=\"1\"} 1"));
  EXPECT_THAT(lines, Contains("tessera_scheduling_latency_seconds_bucket{le=\"2.5\"} 2"));
  EXPECT_THAT(lines, Contains("tessera_scheduling_latency_seconds_bucket{le=\"3600\"} 2"));
  EXPECT_THAT(lines, Contains("tessera_scheduling_latency_seconds_bucket{le=\"+Inf\"} 3"));

  EXPECT_THAT(lines, Contains("tessera_scheduler_pass_duration_seconds_count 2"));
  EXPECT_THAT(lines, Contains("tessera_scheduler_pass_duration_seconds_bucket{le=\"0.0025\"} 0"));
  EXPECT_THAT(lines, Contains("tessera_scheduler_pass_duration_seconds_bucket{le=\"0.005\"} 2"));

  EXPECT_THAT(lines, Contains("tessera_store_write_duration_seconds_count 2"));
  EXPECT_THAT(lines, Contains("tessera_store_write_duration_seconds_bucket{le=\"0.0001\"} 1"));
  EXPECT_THAT(lines, Contains("tessera_store_write_duration_seconds_bucket{le=\"10\"} 2"));
  EXPECT_THAT(lines, Contains("# TYPE tessera_store_write_cpu_seconds_total counter"));
  EXPECT_THAT(lines, Contains("tessera_store_write_cpu_seconds_total 0.00054"));
  EXPECT_THAT(lines, Contains("tessera_store_writes_total 5"));
  EXPECT_THAT(lines, Contains("tessera_scheduler_pass_phase_seconds_count{phase=\"store\"} 2"));
  EXPECT_THAT(
      lines,
      Contains("tessera_scheduler_pass_phase_seconds_bucket{phase=\"store\",le=\"0.0005\"} 1"));
  EXPECT_THAT(lines, Contains("tessera_scheduler_pass_phase_seconds_count{phase=\"plan\"} 1"));
}

// Answers GetNode; ReadLogs keeps the generated UNIMPLEMENTED default.
class FakeWorkerService final : public v1::Worker::CallbackService {
 public:
  grpc::ServerUnaryReactor* GetNode(grpc::CallbackServerContext* context,
                                    const v1::GetNodeRequest* /*request*/,
                                    v1::GetNodeResponse* response) override {
    response->mutable_node()->set_hostname("node-under-test");
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
};

std::unique_ptr<grpc::ClientContext> ContextWithDeadline() {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  return context;
}

// A real server on 127.0.0.1 with the metrics interceptor, called over TCP.
class MetricsInterceptorTest : public CoordinatorMetricsTest {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service_);
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
    creators.push_back(metrics_.MakeInterceptorFactory());
    builder.experimental().SetInterceptorCreators(std::move(creators));
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port, 0);
    channel_ =
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
    stub_ = v1::Worker::NewStub(channel_);
  }

  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown();
  }

  grpc::Status CallGetNode() {
    v1::GetNodeResponse response;
    grpc::Status status = stub_->GetNode(ContextWithDeadline().get(), {}, &response);
    if (status.ok()) {
      EXPECT_EQ(response.node().hostname(), "node-under-test");
    }
    return status;
  }

  // Reads the whole ReadLogs stream and returns its final status.
  grpc::Status CallReadLogs() {
    std::unique_ptr<grpc::ClientContext> context = ContextWithDeadline();
    std::unique_ptr<grpc::ClientReader<v1::LogChunk>> reader =
        stub_->ReadLogs(context.get(), v1::ReadLogsRequest());
    v1::LogChunk chunk;
    while (reader->Read(&chunk)) {
    }
    return reader->Finish();
  }

  // Calls `method` with an empty message through the generic stub, which
  // sends any name, and waits for the status.
  grpc::Status CallByName(const std::string& method) {
    grpc::GenericStub generic(channel_);
    std::unique_ptr<grpc::ClientContext> context = ContextWithDeadline();
    grpc::Slice empty_message("");
    grpc::ByteBuffer request(&empty_message, 1);
    grpc::ByteBuffer response;
    absl::Notification done;
    grpc::Status status;
    generic.UnaryCall(context.get(), method, grpc::StubOptions(), &request, &response,
                      [&](grpc::Status s) {
                        status = std::move(s);
                        done.Notify();
                      });
    done.WaitForNotification();
    return status;
  }

  FakeWorkerService service_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Worker::Stub> stub_;
};

TEST_F(MetricsInterceptorTest, CountsUnaryAndStreamingCallsByMethodAndCode) {
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(CallGetNode().ok());
  ASSERT_EQ(CallReadLogs().error_code(), grpc::StatusCode::UNIMPLEMENTED);

  // The interceptor records before the status goes out, so the client has
  // seen every status only after the counters moved.
  const std::vector<std::string> lines = ExpositionLines();
  EXPECT_THAT(lines, Contains("# TYPE tessera_grpc_server_requests_total counter"));
  EXPECT_THAT(lines,
              Contains(absl::StrCat("tessera_grpc_server_requests_total{code=\"OK\",method=\"",
                                    kGetNode, "\"} 3")));
  EXPECT_THAT(lines, Contains(absl::StrCat(
                         "tessera_grpc_server_requests_total{code=\"UNIMPLEMENTED\",method=\"",
                         kReadLogs, "\"} 1")));
  // Every call that reached the server counts as started, whatever its status.
  EXPECT_THAT(lines, Contains("# TYPE tessera_grpc_server_started_total counter"));
  EXPECT_THAT(lines, Contains(absl::StrCat("tessera_grpc_server_started_total{method=\"", kGetNode,
                                           "\"} 3")));
  EXPECT_THAT(lines, Contains(absl::StrCat("tessera_grpc_server_started_total{method=\"", kReadLogs,
                                           "\"} 1")));
  EXPECT_THAT(Exposition(registry_, metrics_),
              Not(HasSubstr(absl::StrCat("code=\"UNIMPLEMENTED\",method=\"", kGetNode))));
  EXPECT_THAT(Exposition(registry_, metrics_),
              Not(HasSubstr(absl::StrCat("code=\"OK\",method=\"", kReadLogs))));

  EXPECT_THAT(lines, Contains("# TYPE tessera_grpc_server_request_duration_seconds histogram"));
  EXPECT_THAT(lines,
              Contains(absl::StrCat("tessera_grpc_server_request_duration_seconds_count{method=\"",
                                    kGetNode, "\"} 3")));
  EXPECT_THAT(lines,
              Contains(absl::StrCat("tessera_grpc_server_request_duration_seconds_count{method=\"",
                                    kReadLogs, "\"} 1")));
  // Loopback calls finish well within the 10 s bucket.
  EXPECT_THAT(lines,
              Contains(absl::StrCat("tessera_grpc_server_request_duration_seconds_bucket{method=\"",
                                    kGetNode, "\",le=\"10\"} 3")));
}

TEST_F(MetricsInterceptorTest, UnknownMethodNamesShareOneSeries) {
  // A client may name any method; a series per name would let it grow the
  // exposition without bound.
  for (const char* method : {"/tessera.v1.Worker/NoSuchMethod", "/no.such.Service/Call", "/junk"}) {
    EXPECT_EQ(CallByName(method).error_code(), grpc::StatusCode::UNIMPLEMENTED) << method;
  }
  ASSERT_TRUE(CallGetNode().ok());
  // gRPC's own health service has no descriptor in the pool but keeps its name (this test server
  // does not serve it, hence UNIMPLEMENTED).
  EXPECT_EQ(CallByName("/grpc.health.v1.Health/Check").error_code(),
            grpc::StatusCode::UNIMPLEMENTED);

  const std::string text = Exposition(registry_, metrics_);
  EXPECT_THAT(Lines(text), Contains("tessera_grpc_server_requests_total{code=\"UNIMPLEMENTED\","
                                    "method=\"/grpc.health.v1.Health/Check\"} 1"));
  EXPECT_THAT(text, Not(HasSubstr("NoSuchMethod")));
  EXPECT_THAT(text, Not(HasSubstr("no.such")));
  EXPECT_THAT(text, Not(HasSubstr("junk")));
  EXPECT_THAT(Lines(text), Contains("tessera_grpc_server_requests_total{code=\"UNIMPLEMENTED\","
                                    "method=\"other\"} 3"));
  EXPECT_THAT(Lines(text), Contains("tessera_grpc_server_started_total{method=\"other\"} 3"));
  EXPECT_THAT(Lines(text),
              Contains(absl::StrCat("tessera_grpc_server_requests_total{code=\"OK\",method=\"",
                                    kGetNode, "\"} 1")));
}

// promtool's directory on PATH, or "" when it is not installed.
std::string FindPromtool() {
  const char* path = std::getenv("PATH");
  if (path == nullptr) return "";
  for (absl::string_view dir : absl::StrSplit(path, ':', absl::SkipEmpty())) {
    std::string candidate = absl::StrCat(dir, "/promtool");
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

TEST_F(MetricsInterceptorTest, PromtoolFindsNothingToLint) {
  const std::string promtool = FindPromtool();
  if (promtool.empty()) {
    GTEST_SKIP() << "promtool is not on PATH; scripts/bootstrap.sh installs it (Debian package "
                    "`prometheus`)";
  }
  // Every family with samples in it: gauges, histograms, and request series.
  metrics_.SetJobCounts({{v1::JOB_STATE_RUNNING, 1}});
  metrics_.SetNodeCounts({{v1::NODE_STATE_READY, 1}});
  metrics_.SetGpus(8, 8);
  metrics_.SetCpuSlots(4, 0);
  metrics_.ObserveSchedulingLatency(0.5);
  metrics_.ObserveSchedulingPass(0.001);
  metrics_.ObserveStoreWrite(0.001, 0.0002, 1);
  ClusterStats::QueueFigures queue;
  queue.nominal.gpus = 8;
  queue.preemptions = {{"reclaim", 1}};
  metrics_.SetQueues({{"nlp", queue}});
  metrics_.ObserveQueueWait("nlp", 12);
  metrics_.ObserveJob(RunningJob("job-1", 1700000000, 1700000000));
  ASSERT_TRUE(CallGetNode().ok());
  ASSERT_EQ(CallReadLogs().error_code(), grpc::StatusCode::UNIMPLEMENTED);

  const std::string text = Exposition(registry_, metrics_);
  ASSERT_THAT(text, AllOf(HasSubstr("tessera_grpc_server_requests_total{"),
                          HasSubstr("tessera_jobs{"), HasSubstr("tessera_gpus_capacity 8"),
                          HasSubstr("tessera_job_last_checkpoint_timestamp_seconds{")));
  testing::ScopedTempDir dir("coordinator_metrics");
  const std::string file = dir.path() + "/metrics.txt";
  {
    std::ofstream out(file);
    out << text;
    ASSERT_TRUE(out.good());
  }
  auto result = testing::RunCommand(
      {"/bin/sh", "-c", absl::StrCat("'", promtool, "' check metrics < '", file, "'")});
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ(result->exit.exit_code, 0) << result->output;
  EXPECT_EQ(result->output, "") << "exposition:\n" << text;
}

}  // namespace
}  // namespace tessera::coordinator

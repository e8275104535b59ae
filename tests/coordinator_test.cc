// Starts the real tessera-coordinator on 127.0.0.1:0 with a state file and
// drives tessera.v1.Coordinator over gRPC: submit, get, list, cancel, watch,
// metrics, bad input, and SIGKILL durability.

#include <signal.h>
#include <sqlite3.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/daemon/server.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "tessera/v1/coordinator_service.grpc.pb.h"
#include "tessera/v1/node_service.grpc.pb.h"
#include "tessera/v1/worker_service.grpc.pb.h"
#include "tests/util/grpc_context.h"
#include "tests/util/job_specs.h"
#include "tests/util/subprocess.h"
#include "tests/util/temp_dir.h"

namespace tessera {
namespace {

using ::tessera::testing::BinDir;
using ::tessera::testing::IsOk;
using ::tessera::testing::ScopedTempDir;
using ::tessera::testing::Subprocess;
using ::testing::HasSubstr;

std::unique_ptr<grpc::ClientContext> Context(int seconds = 10) {
  return testing::ContextWithDeadline(seconds);
}

v1::JobSpec ValidSpec(const std::string& name) { return testing::TinyCpuJobSpec(name); }

// Holds the write lock of the coordinator's state database from a connection of its own, as a
// disk that does not answer would: the coordinator's commits wait (up to its busy timeout) until
// Release or destruction.
class StateLock {
 public:
  explicit StateLock(const std::string& path) {
    if (sqlite3_open_v2(path.c_str(), &db_, SQLITE_OPEN_READWRITE, nullptr) != SQLITE_OK) return;
    sqlite3_busy_timeout(db_, 10000);
    held_ = sqlite3_exec(db_, "BEGIN IMMEDIATE", nullptr, nullptr, nullptr) == SQLITE_OK;
    EXPECT_TRUE(held_) << sqlite3_errmsg(db_);
  }
  ~StateLock() {
    Release();
    sqlite3_close(db_);
  }
  StateLock(const StateLock&) = delete;
  StateLock& operator=(const StateLock&) = delete;

  bool held() const { return held_; }
  void Release() {
    if (held_) {
      EXPECT_EQ(sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr), SQLITE_OK);
    }
    held_ = false;
  }

 private:
  sqlite3* db_ = nullptr;
  bool held_ = false;
};

class CoordinatorTest : public ::testing::Test {
 protected:
  void SetUp() override { Start(); }

  void Start(const std::vector<std::string>& extra_flags = {}) {
    std::vector<std::string> argv = {BinDir() + "/tessera-coordinator", "--listen=127.0.0.1:0",
                                     "--metrics_listen=", "--state=" + dir_.path() + "/state.db"};
    argv.insert(argv.end(), extra_flags.begin(), extra_flags.end());
    auto process = Subprocess::Start(argv);
    ASSERT_THAT(process, IsOk());
    process_.emplace(std::move(*process));
    auto line = process_->WaitForStderrLine("serving gRPC on");
    ASSERT_THAT(line, IsOk());
    std::smatch match;
    ASSERT_TRUE(std::regex_search(*line, match, std::regex(R"(serving gRPC on (\S+:\d+))")));
    channel_ = MakeClientChannel(match[1]);
    stub_ = v1::Coordinator::NewStub(channel_);
    nodes_ = v1::NodeService::NewStub(MakeClientChannel(match[1]));
  }

  // Polls GetJob until `done` holds or 10 s pass; returns the last job seen.
  v1::Job WaitForJob(const std::string& job_id, const std::function<bool(const v1::Job&)>& done) {
    v1::Job job;
    absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (absl::Now() < deadline) {
      if (Get(job_id, &job).ok() && done(job)) return job;
      absl::SleepFor(absl::Milliseconds(50));
    }
    return job;
  }

  void RegisterNode(const std::string& node_id, int gpus, int cpu_slots,
                    int64_t host_memory_bytes = 0) {
    v1::RegisterNodeRequest request;
    request.set_node_id(node_id);
    request.set_hostname(node_id);
    request.set_address(node_id + ".cluster.local:50052");
    request.mutable_resources()->set_cpu_slots(cpu_slots);
    request.mutable_resources()->set_memory_bytes(host_memory_bytes);
    for (int i = 0; i < gpus; ++i) {
      auto* gpu = request.mutable_resources()->add_gpus();
      gpu->set_index(i);
      gpu->set_name("NVIDIA H100 80GB HBM3");
      gpu->set_memory_bytes(80LL << 30);
    }
    v1::RegisterNodeResponse response;
    grpc::Status status = nodes_->RegisterNode(Context().get(), request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_GT(response.heartbeat_interval_seconds(), 0);
  }

  v1::HeartbeatResponse Heartbeat(const std::string& node_id,
                                  const std::vector<v1::TaskStatus>& tasks = {}) {
    v1::HeartbeatRequest request;
    request.set_node_id(node_id);
    for (const auto& task : tasks) *request.add_tasks() = task;
    v1::HeartbeatResponse response;
    grpc::Status status = nodes_->Heartbeat(Context().get(), request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response;
  }

  static v1::TaskStatus Task(const v1::TaskAssignment& assignment, v1::TaskState state) {
    v1::TaskStatus status;
    status.set_task_id(assignment.task_id());
    status.set_job_id(assignment.trainers(0).job_id());
    status.set_attempt(assignment.trainers(0).attempt());
    status.set_state(state);
    return status;
  }

  v1::Job Submit(const v1::JobSpec& spec, const std::string& request_id = "") {
    v1::SubmitJobRequest request;
    *request.mutable_spec() = spec;
    request.set_request_id(request_id);
    v1::SubmitJobResponse response;
    grpc::Status status = stub_->SubmitJob(Context().get(), request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response.job();
  }

  grpc::Status Get(const std::string& job_id, v1::Job* job) {
    v1::GetJobRequest request;
    request.set_job_id(job_id);
    v1::GetJobResponse response;
    grpc::Status status = stub_->GetJob(Context().get(), request, &response);
    *job = response.job();
    return status;
  }

  std::vector<v1::JobEvent> Watch(const std::string& job_id, int64_t after) {
    v1::WatchJobRequest request;
    request.set_job_id(job_id);
    request.set_after_sequence(after);
    auto context = Context();
    auto reader = stub_->WatchJob(context.get(), request);
    std::vector<v1::JobEvent> events;
    v1::JobEvent event;
    while (reader->Read(&event)) events.push_back(event);
    grpc::Status status = reader->Finish();
    EXPECT_TRUE(status.ok()) << status.error_message();
    return events;
  }

  ScopedTempDir dir_{"coordinator_test"};
  std::optional<Subprocess> process_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  std::unique_ptr<v1::NodeService::Stub> nodes_;
};

v1::JobSpec GpuSpec(const std::string& name, int gpus, int dp, int tp) {
  v1::JobSpec spec = ValidSpec(name);
  spec.mutable_model()->set_preset("tiny-llama");
  spec.mutable_resources()->set_cpu_slots(0);
  spec.mutable_resources()->set_gpus(gpus);
  auto* layout = spec.mutable_parallelism()->mutable_layout();
  layout->set_data_parallel(dp);
  layout->set_tensor_parallel(tp);
  layout->set_pipeline_parallel(1);
  spec.mutable_batch()->set_global_batch_size(2 * dp * 2);
  return spec;
}

TEST_F(CoordinatorTest, SchedulesAGangOntoFakeNodesAndFollowsItToTheEnd) {
  RegisterNode("node-a", 4, 0);
  RegisterNode("node-b", 4, 0);
  v1::Job job = Submit(GpuSpec("gang", 8, 8, 1));
  job = WaitForJob(job.job_id(),
                   [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SCHEDULED; });
  ASSERT_EQ(job.state(), v1::JOB_STATE_SCHEDULED) << job.reason();
  ASSERT_EQ(job.placements_size(), 8);

  // Each node gets its four ranks, with one rendezvous point for all.
  std::map<std::string, v1::TaskAssignment> assignments;
  for (const std::string node : {"node-a", "node-b"}) {
    v1::HeartbeatResponse response = Heartbeat(node);
    ASSERT_EQ(response.start_size(), 1) << node;
    assignments[node] = response.start(0);
    ASSERT_EQ(response.start(0).trainers_size(), 4);
  }
  std::set<int> ranks;
  std::string master;
  for (const auto& [node, assignment] : assignments) {
    for (int i = 0; i < assignment.trainers_size(); ++i) {
      const auto& task = assignment.trainers(i);
      ranks.insert(task.assignment().rank());
      EXPECT_EQ(task.assignment().world_size(), 8);
      EXPECT_EQ(task.assignment().local_world_size(), 4);
      EXPECT_EQ(task.assignment().device_type(), v1::DEVICE_TYPE_CUDA);
      EXPECT_EQ(task.spec().name(), "gang");
      if (master.empty())
        master =
            absl::StrCat(task.assignment().master_addr(), ":", task.assignment().master_port());
      EXPECT_EQ(absl::StrCat(task.assignment().master_addr(), ":", task.assignment().master_port()),
                master);
    }
  }
  EXPECT_EQ(ranks.size(), 8u);
  // A heartbeat delivers an assignment once.
  EXPECT_EQ(Heartbeat("node-a").start_size(), 0);

  Heartbeat("node-a", {Task(assignments["node-a"], v1::TASK_STATE_RUNNING)});
  Heartbeat("node-b", {Task(assignments["node-b"], v1::TASK_STATE_RUNNING)});
  job =
      WaitForJob(job.job_id(), [](const v1::Job& j) { return j.state() == v1::JOB_STATE_RUNNING; });
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING);

  v1::ReportRequest report;
  report.set_node_id("node-a");
  report.set_task_id(assignments["node-a"].task_id());
  report.set_first_sequence(1);
  for (int step = 1; step <= 3; ++step) {
    auto* r = report.add_reports();
    r->set_job_id(job.job_id());
    r->mutable_metrics()->set_step(step);
    r->mutable_metrics()->set_loss(5.0 - step);
  }
  v1::ReportResponse acked;
  ASSERT_TRUE(nodes_->Report(Context().get(), report, &acked).ok());
  EXPECT_EQ(acked.acked_sequence(), 3);
  v1::GetMetricsRequest metrics;
  metrics.set_job_id(job.job_id());
  v1::GetMetricsResponse curve;
  ASSERT_TRUE(stub_->GetMetrics(Context().get(), metrics, &curve).ok());
  ASSERT_EQ(curve.points_size(), 3);
  EXPECT_DOUBLE_EQ(curve.points(2).loss(), 2.0);
  metrics.set_max_points(1);
  ASSERT_TRUE(stub_->GetMetrics(Context().get(), metrics, &curve).ok());
  ASSERT_EQ(curve.points_size(), 1);
  EXPECT_DOUBLE_EQ(curve.points(0).loss(), 3.0);  // mean of 4, 3, 2
  EXPECT_EQ(curve.points(0).step(), 3);

  Heartbeat("node-a", {Task(assignments["node-a"], v1::TASK_STATE_SUCCEEDED)});
  Heartbeat("node-b", {Task(assignments["node-b"], v1::TASK_STATE_SUCCEEDED)});
  job = WaitForJob(job.job_id(),
                   [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SUCCEEDED; });
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(job.current_step(), 3);

  std::vector<v1::JobState> states;
  int metric_events = 0;
  for (const auto& event : Watch(job.job_id(), 0)) {
    if (event.has_state_change()) states.push_back(event.state_change().new_state());
    metric_events += event.has_metrics();
  }
  EXPECT_EQ(states, (std::vector<v1::JobState>{v1::JOB_STATE_PENDING, v1::JOB_STATE_SCHEDULED,
                                               v1::JOB_STATE_RUNNING, v1::JOB_STATE_SUCCEEDED}));
  EXPECT_EQ(metric_events, 3);

  // The GPUs are free again.
  v1::ListNodesResponse listed;
  ASSERT_TRUE(stub_->ListNodes(Context().get(), {}, &listed).ok());
  ASSERT_EQ(listed.nodes_size(), 2);
  EXPECT_EQ(listed.nodes(0).free_gpus_size(), 4);
}

TEST_F(CoordinatorTest, PendingReasonNamesTheShortfall) {
  RegisterNode("small", 4, 0);
  v1::Job job = Submit(GpuSpec("too-big", 8, 8, 1));
  job = WaitForJob(job.job_id(), [](const v1::Job& j) {
    return j.reason().find("needs 8 GPUs") != std::string::npos;
  });
  EXPECT_EQ(job.state(), v1::JOB_STATE_PENDING);
  EXPECT_THAT(job.reason(), HasSubstr("needs 8 GPUs"));
}

// An automatic-layout job on GPUs: the given gpt2-124m spec, no explicit layout.
v1::JobSpec AutoGpuSpec(const std::string& name, const std::string& preset, int gpus,
                        int micro_batch) {
  v1::JobSpec spec = ValidSpec(name);
  spec.mutable_model()->set_preset(preset);
  spec.mutable_data()->set_seq_len(1024);
  spec.mutable_resources()->set_cpu_slots(0);
  spec.mutable_resources()->set_gpus(gpus);
  spec.mutable_batch()->set_global_batch_size(64);
  spec.mutable_batch()->set_micro_batch_size(micro_batch);
  spec.mutable_parallelism()->mutable_auto_layout();
  return spec;
}

TEST_F(CoordinatorTest, AutoLayoutIsPlannedForTheRegisteredGpus) {
  RegisterNode("gpu-node", 8, 0);
  v1::Job job = Submit(AutoGpuSpec("auto-fits", "gpt2-124m", 8, 8));
  job = WaitForJob(job.job_id(),
                   [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SCHEDULED; });
  ASSERT_EQ(job.state(), v1::JOB_STATE_SCHEDULED) << job.reason();
  // GetJob shows the plan the planner chose, and why.
  const v1::LayoutPlan& plan = job.plan();
  EXPECT_TRUE(plan.fits());
  EXPECT_EQ(plan.device().name(), "h100-sxm");
  EXPECT_EQ(plan.layout().data_parallel(), 8);
  EXPECT_EQ(plan.gradient_accumulation_steps(), 1);
  EXPECT_GT(plan.memory().total_bytes(), plan.memory().weights_bytes());
  EXPECT_LT(plan.memory().total_bytes(), plan.memory().usable_bytes());
  EXPECT_GT(plan.step_time().tokens_per_second(), 0);
  // gpt2-124m fits plain data parallelism: no ZeRO, no recomputation (ZeRO-3's estimated edge
  // is within the planner's margin; the explanation names it).
  EXPECT_EQ(plan.layout().zero_stage(), 0);
  EXPECT_EQ(plan.layout().activation_checkpointing_mode(), v1::ACTIVATION_CHECKPOINTING_NONE);
  EXPECT_THAT(plan.explanation(), HasSubstr("of the fastest"));
  EXPECT_THAT(plan.explanation(), HasSubstr("NVIDIA H100 80GB HBM3"));
  // The trainers get the same plan.
  v1::HeartbeatResponse started = Heartbeat("gpu-node");
  ASSERT_EQ(started.start_size(), 1);
  EXPECT_EQ(started.start(0).trainers(0).plan().explanation(), plan.explanation());
}

TEST_F(CoordinatorTest, AutoLayoutSplitsAModelThatDoesNotFitReplicated) {
  RegisterNode("gpu-node", 8, 0);
  // 8B parameters of AdamW state (16 bytes each, 128 GB) replicated on 80 GB GPUs do not fit.
  // Data parallelism alone fits only with ZeRO 2/3; splitting the model over tensor or pipeline
  // parallel ranks (with ZeRO 0 or 1, all the trainer runs next to them) is estimated faster.
  v1::Job job = Submit(AutoGpuSpec("auto-split", "llama3-8b", 8, 1));
  job = WaitForJob(job.job_id(),
                   [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SCHEDULED; });
  ASSERT_EQ(job.state(), v1::JOB_STATE_SCHEDULED) << job.reason();
  const v1::LayoutPlan& plan = job.plan();
  EXPECT_TRUE(plan.fits());
  const v1::Layout& layout = plan.layout();
  EXPECT_GT(layout.tensor_parallel() * layout.pipeline_parallel(), 1) << plan.explanation();
  EXPECT_LE(layout.zero_stage(), 1) << plan.explanation();
  EXPECT_EQ(layout.data_parallel() * layout.tensor_parallel() * layout.pipeline_parallel(), 8);
  EXPECT_LE(plan.memory().total_bytes(), plan.memory().usable_bytes());
  EXPECT_THAT(plan.explanation(), HasSubstr("Chosen among the layouts this trainer runs"));
  v1::HeartbeatResponse started = Heartbeat("gpu-node");
  ASSERT_EQ(started.start_size(), 1);
  const v1::Layout& sent = started.start(0).trainers(0).plan().layout();
  EXPECT_EQ(sent.tensor_parallel(), layout.tensor_parallel());
  EXPECT_EQ(sent.pipeline_parallel(), layout.pipeline_parallel());
  EXPECT_EQ(sent.zero_stage(), layout.zero_stage());
}

TEST_F(CoordinatorTest, AutoLayoutLimitedToDataParallelShardsWithZero) {
  RegisterNode("gpu-node", 8, 0);
  // The spec's limits hold: data parallel only (tp and pp at most 1), where ZeRO 2 or 3 is what
  // makes 8B fit.
  v1::JobSpec spec = AutoGpuSpec("auto-dp-only", "llama3-8b", 8, 1);
  spec.mutable_parallelism()->mutable_auto_layout()->set_max_tensor_parallel(1);
  spec.mutable_parallelism()->mutable_auto_layout()->set_max_pipeline_parallel(1);
  v1::Job job = Submit(spec);
  job = WaitForJob(job.job_id(),
                   [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SCHEDULED; });
  ASSERT_EQ(job.state(), v1::JOB_STATE_SCHEDULED) << job.reason();
  EXPECT_EQ(job.plan().layout().data_parallel(), 8);
  EXPECT_GE(job.plan().layout().zero_stage(), 2);
}

TEST_F(CoordinatorTest, AutoLayoutThatFitsNowhereWaitsWithThePlannersReason) {
  RegisterNode("gpu-node", 8, 0);
  // 70B parameters of AdamW state (16 bytes each) over 8 x 80 GB GPUs: 140 GB per GPU whether
  // sharded with ZeRO-3 or split 8 ways by tensor and pipeline parallelism, so nothing fits.
  v1::Job job = Submit(AutoGpuSpec("auto-too-big", "llama3-70b", 8, 1));
  job = WaitForJob(job.job_id(), [](const v1::Job& j) {
    return j.reason().find("No layout fits") != std::string::npos;
  });
  EXPECT_EQ(job.state(), v1::JOB_STATE_PENDING);
  EXPECT_THAT(job.reason(), HasSubstr("does not fit: needs"));
  EXPECT_THAT(job.reason(), HasSubstr("over by"));
  EXPECT_EQ(Heartbeat("gpu-node").start_size(), 0);
}

TEST_F(CoordinatorTest, CpuJobsArePlannedAgainstTheHostsMemoryPerSlot) {
  // 1 GiB shared by 2 slots: gpt2-124m's fp32 AdamW state alone is 2 GB per rank.
  RegisterNode("small-host", 0, 2, int64_t{1} << 30);
  v1::JobSpec big = ValidSpec("cpu-too-big");
  big.mutable_model()->set_preset("gpt2-124m");
  v1::Job job = Submit(big);
  job = WaitForJob(job.job_id(), [](const v1::Job& j) {
    return j.reason().find("No layout fits") != std::string::npos;
  });
  EXPECT_EQ(job.state(), v1::JOB_STATE_PENDING);
  EXPECT_THAT(job.reason(), HasSubstr("cpu (512.0 MiB)"));
  // The tiny model fits in the same slots.
  v1::Job small = Submit(ValidSpec("cpu-fits"));
  small = WaitForJob(small.job_id(),
                     [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SCHEDULED; });
  EXPECT_EQ(small.state(), v1::JOB_STATE_SCHEDULED) << small.reason();
  EXPECT_TRUE(small.plan().fits());
  EXPECT_EQ(small.plan().memory().device_capacity_bytes(), int64_t{512} << 20);
}

TEST_F(CoordinatorTest, PlanLayoutForAHypotheticalOrTheLiveCluster) {
  v1::PlanLayoutRequest request;
  *request.mutable_spec() = AutoGpuSpec("plan", "gpt2-124m", 8, 8);
  v1::PlanLayoutResponse response;
  // No GPU node registered: the live cluster cannot be planned for.
  grpc::Status status = stub_->PlanLayout(Context().get(), request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("name a device"));
  // A hypothetical cluster: 64 H200s, 8 per node.
  request.set_gpu_type("h200");
  request.set_gpus(64);
  request.set_max_candidates(5);
  status = stub_->PlanLayout(Context().get(), request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(response.plan().fits());
  EXPECT_EQ(response.plan().world_size(), 64);
  EXPECT_EQ(response.plan().device().name(), "h200");
  EXPECT_EQ(response.candidates_size(), 5);
  // The live cluster once a node registered.
  RegisterNode("gpu-node", 8, 0);
  request.clear_gpu_type();
  request.set_gpus(0);
  status = stub_->PlanLayout(Context().get(), request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.plan().world_size(), 8);
  EXPECT_EQ(response.plan().device().name(), "h100-sxm");
  // Bad input.
  request.set_gpu_type("tpu-v5");
  EXPECT_EQ(stub_->PlanLayout(Context().get(), request, &response).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  request.clear_gpu_type();
  request.mutable_spec()->mutable_data()->set_seq_len(4096);
  status = stub_->PlanLayout(Context().get(), request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("data.seq_len"));
}

TEST_F(CoordinatorTest, SubmitRefusesLayoutsTheTrainerDoesNotRun) {
  v1::SubmitJobRequest request;
  v1::SubmitJobResponse response;
  // ZeRO 2 and 3 shard gradients (and weights) over dp: the trainer does that only without
  // tensor or pipeline parallelism.
  v1::JobSpec tensor = GpuSpec("tp-zero2", 8, 4, 2);
  tensor.mutable_parallelism()->mutable_layout()->set_zero_stage(2);
  v1::JobSpec pipeline = GpuSpec("pp-zero3", 8, 4, 1);
  pipeline.mutable_parallelism()->mutable_layout()->set_pipeline_parallel(2);
  pipeline.mutable_parallelism()->mutable_layout()->set_zero_stage(3);
  const std::vector<std::pair<v1::JobSpec, std::string>> cases = {
      {tensor, "parallelism.layout.zero_stage: 2 with tensor_parallel 2: "},
      {pipeline, "parallelism.layout.zero_stage: 3 with pipeline_parallel 2: "}};
  for (const auto& [spec, field] : cases) {
    *request.mutable_spec() = spec;
    grpc::Status status = stub_->SubmitJob(Context().get(), request, &response);
    // Well formed (INVALID_ARGUMENT is for malformed specs), but the trainer does not implement
    // it.
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED) << spec.name();
    EXPECT_THAT(status.error_message(), HasSubstr(field)) << spec.name();
    EXPECT_THAT(status.error_message(), HasSubstr("this trainer does not run")) << spec.name();
    EXPECT_THAT(status.error_message(), HasSubstr("set zero_stage to 1")) << spec.name();
  }
  // A malformed layout is reported as such first.
  request.mutable_spec()->mutable_parallelism()->mutable_layout()->set_pipeline_parallel(3);
  grpc::Status status = stub_->SubmitJob(Context().get(), request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("parallelism.layout"));
  // Nothing was admitted.
  v1::ListJobsResponse listed;
  ASSERT_TRUE(stub_->ListJobs(Context().get(), {}, &listed).ok());
  EXPECT_EQ(listed.jobs_size(), 0);
  // PlanLayout still estimates such a layout (for a hypothetical cluster here).
  v1::PlanLayoutRequest plan;
  *plan.mutable_spec() = cases[0].first;
  plan.set_gpu_type("h100-sxm");
  v1::PlanLayoutResponse planned;
  status = stub_->PlanLayout(Context().get(), plan, &planned);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(planned.plan().layout().tensor_parallel(), 2);
  EXPECT_EQ(planned.plan().layout().zero_stage(), 2);
}

TEST_F(CoordinatorTest, SubmitAcceptsZeroAndRecomputationLayouts) {
  // ZeRO-3 with full recomputation over data parallel: what the trainer runs.
  v1::JobSpec spec = GpuSpec("zero3-full", 8, 8, 1);
  v1::Layout* layout = spec.mutable_parallelism()->mutable_layout();
  layout->set_zero_stage(3);
  layout->set_activation_checkpointing_mode(v1::ACTIVATION_CHECKPOINTING_FULL);
  v1::Job job = Submit(spec);
  ASSERT_FALSE(job.job_id().empty());
  EXPECT_EQ(job.plan().layout().zero_stage(), 3);
  EXPECT_EQ(job.plan().layout().activation_checkpointing_mode(), v1::ACTIVATION_CHECKPOINTING_FULL);
  // ZeRO over one data-parallel rank shards over that rank: accepted, like NeMo's distributed
  // optimizer, not refused for having nothing to shard over.
  v1::JobSpec single = GpuSpec("zero2-one-rank", 1, 1, 1);
  single.mutable_parallelism()->mutable_layout()->set_zero_stage(2);
  EXPECT_FALSE(Submit(single).job_id().empty());
  // And it is planned, not refused, once a GPU is there.
  RegisterNode("gpu-node", 8, 0);
  job = WaitForJob(job.job_id(),
                   [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SCHEDULED; });
  EXPECT_EQ(job.state(), v1::JOB_STATE_SCHEDULED) << job.reason();
  EXPECT_TRUE(job.plan().fits()) << job.plan().explanation();
}

TEST_F(CoordinatorTest, SubmitAcceptsTensorPipelineAndSequenceParallelLayouts) {
  // dp 2 x tp 2 x pp 2 with sequence parallelism, ZeRO-1 and selective recomputation: Megatron's
  // kind of layout, which the trainer runs.
  v1::JobSpec spec = GpuSpec("tp-pp-sp", 8, 2, 2);
  v1::Layout* layout = spec.mutable_parallelism()->mutable_layout();
  layout->set_pipeline_parallel(2);
  layout->set_sequence_parallel(true);
  layout->set_zero_stage(1);
  layout->set_activation_checkpointing_mode(v1::ACTIVATION_CHECKPOINTING_SELECTIVE);
  v1::Job job = Submit(spec);
  ASSERT_FALSE(job.job_id().empty());
  EXPECT_EQ(job.plan().layout().tensor_parallel(), 2);
  EXPECT_EQ(job.plan().layout().pipeline_parallel(), 2);
  // Pipeline parallel alone, ZeRO-0.
  v1::JobSpec pipeline = GpuSpec("pp-only", 8, 4, 1);
  pipeline.mutable_parallelism()->mutable_layout()->set_pipeline_parallel(2);
  EXPECT_FALSE(Submit(pipeline).job_id().empty());
  // Scheduled once GPUs are there, and every trainer gets the layout.
  RegisterNode("gpu-node", 8, 0);
  job = WaitForJob(job.job_id(),
                   [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SCHEDULED; });
  ASSERT_EQ(job.state(), v1::JOB_STATE_SCHEDULED) << job.reason();
  EXPECT_TRUE(job.plan().fits()) << job.plan().explanation();
  v1::HeartbeatResponse started = Heartbeat("gpu-node");
  ASSERT_EQ(started.start_size(), 1);
  ASSERT_EQ(started.start(0).trainers_size(), 8);
  for (const auto& trainer : started.start(0).trainers()) {
    EXPECT_EQ(trainer.plan().layout().tensor_parallel(), 2);
    EXPECT_EQ(trainer.plan().layout().pipeline_parallel(), 2);
    EXPECT_TRUE(trainer.plan().layout().sequence_parallel());
    EXPECT_EQ(trainer.plan().layout().zero_stage(), 1);
  }
}

TEST_F(CoordinatorTest, RotaryModelsMayTrainPastTheirPresetsMaxSeqLen) {
  // tiny-llama's preset context is 256 tokens; rotary positions extend, and the plan's model
  // (which the trainer builds from) covers the training length.
  v1::JobSpec spec = ValidSpec("long-context");
  spec.mutable_model()->set_preset("tiny-llama");
  spec.mutable_data()->set_seq_len(1024);
  v1::Job job = Submit(spec);
  ASSERT_FALSE(job.job_id().empty());
  EXPECT_EQ(job.plan().model().dims().max_seq_len(), 1024);
  // Learned positions (GPT-2) have no rows past theirs: INVALID_ARGUMENT naming the field.
  v1::SubmitJobRequest request;
  *request.mutable_spec() = ValidSpec("too-long");
  request.mutable_spec()->mutable_data()->set_seq_len(1024);
  v1::SubmitJobResponse response;
  grpc::Status status = stub_->SubmitJob(Context().get(), request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(),
              HasSubstr("data.seq_len: 1024 exceeds model max_seq_len 256"));
}

TEST_F(CoordinatorTest, CancelStopsTheTasks) {
  RegisterNode("cpu-node", 0, 2);
  v1::Job job = Submit(ValidSpec("to-cancel"));
  job = WaitForJob(job.job_id(),
                   [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SCHEDULED; });
  ASSERT_EQ(job.state(), v1::JOB_STATE_SCHEDULED);
  v1::HeartbeatResponse started = Heartbeat("cpu-node");
  ASSERT_EQ(started.start_size(), 1);
  EXPECT_EQ(started.start(0).trainers(0).assignment().device_type(), v1::DEVICE_TYPE_CPU);
  v1::CancelJobRequest cancel;
  cancel.set_job_id(job.job_id());
  v1::CancelJobResponse cancelled;
  ASSERT_TRUE(stub_->CancelJob(Context().get(), cancel, &cancelled).ok());
  // The next heartbeats carry the stop order.
  bool stopped = false;
  absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!stopped && absl::Now() < deadline) {
    v1::HeartbeatResponse response =
        Heartbeat("cpu-node", {Task(started.start(0), v1::TASK_STATE_RUNNING)});
    for (const auto& task : response.stop()) stopped |= task == started.start(0).task_id();
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(stopped);
}

TEST_F(CoordinatorTest, SigkillMidTrainingLosesNothingAndReconciles) {
  RegisterNode("node-a", 0, 2);
  v1::Job job = Submit(ValidSpec("mid-training"));
  job = WaitForJob(job.job_id(),
                   [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SCHEDULED; });
  ASSERT_EQ(job.state(), v1::JOB_STATE_SCHEDULED);
  v1::TaskAssignment assignment = Heartbeat("node-a").start(0);
  Heartbeat("node-a", {Task(assignment, v1::TASK_STATE_RUNNING)});
  job =
      WaitForJob(job.job_id(), [](const v1::Job& j) { return j.state() == v1::JOB_STATE_RUNNING; });
  ASSERT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  v1::ReportRequest report;
  report.set_node_id("node-a");
  report.set_task_id(assignment.task_id());
  report.set_first_sequence(1);
  for (int step = 1; step <= 5; ++step) {
    auto* r = report.add_reports();
    r->set_job_id(job.job_id());
    r->mutable_metrics()->set_step(step);
    r->mutable_metrics()->set_loss(6.0 - step);
  }
  auto* checkpoint = report.add_reports();
  checkpoint->set_job_id(job.job_id());
  checkpoint->mutable_checkpoint()->set_job_id(job.job_id());
  checkpoint->mutable_checkpoint()->set_step(5);
  checkpoint->mutable_checkpoint()->set_path("/ckpt/step-00000005");
  v1::ReportResponse acked;
  ASSERT_TRUE(nodes_->Report(Context().get(), report, &acked).ok());

  auto exit = process_->Stop(SIGKILL);
  ASSERT_THAT(exit, IsOk());
  process_.reset();
  Start();

  // Everything is still there.
  ASSERT_TRUE(Get(job.job_id(), &job).ok());
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(job.current_step(), 5);
  v1::GetMetricsRequest metrics;
  metrics.set_job_id(job.job_id());
  v1::GetMetricsResponse curve;
  ASSERT_TRUE(stub_->GetMetrics(Context().get(), metrics, &curve).ok());
  EXPECT_EQ(curve.points_size(), 5);
  v1::ListCheckpointsRequest list;
  list.set_job_id(job.job_id());
  v1::ListCheckpointsResponse checkpoints;
  ASSERT_TRUE(stub_->ListCheckpoints(Context().get(), list, &checkpoints).ok());
  ASSERT_EQ(checkpoints.checkpoints_size(), 1);
  EXPECT_EQ(checkpoints.checkpoints(0).path(), "/ckpt/step-00000005");

  // The worker's next heartbeat reconciles: the task keeps running, nothing
  // is started twice, and the job then finishes normally.
  v1::HeartbeatResponse again = Heartbeat("node-a", {Task(assignment, v1::TASK_STATE_RUNNING)});
  EXPECT_FALSE(again.reregister());
  EXPECT_EQ(again.start_size(), 0);
  EXPECT_EQ(again.stop_size(), 0);
  Heartbeat("node-a", {Task(assignment, v1::TASK_STATE_SUCCEEDED)});
  job = WaitForJob(job.job_id(),
                   [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SUCCEEDED; });
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED);
}

TEST_F(CoordinatorTest, OversizedRequestsAreRefused) {
  v1::SubmitJobRequest huge;
  *huge.mutable_spec() = ValidSpec("huge");
  (*huge.mutable_spec()->mutable_labels())["blob"] = std::string(65 << 20, 'x');
  v1::SubmitJobResponse response;
  grpc::Status status = stub_->SubmitJob(Context(30).get(), huge, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  // The daemon is unharmed.
  v1::Job job = Submit(ValidSpec("after-huge"));
  EXPECT_FALSE(job.job_id().empty());
}

// A worker whose ReadLogs answers with two chunks naming what it was asked.
class FakeLogWorker final : public v1::Worker::Service {
 public:
  grpc::Status ReadLogs(grpc::ServerContext*, const v1::ReadLogsRequest* request,
                        grpc::ServerWriter<v1::LogChunk>* writer) override {
    for (int i = 0; i < 2; ++i) {
      v1::LogChunk chunk;
      chunk.set_job_id(request->job_id());
      chunk.set_attempt(request->attempt());
      chunk.set_rank(i);
      chunk.set_data(absl::StrCat("line ", i, " of ", request->job_id(), "\n"));
      writer->Write(chunk);
    }
    return grpc::Status::OK;
  }
};

TEST_F(CoordinatorTest, GetLogsRelaysFromTheWorkers) {
  FakeLogWorker worker;
  auto server = GrpcServer::Start({.listen_address = "127.0.0.1:0"},
                                  {{v1::Worker::service_full_name(), &worker}});
  ASSERT_THAT(server, IsOk());
  v1::RegisterNodeRequest node;
  node.set_node_id("logs-node");
  node.set_address((*server)->address());
  node.mutable_resources()->set_cpu_slots(2);
  v1::RegisterNodeResponse registered;
  ASSERT_TRUE(nodes_->RegisterNode(Context().get(), node, &registered).ok());

  v1::Job pending = Submit(GpuSpec("never-placed", 64, 64, 1));
  v1::GetLogsRequest request;
  request.set_job_id(pending.job_id());
  request.set_rank(-1);
  request.set_attempt(-1);
  {
    auto context = Context();
    auto reader = stub_->GetLogs(context.get(), request);
    v1::LogChunk chunk;
    EXPECT_FALSE(reader->Read(&chunk));
    grpc::Status status = reader->Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(status.error_message(), HasSubstr("no trainer has been placed"));
  }

  v1::Job job = Submit(ValidSpec("with-logs"));
  job = WaitForJob(job.job_id(),
                   [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SCHEDULED; });
  ASSERT_EQ(job.state(), v1::JOB_STATE_SCHEDULED);
  request.set_job_id(job.job_id());
  auto context = Context();
  auto reader = stub_->GetLogs(context.get(), request);
  std::vector<v1::LogChunk> chunks;
  v1::LogChunk chunk;
  while (reader->Read(&chunk)) chunks.push_back(chunk);
  grpc::Status status = reader->Finish();
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_EQ(chunks[0].data(), absl::StrCat("line 0 of ", job.job_id(), "\n"));
  EXPECT_EQ(chunks[1].node_id(), "logs-node");

  // A worker that is gone is named in the error.
  (*server)->Shutdown(absl::ZeroDuration());
  auto context2 = Context();
  auto reader2 = stub_->GetLogs(context2.get(), request);
  EXPECT_FALSE(reader2->Read(&chunk));
  status = reader2->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(status.error_message(), HasSubstr("worker logs-node"));
}

TEST_F(CoordinatorTest, AWorkerThatRestartedFailsItsJobs) {
  RegisterNode("restarting", 0, 2);
  v1::Job job = Submit(ValidSpec("victim"));
  job = WaitForJob(job.job_id(),
                   [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SCHEDULED; });
  ASSERT_EQ(job.state(), v1::JOB_STATE_SCHEDULED);
  ASSERT_EQ(Heartbeat("restarting").start_size(), 1);  // delivered
  // The worker comes back empty-handed: the attempt is over (decided on the next tick).
  RegisterNode("restarting", 0, 2);
  job =
      WaitForJob(job.job_id(), [](const v1::Job& j) { return j.state() == v1::JOB_STATE_FAILED; });
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(job.reason(), HasSubstr("restarted"));
}

class CoordinatorLivenessTest : public CoordinatorTest {
 protected:
  void SetUp() override { Start({"--heartbeat_timeout=1s"}); }
};

TEST_F(CoordinatorLivenessTest, ASilentNodeIsLostAndItsJobFails) {
  RegisterNode("flaky", 0, 2);
  v1::Job job = Submit(ValidSpec("on-flaky"));
  job =
      WaitForJob(job.job_id(), [](const v1::Job& j) { return j.state() != v1::JOB_STATE_PENDING; });
  ASSERT_EQ(job.state(), v1::JOB_STATE_SCHEDULED) << job.reason();
  // No heartbeats from now on.
  job =
      WaitForJob(job.job_id(), [](const v1::Job& j) { return j.state() == v1::JOB_STATE_FAILED; });
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(job.reason(), HasSubstr("node flaky was lost"));
  EXPECT_EQ(job.failure().kind(), v1::FAILURE_KIND_NODE_LOST);
  v1::ListNodesRequest list;
  list.set_include_lost(true);
  v1::ListNodesResponse listed;
  ASSERT_TRUE(stub_->ListNodes(Context().get(), list, &listed).ok());
  ASSERT_EQ(listed.nodes_size(), 1);
  EXPECT_EQ(listed.nodes(0).state(), v1::NODE_STATE_LOST);
  // A lost node that comes back is told to register again.
  EXPECT_TRUE(Heartbeat("flaky").reregister());
}

TEST_F(CoordinatorTest, SubmitGetListCancelWatch) {
  v1::Job job = Submit(ValidSpec("first"));
  ASSERT_FALSE(job.job_id().empty());
  EXPECT_EQ(job.state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(job.plan().world_size(), 2);
  EXPECT_EQ(job.plan().gradient_accumulation_steps(), 2);  // 8 / (2 x dp 2)

  v1::Job fetched;
  ASSERT_TRUE(Get(job.job_id(), &fetched).ok());
  EXPECT_EQ(fetched.spec().name(), "first");

  v1::CancelJobRequest cancel;
  cancel.set_job_id(job.job_id());
  cancel.set_reason("test");
  v1::CancelJobResponse cancelled;
  ASSERT_TRUE(stub_->CancelJob(Context().get(), cancel, &cancelled).ok());
  EXPECT_EQ(cancelled.job().state(), v1::JOB_STATE_CANCELLED);
  EXPECT_THAT(cancelled.job().reason(), HasSubstr("test"));
  // Cancelling again changes nothing.
  ASSERT_TRUE(stub_->CancelJob(Context().get(), cancel, &cancelled).ok());
  EXPECT_EQ(cancelled.job().state(), v1::JOB_STATE_CANCELLED);

  // The whole history, then the stream ends because the job is terminal.
  auto events = Watch(job.job_id(), 0);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].sequence(), 1);
  EXPECT_EQ(events[0].state_change().new_state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(events[1].sequence(), 2);
  EXPECT_EQ(events[1].state_change().new_state(), v1::JOB_STATE_CANCELLED);
  // Reconnecting after sequence 1 misses nothing and repeats nothing.
  auto rest = Watch(job.job_id(), 1);
  ASSERT_EQ(rest.size(), 1u);
  EXPECT_EQ(rest[0].sequence(), 2);

  v1::ListJobsRequest list;
  list.add_states(v1::JOB_STATE_CANCELLED);
  v1::ListJobsResponse listed;
  ASSERT_TRUE(stub_->ListJobs(Context().get(), list, &listed).ok());
  ASSERT_EQ(listed.jobs_size(), 1);
  EXPECT_EQ(listed.jobs(0).job_id(), job.job_id());
}

// gRPC runs callback handlers on a few threads of its own (half the cores, at least 2, at most
// 16). Calls that wait on the disk do that on the coordinator's executors instead, so that a
// slow commit does not stall the node's heartbeats. Here the store's database is held locked by
// another connection while more submissions than gRPC has threads wait for their commits; a
// heartbeat and a health check must still be answered promptly, and every submission lands
// once the lock is released.
TEST_F(CoordinatorTest, HeartbeatsAreAnsweredWhileSubmissionsWaitForTheDisk) {
  RegisterNode("n1", 0, 4);
  StateLock lock(dir_.path() + "/state.db");
  ASSERT_TRUE(lock.held());

  constexpr int kSubmissions = 40;  // more than gRPC's threads on any machine
  std::vector<grpc::Status> statuses(kSubmissions);
  std::vector<std::string> job_ids(kSubmissions);
  std::vector<std::thread> submitters;
  for (int i = 0; i < kSubmissions; ++i) {
    submitters.emplace_back([&, i] {
      v1::SubmitJobRequest request;
      *request.mutable_spec() = ValidSpec(absl::StrCat("waits-", i));
      v1::SubmitJobResponse response;
      statuses[i] = stub_->SubmitJob(Context(60).get(), request, &response);
      job_ids[i] = response.job().job_id();
    });
  }
  absl::SleepFor(absl::Milliseconds(500));  // the submissions reach the coordinator and wait

  const absl::Time start = absl::Now();
  v1::HeartbeatRequest heartbeat;
  heartbeat.set_node_id("n1");
  v1::HeartbeatResponse heartbeat_response;
  const grpc::Status heartbeat_status =
      nodes_->Heartbeat(Context(3).get(), heartbeat, &heartbeat_response);
  EXPECT_TRUE(heartbeat_status.ok()) << heartbeat_status.error_message();
  EXPECT_FALSE(heartbeat_response.reregister());
  auto health = grpc::health::v1::Health::NewStub(channel_);
  grpc::health::v1::HealthCheckRequest check;
  grpc::health::v1::HealthCheckResponse checked;
  const grpc::Status health_status = health->Check(Context(3).get(), check, &checked);
  EXPECT_TRUE(health_status.ok()) << health_status.error_message();
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  // Still waiting: the lock is held, so none of them can have been stored.
  for (int i = 0; i < kSubmissions; ++i) EXPECT_TRUE(job_ids[i].empty()) << i;

  lock.Release();
  for (std::thread& submitter : submitters) submitter.join();
  std::set<std::string> distinct;
  for (int i = 0; i < kSubmissions; ++i) {
    EXPECT_TRUE(statuses[i].ok()) << i << ": " << statuses[i].error_message();
    distinct.insert(job_ids[i]);
  }
  EXPECT_EQ(distinct.size(), static_cast<size_t>(kSubmissions));
  v1::ListJobsRequest list;
  list.set_page_size(100);
  v1::ListJobsResponse listed;
  ASSERT_TRUE(stub_->ListJobs(Context().get(), list, &listed).ok());
  EXPECT_EQ(listed.jobs_size(), kSubmissions);
}

// Client calls wait for a thread in a bounded queue: beyond --max_queued_client_calls the
// coordinator answers RESOURCE_EXHAUSTED with a retry hint at once instead of holding the call
// in memory, and the calls it accepted still complete.
class CoordinatorBusyTest : public CoordinatorTest {
 protected:
  void SetUp() override { Start({"--client_call_threads=1", "--max_queued_client_calls=2"}); }
};

TEST_F(CoordinatorBusyTest, ClientCallsBeyondTheQueueAreToldToRetry) {
  StateLock lock(dir_.path() + "/state.db");
  ASSERT_TRUE(lock.held());

  // The first submission takes the one thread and waits for the database; two more wait in the
  // queue; the other five are refused at once.
  auto submit = [&](int i, std::string* retry_after) {
    v1::SubmitJobRequest request;
    *request.mutable_spec() = ValidSpec(absl::StrCat("busy-", i));
    v1::SubmitJobResponse response;
    auto context = Context(60);
    const grpc::Status status = stub_->SubmitJob(context.get(), request, &response);
    const auto& trailing = context->GetServerTrailingMetadata();
    if (auto it = trailing.find("retry-after-ms"); it != trailing.end()) {
      *retry_after = std::string(it->second.data(), it->second.size());
    }
    return status;
  };
  std::vector<grpc::Status> statuses(8);
  std::vector<std::string> retry_after(8);
  std::vector<absl::Time> answered(8);
  std::vector<std::thread> submitters;
  for (int i = 0; i < 8; ++i) {
    submitters.emplace_back([&, i] {
      statuses[i] = submit(i, &retry_after[i]);
      answered[i] = absl::Now();
    });
    if (i == 0) absl::SleepFor(absl::Milliseconds(300));  // the first one holds the thread
  }
  absl::SleepFor(absl::Milliseconds(700));
  const absl::Time unlocked = absl::Now();
  lock.Release();
  for (std::thread& submitter : submitters) submitter.join();
  EXPECT_TRUE(statuses[0].ok()) << statuses[0].error_message();
  int accepted = 0;
  int refused = 0;
  for (int i = 0; i < 8; ++i) {
    if (statuses[i].ok()) {
      ++accepted;
      continue;
    }
    ++refused;
    EXPECT_EQ(statuses[i].error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
        << i << ": " << statuses[i].error_message();
    EXPECT_THAT(statuses[i].error_message(), HasSubstr("retry in 1 s"));
    EXPECT_EQ(retry_after[i], "1000") << i;
    EXPECT_LT(answered[i], unlocked) << i << ": refused only after the database was unlocked";
  }
  EXPECT_EQ(accepted, 3);
  EXPECT_EQ(refused, 5);
  v1::ListJobsRequest list;
  v1::ListJobsResponse listed;
  ASSERT_TRUE(stub_->ListJobs(Context().get(), list, &listed).ok());
  EXPECT_EQ(listed.jobs_size(), 3);
}

TEST_F(CoordinatorTest, WatchFollowsLiveChanges) {
  v1::Job job = Submit(ValidSpec("live"));
  v1::WatchJobRequest request;
  request.set_job_id(job.job_id());
  auto context = Context(30);
  auto reader = stub_->WatchJob(context.get(), request);
  v1::JobEvent event;
  ASSERT_TRUE(reader->Read(&event));
  EXPECT_EQ(event.state_change().new_state(), v1::JOB_STATE_PENDING);
  // The stream stays open until something happens.
  v1::CancelJobRequest cancel;
  cancel.set_job_id(job.job_id());
  v1::CancelJobResponse cancelled;
  ASSERT_TRUE(stub_->CancelJob(Context().get(), cancel, &cancelled).ok());
  ASSERT_TRUE(reader->Read(&event));
  EXPECT_EQ(event.state_change().new_state(), v1::JOB_STATE_CANCELLED);
  EXPECT_FALSE(reader->Read(&event));
  EXPECT_TRUE(reader->Finish().ok());
}

TEST_F(CoordinatorTest, PaginationVisitsEveryJobOnce) {
  std::set<std::string> submitted;
  for (int i = 0; i < 7; ++i) submitted.insert(Submit(ValidSpec(absl::StrCat("job-", i))).job_id());
  std::set<std::string> seen;
  std::string token;
  int pages = 0;
  do {
    v1::ListJobsRequest request;
    request.set_page_size(3);
    request.set_page_token(token);
    v1::ListJobsResponse response;
    ASSERT_TRUE(stub_->ListJobs(Context().get(), request, &response).ok());
    for (const auto& job : response.jobs()) EXPECT_TRUE(seen.insert(job.job_id()).second);
    token = response.next_page_token();
    ++pages;
  } while (!token.empty() && pages < 10);
  EXPECT_EQ(seen, submitted);
  EXPECT_EQ(pages, 3);
}

TEST_F(CoordinatorTest, IdempotentSubmission) {
  v1::Job a = Submit(ValidSpec("same"), "request-42");
  v1::Job b = Submit(ValidSpec("same"), "request-42");
  EXPECT_EQ(a.job_id(), b.job_id());
}

// A spec naming a Hugging Face directory is planned from its config.json; a directory without
// one, or an architecture Tessera does not run, is refused at submission naming the field.
TEST_F(CoordinatorTest, FromPretrainedIsPlannedFromTheModelsConfig) {
  const std::string model_dir = dir_.path() + "/hf-llama";
  std::filesystem::create_directories(model_dir);
  std::ofstream(model_dir + "/config.json")
      << R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 320, "max_position_embeddings": 128,
             "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false})";
  v1::JobSpec spec = ValidSpec("from-hf");
  spec.mutable_model()->set_from_pretrained(model_dir);
  v1::Job job = Submit(spec);
  ASSERT_FALSE(job.job_id().empty());
  EXPECT_EQ(job.plan().model().dims().hidden_size(), 64);
  EXPECT_EQ(job.plan().model().dims().num_layers(), 2);
  EXPECT_EQ(job.plan().model().dims().vocab_size(), 320);

  v1::SubmitJobRequest bad;
  *bad.mutable_spec() = ValidSpec("no-config");
  bad.mutable_spec()->mutable_model()->set_from_pretrained(dir_.path() + "/nowhere");
  v1::SubmitJobResponse response;
  grpc::Status status = stub_->SubmitJob(Context().get(), bad, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("model.from_pretrained"));
  EXPECT_THAT(status.error_message(), HasSubstr("config.json"));
}

TEST_F(CoordinatorTest, BadInputGetsTheRightCode) {
  v1::SubmitJobRequest bad;
  *bad.mutable_spec() = ValidSpec("bad");
  bad.mutable_spec()->mutable_batch()->set_global_batch_size(7);
  v1::SubmitJobResponse response;
  grpc::Status status = stub_->SubmitJob(Context().get(), bad, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("batch.global_batch_size"));

  *bad.mutable_spec() = ValidSpec("bad");
  bad.mutable_spec()->mutable_model()->set_preset("gpt5");
  status = stub_->SubmitJob(Context().get(), bad, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("model.preset"));

  v1::Job job;
  EXPECT_EQ(Get("job-ffffffff", &job).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Get("", &job).error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  v1::WatchJobRequest watch;
  watch.set_job_id("job-ffffffff");
  auto context = Context();
  auto reader = stub_->WatchJob(context.get(), watch);
  v1::JobEvent event;
  EXPECT_FALSE(reader->Read(&event));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::NOT_FOUND);

  v1::GetMetricsRequest metrics;
  metrics.set_job_id("job-ffffffff");
  v1::GetMetricsResponse metrics_response;
  EXPECT_EQ(stub_->GetMetrics(Context().get(), metrics, &metrics_response).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

TEST_F(CoordinatorTest, EverythingSurvivesSigkill) {
  std::vector<std::string> ids;
  for (int i = 0; i < 3; ++i)
    ids.push_back(Submit(ValidSpec(absl::StrCat("durable-", i))).job_id());
  v1::CancelJobRequest cancel;
  cancel.set_job_id(ids[1]);
  v1::CancelJobResponse cancelled;
  ASSERT_TRUE(stub_->CancelJob(Context().get(), cancel, &cancelled).ok());

  auto exit = process_->Stop(SIGKILL);
  ASSERT_THAT(exit, IsOk());
  EXPECT_EQ(exit->signal, SIGKILL);
  process_.reset();
  Start();

  for (int i = 0; i < 3; ++i) {
    v1::Job job;
    ASSERT_TRUE(Get(ids[i], &job).ok()) << ids[i];
    EXPECT_EQ(job.spec().name(), absl::StrCat("durable-", i));
    EXPECT_EQ(job.state(), i == 1 ? v1::JOB_STATE_CANCELLED : v1::JOB_STATE_PENDING);
  }
  EXPECT_EQ(Watch(ids[1], 0).size(), 2u);
  // New ids keep counting after the restart: no reuse.
  v1::Job next = Submit(ValidSpec("after-restart"));
  for (const auto& id : ids) EXPECT_NE(next.job_id(), id);
}

}  // namespace
}  // namespace tessera

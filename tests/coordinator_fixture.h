// The fixture of the coordinator's integration tests (coordinator_*_test.cc): it starts the real
// tessera-coordinator on 127.0.0.1:0 with a state file of its own and drives tessera.v1.Coordinator
// and tessera.v1.NodeService over gRPC, playing the workers itself (fake nodes that register,
// heartbeat and report). Also the job specs those tests submit.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/daemon/server.h"
#include "common/status_matchers.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "tessera/v1/coordinator_service.grpc.pb.h"
#include "tessera/v1/node_service.grpc.pb.h"
#include "tests/util/grpc_context.h"
#include "tests/util/http_get.h"
#include "tests/util/job_specs.h"
#include "tests/util/subprocess.h"
#include "tests/util/temp_dir.h"
#include "tests/util/wait.h"

namespace tessera {

using ::tessera::testing::BinDir;
using ::tessera::testing::IsOk;
using ::tessera::testing::ScopedTempDir;
using ::tessera::testing::Subprocess;

inline std::unique_ptr<grpc::ClientContext> Context(int seconds = 10) {
  return testing::ContextWithDeadline(seconds);
}

inline v1::JobSpec ValidSpec(const std::string& name) { return testing::TinyCpuJobSpec(name); }

class CoordinatorTest : public ::testing::Test {
 protected:
  void SetUp() override { Start(); }

  void Start(const std::vector<std::string>& extra_flags = {}) {
    std::vector<std::string> argv = {BinDir() + "/tessera-coordinator", "--listen=127.0.0.1:0",
                                     "--metrics_listen=127.0.0.1:0",
                                     "--state=" + dir_.path() + "/state.db"};
    argv.insert(argv.end(), extra_flags.begin(), extra_flags.end());
    auto process = Subprocess::Start(argv);
    ASSERT_THAT(process, IsOk());
    process_.emplace(std::move(*process));
    auto line = process_->WaitForStderrLine("serving gRPC on");
    ASSERT_THAT(line, IsOk());
    std::smatch match;
    ASSERT_TRUE(std::regex_search(
        *line, match, std::regex(R"(serving gRPC on (\S+:\d+)(, metrics on port (\d+))?)")));
    address_ = match[1];
    metrics_port_ = match[3].matched ? std::stoi(match[3]) : 0;
    channel_ = MakeClientChannel(address_);
    stub_ = v1::Coordinator::NewStub(channel_);
    nodes_ = v1::NodeService::NewStub(MakeClientChannel(match[1]));
  }

  // The value of the series `series` (name and labels, as exposed) on the coordinator's
  // /metrics now: 0 when it has none, -1 when /metrics cannot be read.
  int64_t MetricValue(const std::string& series) {
    absl::StatusOr<testing::HttpResponse> page = testing::HttpGet(metrics_port_, "/metrics");
    if (!page.ok() || page->status_code != 200) return -1;
    const std::string prefix = series + " ";
    for (absl::string_view line : absl::StrSplit(page->body, '\n')) {
      if (absl::StartsWith(line, prefix)) {
        double value = 0;
        return absl::SimpleAtod(line.substr(prefix.size()), &value) ? static_cast<int64_t>(value)
                                                                    : -1;
      }
    }
    return 0;
  }
  // How many calls of Coordinator/`method` reached the coordinator
  // (tessera_grpc_server_started_total): what a test waits for to know that calls it made are
  // inside the coordinator, waiting there.
  int64_t StartedCalls(const std::string& method) {
    return MetricValue(absl::StrCat(
        "tessera_grpc_server_started_total{method=\"/tessera.v1.Coordinator/", method, "\"}"));
  }

  // Polls GetJob until `done` holds or 10 s pass; returns the last job seen.
  v1::Job WaitForJob(const std::string& job_id, const std::function<bool(const v1::Job&)>& done) {
    v1::Job job;
    testing::WaitUntil([&] { return Get(job_id, &job).ok() && done(job); }, absl::Seconds(10),
                       absl::Milliseconds(50));
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
      gpu->set_uuid(absl::StrCat("GPU-", node_id, "-", i));
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
  // host:port the coordinator serves on.
  std::string address_;
  int metrics_port_ = 0;
  std::optional<Subprocess> process_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  std::unique_ptr<v1::NodeService::Stub> nodes_;
};

// A job on `gpus` GPUs with an explicit dp x tp layout (pp 1).
inline v1::JobSpec GpuSpec(const std::string& name, int gpus, int dp, int tp) {
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

// An automatic-layout job on GPUs: the given gpt2-124m spec, no explicit layout.
inline v1::JobSpec AutoGpuSpec(const std::string& name, const std::string& preset, int gpus,
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

}  // namespace tessera

// The fixture of the whole-system tests (cluster_e2e_*_test.cc): a real coordinator, one real
// worker with two CPU slots (or two or three with one slot each), and real tessera-trainer
// processes on the bundled corpus, all on loopback; helpers to submit, wait for a job's state,
// step or checkpoint, find trainer processes and compare loss curves.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/daemon/server.h"
#include "common/status_matchers.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "tessera/v1/coordinator_service.grpc.pb.h"
#include "tests/util/grpc_context.h"
#include "tests/util/http_get.h"
#include "tests/util/netns.h"
#include "tests/util/subprocess.h"
#include "tests/util/temp_dir.h"
#include "tests/util/wait.h"

namespace tessera {

using ::tessera::testing::BinDir;
using ::tessera::testing::IsOk;
using ::tessera::testing::RunCommand;
using ::tessera::testing::ScopedTempDir;
using ::tessera::testing::Subprocess;

inline std::unique_ptr<grpc::ClientContext> Context(int seconds = 10) {
  return testing::ContextWithDeadline(seconds);
}

// The gRPC address (and metrics port, when `metrics_port` is given) from a
// daemon's "serving gRPC on HOST:PORT[, metrics on port N]" line.
inline std::string Address(Subprocess& process, int* metrics_port = nullptr) {
  auto line = process.WaitForStderrLine("serving gRPC on");
  EXPECT_THAT(line, IsOk());
  if (!line.ok()) return "";
  std::smatch match;
  std::regex_search(*line, match,
                    std::regex(R"(serving gRPC on (\S+:\d+)(, metrics on port (\d+))?)"));
  if (metrics_port != nullptr && match[3].matched) *metrics_port = std::stoi(match[3]);
  return match[1];
}

class ClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto prepared = RunCommand({BinDir() + "/tessera-trainer", "prepare",
                                "--input=" + std::string(TESSERA_CORPUS_FILE),
                                "--output_dir=" + dir_.path() + "/data"});
    ASSERT_THAT(prepared, IsOk());
    ASSERT_EQ(prepared->exit.exit_code, 0) << prepared->output;

    StartCoordinator();
    if (HasFatalFailure()) return;
    // One worker with two slots, or (second_worker_, third_worker_) two or three with one slot
    // each.
    const int workers = third_worker_ ? 3 : second_worker_ ? 2 : 1;
    for (int w = 0; w < workers; ++w) {
      StartWorker(w, workers);
      if (HasFatalFailure()) return;
    }
    stub_ = v1::Coordinator::NewStub(MakeClientChannel(address_));
    // The workers register within their first heartbeat.
    const bool registered = testing::WaitUntil(
        [&] {
          v1::ListNodesResponse nodes;
          return stub_->ListNodes(Context().get(), {}, &nodes).ok() &&
                 nodes.nodes_size() == workers;
        },
        absl::Seconds(10), absl::Milliseconds(100));
    if (!registered) FAIL() << "the workers did not register";
  }

  // Starts the coordinator (on SQLite state) and sets address_; a subclass may start others.
  // Again after a restart (address_ set): on the same address and state, so the workers that
  // outlived it find it where they left it.
  virtual void StartCoordinator() {
    const std::string listen = address_.empty() ? HostIp(0) + ":0" : address_;
    auto coordinator = Subprocess::Start(OnHost(
        0, {BinDir() + "/tessera-coordinator", "--listen=" + listen, "--metrics_listen=",
            "--state=" + dir_.path() + "/state.db", "--checkpoint_root=" + dir_.path() + "/ckpt",
            // Test processes run side by side: each coordinator hands out its
            // own rendezvous ports.
            absl::StrCat("--master_port_base=", MasterPortBase()), "--heartbeat_interval=500ms",
            "--heartbeat_timeout=3s", coordinator_flag_}));
    ASSERT_THAT(coordinator, IsOk());
    coordinator_.emplace(std::move(*coordinator));
    const std::string address = Address(*coordinator_);
    if (address_.empty()) {
      address_ = address;
      return;
    }
    ASSERT_EQ(address, address_);
    // A restart: the test's channel reconnects after its backoff.
    const bool answering = testing::WaitUntil(
        [&] {
          v1::ListNodesResponse nodes;
          return stub_ == nullptr || stub_->ListNodes(Context().get(), {}, &nodes).ok();
        },
        absl::Seconds(30), absl::Milliseconds(100));
    ASSERT_TRUE(answering) << "the restarted coordinator does not answer on " << address_;
  }

  // The coordinator's --master_port_base.
  static int MasterPortBase() { return 40000 + (getpid() % 2000) * 10; }

  static std::string WorkerName(int w) {
    return w == 0 ? "e2e-node" : absl::StrCat("e2e-node-", w + 1);
  }

  // Starts worker `w` (0, 1 or 2) of `workers`, as SetUp does; again after a restart.
  void StartWorker(int w, int workers) {
    const std::string name = WorkerName(w);
    auto worker =
        Subprocess::Start(OnHost(w + 1, {BinDir() + "/tessera-worker",
                           "--coordinator=" + (worker_coordinators_.empty() ? address_
                                                                          : worker_coordinators_),
                           "--listen=" + HostIp(w + 1) + ":0",
                           "--metrics_listen=" + HostIp(w + 1) + ":0",
                           "--node_name=" + name, absl::StrCat("--cpu_slots=", workers == 1 ? 2 : 1),
                           "--work_dir=" + dir_.path() + "/" + name, "--stop_grace=2s"}),
                          {.merge_stdout = false, .extra_env = worker_env_});
    ASSERT_THAT(worker, IsOk());
    std::optional<Subprocess>& slot = w == 0 ? worker_ : w == 1 ? worker2_ : worker3_;
    slot.emplace(std::move(*worker));
    int unused_port = 0;
    ASSERT_FALSE(Address(*slot, w == 0   ? &worker_metrics_port_
                                : w == 1 ? &worker2_metrics_port_
                                         : &unused_port)
                     .empty());
  }

  void TearDown() override {
    if (worker3_) {
      EXPECT_THAT(worker3_->Stop(SIGTERM), IsOk());
    }
    if (worker2_) {
      EXPECT_THAT(worker2_->Stop(SIGTERM), IsOk());
    }
    if (worker_) {
      EXPECT_THAT(worker_->Stop(SIGTERM), IsOk());
    }
    if (coordinator_) {
      EXPECT_THAT(coordinator_->Stop(SIGTERM), IsOk());
    }
  }

  v1::JobSpec Spec(int steps) {
    v1::JobSpec spec;
    spec.set_name("e2e");
    spec.mutable_model()->set_preset("tiny-gpt2");
    spec.mutable_data()->add_train_shards(dir_.path() + "/data/train-*.bin");
    spec.mutable_data()->set_seq_len(64);
    spec.mutable_batch()->set_global_batch_size(8);
    spec.mutable_batch()->set_micro_batch_size(2);
    spec.mutable_optimizer()->mutable_schedule()->set_peak_learning_rate(3e-3);
    spec.mutable_optimizer()->mutable_schedule()->set_warmup_steps(5);
    spec.set_max_steps(steps);
    spec.mutable_checkpoint()->set_interval_steps(10);
    spec.mutable_resources()->set_cpu_slots(2);
    return spec;
  }

  // Submits `spec`; the job id, or "" after a failed assertion.
  std::string Submit(const v1::JobSpec& spec) {
    v1::SubmitJobRequest request;
    *request.mutable_spec() = spec;
    v1::SubmitJobResponse response;
    grpc::Status status = stub_->SubmitJob(Context().get(), request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response.job().job_id();
  }

  // Polls the job until it is in `state` (or FAILED) or `seconds` pass; returns the last seen.
  v1::Job WaitFor(const std::string& job_id, v1::JobState state, int seconds) {
    v1::GetJobRequest request;
    request.set_job_id(job_id);
    v1::GetJobResponse response;
    testing::WaitUntil(
        [&] {
          return stub_->GetJob(Context().get(), request, &response).ok() &&
                 (response.job().state() == state ||
                  (state != v1::JOB_STATE_FAILED &&
                   response.job().state() == v1::JOB_STATE_FAILED));
        },
        absl::Seconds(seconds), absl::Milliseconds(100));
    return response.job();
  }

  v1::Job Get(const std::string& job_id) {
    v1::GetJobRequest request;
    request.set_job_id(job_id);
    v1::GetJobResponse response;
    EXPECT_TRUE(stub_->GetJob(Context().get(), request, &response).ok());
    return response.job();
  }

  // Waits until the job has reported `step`; false after `seconds`.
  bool WaitForStep(const std::string& job_id, int64_t step, int seconds) {
    return testing::WaitUntil(
        [&] {
          v1::Job job = Get(job_id);
          return job.current_step() >= step && job.state() == v1::JOB_STATE_RUNNING;
        },
        absl::Seconds(seconds), absl::Milliseconds(50));
  }

  // Waits until the running job has recorded a checkpoint at `step` or later; false after
  // `seconds` or once the job has stopped running. Saves are asynchronous: a trainer goes on to
  // later steps before the save it started commits, further on a loaded machine.
  bool WaitForCheckpoint(const std::string& job_id, int64_t step, int seconds) {
    bool checkpointed = false;
    testing::WaitUntil(
        [&] {
          v1::Job job = Get(job_id);
          checkpointed =
              job.state() == v1::JOB_STATE_RUNNING && job.latest_checkpoint().step() >= step;
          return checkpointed ||
                 (job.state() != v1::JOB_STATE_RUNNING && job.state() != v1::JOB_STATE_SCHEDULED &&
                  job.state() != v1::JOB_STATE_PENDING);
        },
        absl::Seconds(seconds), absl::Milliseconds(20));
    return checkpointed;
  }

  // Pids of the trainer processes whose task file lies under `dir` (a worker's work dir, a job's
  // attempt directory, one rank's task file...).
  std::vector<pid_t> TrainerPids(const std::string& pattern) {
    // "[-]-task" keeps pgrep from matching the shell that runs it.
    auto pgrep = RunCommand({"/bin/sh", "-c", "pgrep -f '[-]-task=" + pattern + "' || true"});
    EXPECT_THAT(pgrep, IsOk());
    std::vector<pid_t> pids;
    if (!pgrep.ok()) return pids;
    for (absl::string_view line : absl::StrSplit(pgrep->output, '\n', absl::SkipEmpty())) {
      pids.push_back(std::stoi(std::string(line)));
    }
    return pids;
  }

  // The newest step the worker at `metrics_port` exported for `job_id` (its rank 0 reports it);
  // -1 when there is none yet.
  int64_t WorkerStep(int metrics_port, const std::string& job_id) {
    auto page = testing::HttpGet(metrics_port, "/metrics");
    if (!page.ok()) return -1;
    std::smatch match;
    if (!std::regex_search(page->body, match,
                           std::regex("tessera_train_step\\{[^}]*job_id=\"" + job_id +
                                      "\"[^}]*\\} (\\S+)"))) {
      return -1;
    }
    return static_cast<int64_t>(std::stod(match[1]));
  }

  std::string RankTask(const std::string& node, const std::string& job_id, int attempt, int rank) {
    return absl::StrCat(dir_.path(), "/", node, "/jobs/", job_id, "/attempt-", attempt, "/rank-",
                        rank, ".task.pb");
  }

  std::vector<v1::StepMetrics> Curve(const std::string& job_id) {
    v1::GetMetricsRequest metrics;
    metrics.set_job_id(job_id);
    v1::GetMetricsResponse curve;
    EXPECT_TRUE(stub_->GetMetrics(Context().get(), metrics, &curve).ok());
    return {curve.points().begin(), curve.points().end()};
  }

  // Runs `spec` again without interruption (its own checkpoint directory) and expects `curve`'s
  // losses, step by step: exactly, by default. A job that resumes on the same layout and world
  // size (a restart, a drain, a preemption, a coordinator failover) resumes bit for bit: the same
  // data position, RNG state, weights and optimizer state, and the same reduction order. Only a
  // job re-planned onto another world size sums its gradients in another order, and is compared
  // within `tolerance`.
  void ExpectTheLossesOfAnUninterruptedRun(v1::JobSpec spec,
                                           const std::vector<v1::StepMetrics>& curve,
                                           double tolerance = 0) {
    spec.set_name("uninterrupted");
    spec.mutable_checkpoint()->set_directory(dir_.path() + "/uninterrupted");
    v1::Job reference = WaitFor(Submit(spec), v1::JOB_STATE_SUCCEEDED, 240);
    ASSERT_EQ(reference.state(), v1::JOB_STATE_SUCCEEDED) << reference.reason();
    std::vector<v1::StepMetrics> expected = Curve(reference.job_id());
    ASSERT_EQ(expected.size(), curve.size());
    for (size_t i = 0; i < curve.size(); ++i) {
      if (tolerance == 0) {
        EXPECT_EQ(curve[i].loss(), expected[i].loss()) << "step " << i + 1;
      } else {
        EXPECT_NEAR(curve[i].loss(), expected[i].loss(), tolerance) << "step " << i + 1;
      }
    }
  }

  std::vector<v1::JobEvent> Events(const std::string& job_id) {
    v1::WatchJobRequest request;
    request.set_job_id(job_id);
    auto context = Context(30);
    auto reader = stub_->WatchJob(context.get(), request);
    std::vector<v1::JobEvent> events;
    v1::JobEvent event;
    // The stream ends after the event that ends the job.
    while (reader->Read(&event)) events.push_back(event);
    return events;
  }

  // Host 0 runs the coordinator, host w + 1 worker w: on loopback, or on the hosts of lab_ (a
  // subclass's network of namespaces, made before SetUp).
  // Off loopback the daemons serve plaintext only when told to (--insecure).
  std::vector<std::string> OnHost(int host, std::vector<std::string> argv) const {
    if (!lab_) return argv;
    argv.push_back("--insecure");
    return lab_->On(host, argv);
  }
  std::string HostIp(int host) const { return lab_ ? lab_->Ip(host) : "127.0.0.1"; }

  ScopedTempDir dir_{"cluster_e2e"};
  // Declared before the processes: they stop before their network goes.
  std::unique_ptr<testing::NetnsLab> lab_;
  std::optional<Subprocess> coordinator_;
  std::optional<Subprocess> worker_;
  std::string address_;
  // The workers' --coordinator when not address_ (several coordinators).
  std::string worker_coordinators_;
  int worker_metrics_port_ = 0;
  bool second_worker_ = false;
  bool third_worker_ = false;
  // One more coordinator flag (a subclass's, set before SetUp); a repeated harmless one otherwise.
  std::string coordinator_flag_ = "--heartbeat_timeout=3s";
  std::optional<Subprocess> worker3_;
  // NAME=VALUE added to the workers' environment (their trainers inherit it).
  std::vector<std::string> worker_env_;
  std::optional<Subprocess> worker2_;
  int worker2_metrics_port_ = 0;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

class TwoWorkerClusterTest : public ClusterTest {
 protected:
  void SetUp() override {
    second_worker_ = true;
    ClusterTest::SetUp();
  }
};

}  // namespace tessera

// The whole system on loopback: a real coordinator, a real worker with two
// CPU slots, and real tessera-trainer processes. A 2-rank data-parallel job
// on the bundled corpus runs to SUCCEEDED; its loss curve, checkpoint and
// logs come back through the coordinator. A cancelled job's trainers stop.

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/job_spec_file.h"
#include "client/progress_line.h"
#include "common/daemon/server.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/time_util.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "tessera/v1/coordinator_service.grpc.pb.h"
#include "tests/util/grpc_context.h"
#include "tests/util/http_get.h"
#include "tests/util/pty.h"
#include "tests/util/subprocess.h"
#include "tests/util/temp_dir.h"

namespace tessera {
namespace {

using ::tessera::testing::BinDir;
using ::tessera::testing::IsOk;
using ::tessera::testing::RunCommand;
using ::tessera::testing::ScopedTempDir;
using ::tessera::testing::Subprocess;
using ::testing::HasSubstr;

std::unique_ptr<grpc::ClientContext> Context(int seconds = 10) {
  return testing::ContextWithDeadline(seconds);
}

// The gRPC address (and metrics port, when `metrics_port` is given) from a
// daemon's "serving gRPC on HOST:PORT[, metrics on port N]" line.
std::string Address(Subprocess& process, int* metrics_port = nullptr) {
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

    auto coordinator =
        Subprocess::Start({BinDir() + "/tessera-coordinator", "--listen=127.0.0.1:0",
                           "--metrics_listen=", "--state=" + dir_.path() + "/state.db",
                           "--checkpoint_root=" + dir_.path() + "/ckpt",
                           // Test processes run side by side: each coordinator hands out its
                           // own rendezvous ports.
                           absl::StrCat("--master_port_base=", 40000 + (getpid() % 2000) * 10),
                           "--heartbeat_interval=500ms", "--heartbeat_timeout=3s"});
    ASSERT_THAT(coordinator, IsOk());
    coordinator_.emplace(std::move(*coordinator));
    address_ = Address(*coordinator_);
    // One worker with two slots, or (second_worker_, third_worker_) two or three with one slot
    // each.
    const int workers = third_worker_ ? 3 : second_worker_ ? 2 : 1;
    for (int w = 0; w < workers; ++w) {
      StartWorker(w, workers);
      if (HasFatalFailure()) return;
    }
    stub_ = v1::Coordinator::NewStub(MakeClientChannel(address_));
    // The workers register within their first heartbeat.
    for (int i = 0; i < 100; ++i) {
      v1::ListNodesResponse nodes;
      if (stub_->ListNodes(Context().get(), {}, &nodes).ok() && nodes.nodes_size() == workers) {
        return;
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    FAIL() << "the workers did not register";
  }

  static std::string WorkerName(int w) {
    return w == 0 ? "e2e-node" : absl::StrCat("e2e-node-", w + 1);
  }

  // Starts worker `w` (0, 1 or 2) of `workers`, as SetUp does; again after a restart.
  void StartWorker(int w, int workers) {
    const std::string name = WorkerName(w);
    auto worker =
        Subprocess::Start({BinDir() + "/tessera-worker", "--coordinator=" + address_,
                           "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
                           "--node_name=" + name, absl::StrCat("--cpu_slots=", workers == 1 ? 2 : 1),
                           "--work_dir=" + dir_.path() + "/" + name, "--stop_grace=2s"},
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

  v1::Job WaitFor(const std::string& job_id, v1::JobState state, int seconds) {
    v1::GetJobRequest request;
    request.set_job_id(job_id);
    v1::GetJobResponse response;
    absl::Time deadline = absl::Now() + absl::Seconds(seconds);
    while (absl::Now() < deadline) {
      if (stub_->GetJob(Context().get(), request, &response).ok() &&
          (response.job().state() == state ||
           (state != v1::JOB_STATE_FAILED && response.job().state() == v1::JOB_STATE_FAILED))) {
        break;
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
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
    absl::Time deadline = absl::Now() + absl::Seconds(seconds);
    while (absl::Now() < deadline) {
      v1::Job job = Get(job_id);
      if (job.current_step() >= step && job.state() == v1::JOB_STATE_RUNNING) return true;
      absl::SleepFor(absl::Milliseconds(50));
    }
    return false;
  }

  // Waits until the running job has recorded a checkpoint at `step` or later; false after
  // `seconds` or once the job has stopped running. Saves are asynchronous: a trainer goes on to
  // later steps before the save it started commits, further on a loaded machine.
  bool WaitForCheckpoint(const std::string& job_id, int64_t step, int seconds) {
    absl::Time deadline = absl::Now() + absl::Seconds(seconds);
    while (absl::Now() < deadline) {
      v1::Job job = Get(job_id);
      if (job.state() == v1::JOB_STATE_RUNNING && job.latest_checkpoint().step() >= step) {
        return true;
      }
      if (job.state() != v1::JOB_STATE_RUNNING && job.state() != v1::JOB_STATE_SCHEDULED &&
          job.state() != v1::JOB_STATE_PENDING) {
        return false;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    return false;
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
  // losses, step by step.
  void ExpectTheLossesOfAnUninterruptedRun(v1::JobSpec spec,
                                           const std::vector<v1::StepMetrics>& curve) {
    spec.set_name("uninterrupted");
    spec.mutable_checkpoint()->set_directory(dir_.path() + "/uninterrupted");
    v1::Job reference = WaitFor(Submit(spec), v1::JOB_STATE_SUCCEEDED, 240);
    ASSERT_EQ(reference.state(), v1::JOB_STATE_SUCCEEDED) << reference.reason();
    std::vector<v1::StepMetrics> expected = Curve(reference.job_id());
    ASSERT_EQ(expected.size(), curve.size());
    for (size_t i = 0; i < curve.size(); ++i) {
      EXPECT_NEAR(curve[i].loss(), expected[i].loss(), 1e-4) << "step " << i + 1;
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

  ScopedTempDir dir_{"cluster_e2e"};
  std::optional<Subprocess> coordinator_;
  std::optional<Subprocess> worker_;
  std::string address_;
  int worker_metrics_port_ = 0;
  bool second_worker_ = false;
  bool third_worker_ = false;
  std::optional<Subprocess> worker3_;
  // NAME=VALUE added to the workers' environment (their trainers inherit it).
  std::vector<std::string> worker_env_;
  std::optional<Subprocess> worker2_;
  int worker2_metrics_port_ = 0;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

TEST_F(ClusterTest, TwoRankJobTrainsThroughCoordinatorAndWorker) {
  const std::string job_id = Submit(Spec(30));
  ASSERT_FALSE(job_id.empty());

  v1::Job job = WaitFor(job_id, v1::JOB_STATE_SUCCEEDED, 240);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason() << "\n"
                                                  << job.failure().message() << "\nworker:\n"
                                                  << worker_->stderr_text();
  EXPECT_EQ(job.current_step(), 30);

  v1::GetMetricsRequest metrics;
  metrics.set_job_id(job_id);
  v1::GetMetricsResponse curve;
  ASSERT_TRUE(stub_->GetMetrics(Context().get(), metrics, &curve).ok());
  ASSERT_EQ(curve.points_size(), 30);
  EXPECT_NEAR(curve.points(0).loss(), std::log(257.0), 0.5);
  EXPECT_LT(curve.points(29).loss(), curve.points(0).loss() - 1.0);

  v1::ListCheckpointsRequest list;
  list.set_job_id(job_id);
  v1::ListCheckpointsResponse checkpoints;
  ASSERT_TRUE(stub_->ListCheckpoints(Context().get(), list, &checkpoints).ok());
  ASSERT_EQ(checkpoints.checkpoints_size(), 3);  // steps 10, 20, 30
  EXPECT_EQ(checkpoints.checkpoints(0).step(), 30);
  EXPECT_EQ(checkpoints.checkpoints(0).num_shards(), 2);

  v1::GetLogsRequest logs;
  logs.set_job_id(job_id);
  logs.set_rank(-1);
  logs.set_attempt(-1);
  auto context = Context(30);
  auto reader = stub_->GetLogs(context.get(), logs);
  std::string text;
  std::set<int> ranks;
  v1::LogChunk chunk;
  while (reader->Read(&chunk)) {
    text += chunk.data();
    ranks.insert(chunk.rank());
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(ranks, (std::set<int>{0, 1}));
  EXPECT_THAT(text, HasSubstr("[rank 1] model tiny-gpt2"));

  // The worker exports the job's training metrics (rank 0 reports them).
  ASSERT_GT(worker_metrics_port_, 0);
  auto metrics_page = testing::HttpGet(worker_metrics_port_, "/metrics");
  ASSERT_THAT(metrics_page, IsOk());
  EXPECT_THAT(metrics_page->body,
              HasSubstr(absl::StrCat("tessera_train_loss{job_id=\"", job_id, "\",rank=\"0\"}")));
  EXPECT_THAT(metrics_page->body, HasSubstr("tessera_train_tokens_per_second{"));
}

// Instruction records in Alpaca's format for a task a small model can pick up in two epochs:
// spelling a word backwards.
std::string AlpacaRecords(int count) {
  const char* words[] = {"apple", "river", "stone", "cloud", "ember", "maple", "tiger", "lemon",
                         "piano", "robin", "sugar", "quilt", "ocean", "delta", "forge", "haven"};
  std::string out;
  for (int i = 0; i < count; ++i) {
    const std::string word = words[i % 16];
    const std::string reversed(word.rbegin(), word.rend());
    out += absl::StrCat(R"({"instruction": "Reverse the word.", "input": ")", word,
                        R"(", "output": ")", reversed, "\"}\n");
  }
  return out;
}

// examples/tiny-lora-alpaca.yaml as a user runs it: a base model exported in Hugging Face's
// format, Alpaca records prepared with the prompt masked, LoRA for two epochs through the
// coordinator; the step count comes from the epochs, and the adapter lands in PEFT's layout.
TEST_F(ClusterTest, TheLoraExampleFineTunesAnImportedModelForTwoEpochs) {
  const std::string trainer = BinDir() + "/tessera-trainer";
  const std::string base = dir_.path() + "/base";
  auto exported = RunCommand({trainer, "--preset=tiny-llama", "--export_hf=" + base});
  ASSERT_THAT(exported, IsOk());
  ASSERT_EQ(exported->exit.exit_code, 0) << exported->output;
  std::ofstream(dir_.path() + "/alpaca.jsonl") << AlpacaRecords(160);
  auto prepared = RunCommand({trainer, "prepare", "--input=" + dir_.path() + "/alpaca.jsonl",
                              "--output_dir=" + dir_.path() + "/sft", "--sample_seq_len=64",
                              "--prompt_template=chat", "--val_fraction=0.1"});
  ASSERT_THAT(prepared, IsOk());
  ASSERT_EQ(prepared->exit.exit_code, 0) << prepared->output;

  auto spec = client::LoadJobSpec(
      std::string(TESSERA_EXAMPLES_DIR) + "/tiny-lora-alpaca.yaml",
      [&](const std::string& name) -> std::optional<std::string> {
        if (name == "TESSERA_BASE_MODEL") return base;
        if (name == "TESSERA_DATA_DIR") return dir_.path() + "/sft";
        return std::nullopt;
      });
  ASSERT_THAT(spec, IsOk());
  const std::string job_id = Submit(*spec);
  ASSERT_FALSE(job_id.empty());
  v1::Job job = WaitFor(job_id, v1::JOB_STATE_SUCCEEDED, 240);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason() << "\n"
                                                  << job.failure().message() << "\nworker:\n"
                                                  << worker_->stderr_text();
  EXPECT_EQ(job.plan().lora_rank(), 8);
  // 144 training records, 16 per step: two epochs are 18 steps.
  const std::vector<v1::StepMetrics> curve = Curve(job_id);
  ASSERT_EQ(curve.size(), 18u);
  EXPECT_EQ(job.current_step(), 18);
  EXPECT_EQ(curve.back().max_steps(), 18);
  EXPECT_DOUBLE_EQ(curve.back().epoch(), 2.0);
  EXPECT_DOUBLE_EQ(curve[8].epoch(), 1.0);
  EXPECT_LT(curve.back().loss(), curve.front().loss() - 0.2)
      << curve.front().loss() << " -> " << curve.back().loss();

  v1::ListCheckpointsRequest list;
  list.set_job_id(job_id);
  v1::ListCheckpointsResponse checkpoints;
  ASSERT_TRUE(stub_->ListCheckpoints(Context().get(), list, &checkpoints).ok());
  ASSERT_GE(checkpoints.checkpoints_size(), 1);
  std::ifstream config(checkpoints.checkpoints(0).path() + "/adapter/adapter_config.json");
  const std::string text((std::istreambuf_iterator<char>(config)),
                         std::istreambuf_iterator<char>());
  EXPECT_THAT(text, HasSubstr("\"peft_type\": \"LORA\""));
  EXPECT_THAT(text, HasSubstr("\"o_proj\""));
  EXPECT_TRUE(std::filesystem::exists(checkpoints.checkpoints(0).path() +
                                      "/adapter/adapter_model.safetensors"));
}

class TwoWorkerClusterTest : public ClusterTest {
 protected:
  void SetUp() override {
    second_worker_ = true;
    ClusterTest::SetUp();
  }
};

TEST_F(TwoWorkerClusterTest, ARankOnEachNodeTrainsTogether) {
  v1::Job job = WaitFor(Submit(Spec(20)), v1::JOB_STATE_SUCCEEDED, 240);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
  std::set<std::string> nodes;
  for (const auto& rank : job.placements()) nodes.insert(rank.node_id());
  EXPECT_EQ(nodes, (std::set<std::string>{"e2e-node", "e2e-node-2"}));
  v1::GetMetricsRequest metrics;
  metrics.set_job_id(job.job_id());
  v1::GetMetricsResponse curve;
  ASSERT_TRUE(stub_->GetMetrics(Context().get(), metrics, &curve).ok());
  EXPECT_EQ(curve.points_size(), 20);
  // Rank 0's node exports the job's training series.
  const std::string rank0_node = job.placements(0).node_id();
  int port = rank0_node == "e2e-node" ? worker_metrics_port_ : worker2_metrics_port_;
  auto page = testing::HttpGet(port, "/metrics");
  ASSERT_THAT(page, IsOk());
  EXPECT_THAT(page->body, HasSubstr("tessera_train_loss{job_id=\"" + job.job_id() + "\""));
}

TEST_F(ClusterTest, NothingIsLostWhileTheCoordinatorRestarts) {
  const std::string job_id = Submit(Spec(300));
  ASSERT_FALSE(job_id.empty());
  v1::Job job = WaitFor(job_id, v1::JOB_STATE_RUNNING, 60);
  ASSERT_EQ(job.state(), v1::JOB_STATE_RUNNING) << job.reason();

  // kill -9 the coordinator mid-training; the trainers go on, the worker
  // keeps their reports. Restart it on the same address and state.
  ASSERT_THAT(coordinator_->Stop(SIGKILL), IsOk());
  coordinator_.reset();
  absl::SleepFor(absl::Seconds(3));
  auto coordinator =
      Subprocess::Start({BinDir() + "/tessera-coordinator", "--listen=" + address_,
                         "--metrics_listen=", "--state=" + dir_.path() + "/state.db",
                         "--checkpoint_root=" + dir_.path() + "/ckpt",
                         absl::StrCat("--master_port_base=", 40000 + (getpid() % 2000) * 10)});
  ASSERT_THAT(coordinator, IsOk());
  coordinator_.emplace(std::move(*coordinator));
  ASSERT_EQ(Address(*coordinator_), address_);

  job = WaitFor(job_id, v1::JOB_STATE_SUCCEEDED, 240);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
  v1::GetMetricsRequest metrics;
  metrics.set_job_id(job_id);
  v1::GetMetricsResponse curve;
  ASSERT_TRUE(stub_->GetMetrics(Context().get(), metrics, &curve).ok());
  // Every step, once, in order: the reports made while the coordinator was
  // down were relayed after it came back.
  ASSERT_EQ(curve.points_size(), 300);
  for (int i = 0; i < curve.points_size(); ++i) EXPECT_EQ(curve.points(i).step(), i + 1);
}

TEST_F(ClusterTest, ATrainerFailureFailsTheJobWithItsReason) {
  v1::JobSpec spec = Spec(20);
  // Validation cannot see the workers' file systems; the trainers can.
  spec.mutable_data()->set_train_shards(0, dir_.path() + "/missing/*.bin");
  v1::Job job = WaitFor(Submit(spec), v1::JOB_STATE_FAILED, 60);
  ASSERT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(job.failure().kind(), v1::FAILURE_KIND_DATA_ERROR);
  EXPECT_THAT(job.reason(), HasSubstr("missing/*.bin"));
  EXPECT_EQ(job.failure().node_id(), "e2e-node");
}

TEST_F(ClusterTest, KilledRankRestartsAndRetrainsTheLostStepsExactly) {
  constexpr int kSteps = 60;
  v1::JobSpec spec = Spec(kSteps);
  spec.set_max_restarts(2);
  const std::string job_id = Submit(spec);
  // The kill waits for a committed checkpoint at step 10 or later. Waiting for step 15 instead
  // let the kill land, on a loaded machine, before the asynchronous save of step 10 committed,
  // and the retry began at 0.
  ASSERT_TRUE(WaitForCheckpoint(job_id, 10, 120)) << Get(job_id).ShortDebugString();
  std::vector<pid_t> rank1 = TrainerPids(RankTask("e2e-node", job_id, 0, 1));
  ASSERT_EQ(rank1.size(), 1u);
  ASSERT_EQ(kill(rank1[0], SIGKILL), 0);
  v1::Job job = WaitFor(job_id, v1::JOB_STATE_SUCCEEDED, 240);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason() << "\n" << worker_->stderr_text();
  EXPECT_EQ(job.restarts(), 1) << job.ShortDebugString();
  ASSERT_EQ(job.attempts_size(), 2) << worker_->stderr_text();
  EXPECT_THAT(job.attempts(0).reason(), HasSubstr("rank 1 on e2e-node was killed by signal 9"));
  EXPECT_EQ(job.attempts(0).failure().rank(), 1);
  EXPECT_GE(job.attempts(1).start_step(), 10) << "resumed from a checkpoint";
  EXPECT_TRUE(TrainerPids(dir_.path() + "/e2e-node/jobs/" + job_id + "/attempt-0").empty());

  // The curve has every step once; the watch stream shows the restart between the attempts.
  std::vector<v1::StepMetrics> curve = Curve(job_id);
  ASSERT_EQ(curve.size(), static_cast<size_t>(kSteps));
  for (int i = 0; i < kSteps; ++i) EXPECT_EQ(curve[i].step(), i + 1);
  std::vector<std::string> transitions;
  for (const auto& event : Events(job_id)) {
    if (event.has_state_change()) {
      transitions.push_back(v1::JobState_Name(event.state_change().new_state()));
    }
  }
  EXPECT_THAT(transitions, ::testing::ElementsAre("JOB_STATE_PENDING", "JOB_STATE_SCHEDULED",
                                                  "JOB_STATE_RUNNING", "JOB_STATE_RESTARTING",
                                                  "JOB_STATE_SCHEDULED", "JOB_STATE_RUNNING",
                                                  "JOB_STATE_SUCCEEDED"));

  // The same job without the failure: the retrained steps have the same losses.
  ExpectTheLossesOfAnUninterruptedRun(spec, curve);
}

TEST_F(ClusterTest, WithoutRestartsTheKilledRankIsBlamedNotItsPeer) {
  const std::string job_id = Submit(Spec(100000));
  ASSERT_TRUE(WaitForStep(job_id, 3, 120)) << Get(job_id).reason();
  std::vector<pid_t> rank1 = TrainerPids(RankTask("e2e-node", job_id, 0, 1));
  ASSERT_EQ(rank1.size(), 1u);
  ASSERT_EQ(kill(rank1[0], SIGKILL), 0);
  v1::Job job = WaitFor(job_id, v1::JOB_STATE_FAILED, 60);
  ASSERT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(job.failure().rank(), 1);
  EXPECT_EQ(job.failure().signal(), 9);
  EXPECT_EQ(job.failure().kind(), v1::FAILURE_KIND_PROCESS_EXIT);
  EXPECT_THAT(job.reason(), HasSubstr("rank 1 on e2e-node was killed by signal 9"));
  EXPECT_EQ(job.restarts(), 0);
}

// Trainers whose loss turns NaN at step 4 of every attempt (fault injection through the worker's
// environment): the job restarts from its checkpoint until max_restarts is spent, then fails with
// every attempt's reason kept.
class DivergingClusterTest : public ClusterTest {
 protected:
  void SetUp() override {
    worker_env_ = {"TESSERA_FAULT_NAN_LOSS_AT_STEP=4"};
    ClusterTest::SetUp();
  }
};

TEST_F(DivergingClusterTest, AJobFailingAlikeEveryAttemptStopsAfterMaxRestarts) {
  v1::JobSpec spec = Spec(20);
  spec.set_max_restarts(2);
  const std::string job_id = Submit(spec);
  ASSERT_FALSE(job_id.empty());
  v1::Job job = WaitFor(job_id, v1::JOB_STATE_FAILED, 180);
  ASSERT_EQ(job.state(), v1::JOB_STATE_FAILED) << job.reason();
  EXPECT_EQ(job.restarts(), 2);
  EXPECT_EQ(job.failure().kind(), v1::FAILURE_KIND_NAN_LOSS);
  ASSERT_EQ(job.attempts_size(), 3) << job.ShortDebugString();
  for (int i = 0; i < job.attempts_size(); ++i) {
    // Every rank holds the all-reduced loss, so either may be the first to report it.
    EXPECT_EQ(job.attempts(i).attempt(), i);
    EXPECT_THAT(job.attempts(i).reason(), HasSubstr("NAN_LOSS: loss is nan at step 4")) << i;
  }
  // The diverged step reached the metrics: its loss is NaN, once, and the steps before it are
  // there once each.
  v1::GetMetricsRequest request;
  request.set_job_id(job_id);
  v1::GetMetricsResponse curve;
  ASSERT_TRUE(stub_->GetMetrics(Context().get(), request, &curve).ok());
  ASSERT_EQ(curve.points_size(), 4);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(curve.points(i).step(), i + 1);
  EXPECT_TRUE(std::isnan(curve.points(3).loss()));
}

TEST_F(ClusterTest, StoppedRankIsFoundHungAndTheJobRestarts) {
  v1::JobSpec spec = Spec(40);
  spec.set_max_restarts(1);
  spec.set_hang_timeout_seconds(3);
  const std::string job_id = Submit(spec);
  ASSERT_TRUE(WaitForStep(job_id, 12, 120)) << Get(job_id).reason();
  std::vector<pid_t> rank1 = TrainerPids(RankTask("e2e-node", job_id, 0, 1));
  ASSERT_EQ(rank1.size(), 1u);
  const absl::Time stopped = absl::Now();
  ASSERT_EQ(kill(rank1[0], SIGSTOP), 0);
  v1::Job job = WaitFor(job_id, v1::JOB_STATE_SUCCEEDED, 240);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason() << "\n" << worker_->stderr_text();
  ASSERT_EQ(job.attempts_size(), 2);
  const v1::TrainerFailure& hang = job.attempts(0).failure();
  EXPECT_EQ(hang.kind(), v1::FAILURE_KIND_COLLECTIVE_TIMEOUT);
  EXPECT_EQ(hang.rank(), 1);
  EXPECT_THAT(hang.message(), HasSubstr("stopped"));
  const absl::Time detected =
      absl::FromUnixNanos(google::protobuf::util::TimeUtil::TimestampToNanoseconds(hang.time()));
  EXPECT_LE(detected - stopped, absl::Seconds(3 + 2)) << "hang_timeout + 2 s";
  EXPECT_TRUE(TrainerPids(dir_.path() + "/e2e-node/jobs/" + job_id + "/attempt-0").empty());
}

TEST_F(TwoWorkerClusterTest, KilledWorkerLeavesNoTrainerAndTheJobGoesOnWithOneNode) {
  v1::JobSpec spec = Spec(60);
  spec.set_max_restarts(1);
  const std::string job_id = Submit(spec);
  ASSERT_TRUE(WaitForStep(job_id, 12, 120)) << Get(job_id).reason();
  const std::string node2_tasks = dir_.path() + "/e2e-node-2/";
  ASSERT_EQ(TrainerPids(node2_tasks).size(), 1u);
  ASSERT_THAT(worker2_->Stop(SIGKILL), IsOk());
  worker2_.reset();
  const absl::Time killed = absl::Now();
  while (!TrainerPids(node2_tasks).empty() && absl::Now() - killed < absl::Seconds(5)) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(TrainerPids(node2_tasks).empty()) << "a trainer outlived its worker";
  EXPECT_LE(absl::Now() - killed, absl::Seconds(2));

  v1::Job job = WaitFor(job_id, v1::JOB_STATE_SUCCEEDED, 240);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason() << "\n" << worker_->stderr_text();
  ASSERT_EQ(job.attempts_size(), 2);
  EXPECT_THAT(job.attempts(0).reason(), HasSubstr("node e2e-node-2 was lost"));
  EXPECT_EQ(job.attempts(1).world_size(), 1);
  EXPECT_EQ(job.attempts(1).node_ids(0), "e2e-node");
  EXPECT_EQ(job.plan().layout().data_parallel(), 1);
  std::vector<v1::StepMetrics> curve = Curve(job_id);
  ASSERT_EQ(curve.size(), 60u);
  for (int i = 0; i < 60; ++i) EXPECT_EQ(curve[i].step(), i + 1);
}

TEST_F(ClusterTest, TheCliSubmitsWatchesAndReads) {
  const std::string spec = dir_.path() + "/job.yaml";
  std::ofstream(spec) << "name: cli-job\n"
                      << "model: {preset: tiny-gpt2}\n"
                      << "data: {train_shards: [" << dir_.path() << "/data/train-*.bin], "
                      << "seq_len: 64}\n"
                      << "batch: {global_batch_size: 8, micro_batch_size: 2}\n"
                      << "parallelism: auto\n"
                      << "optimizer: {schedule: {peak_learning_rate: 3e-3, warmup_steps: 5}}\n"
                      << "max_steps: 25\n"
                      << "resources: {cpu_slots: 2}\n";
  const std::string tessera = BinDir() + "/tessera";
  // The address comes from the environment here.
  auto run = [&](const std::string& args) {
    return RunCommand(
        {"/bin/sh", "-c", "TESSERA_COORDINATOR=" + address_ + " " + tessera + " " + args},
        absl::Minutes(4));
  };
  auto submitted = run("submit " + spec + " --watch");
  ASSERT_THAT(submitted, IsOk());
  EXPECT_EQ(submitted->exit.exit_code, 0) << submitted->output;
  EXPECT_THAT(submitted->output, HasSubstr("[SUCCEEDED]"));
  EXPECT_THAT(submitted->output, HasSubstr("step 25/25"));
  const std::string job_id = submitted->output.substr(0, submitted->output.find('\n'));

  auto csv = run("metrics " + job_id);
  ASSERT_THAT(csv, IsOk());
  EXPECT_EQ(csv->exit.exit_code, 0);
  EXPECT_EQ(std::count(csv->output.begin(), csv->output.end(), '\n'), 26);  // header + 25 steps

  auto plot = run("plot " + job_id + " -o " + dir_.path() + "/curve.svg");
  ASSERT_THAT(plot, IsOk());
  EXPECT_EQ(plot->exit.exit_code, 0) << plot->output;
  std::ifstream svg(dir_.path() + "/curve.svg");
  std::string image((std::istreambuf_iterator<char>(svg)), std::istreambuf_iterator<char>());
  EXPECT_THAT(image, HasSubstr("<polyline"));

  auto status = run("status " + job_id + " --output=json");
  ASSERT_THAT(status, IsOk());
  EXPECT_THAT(status->output, HasSubstr("\"state\": \"JOB_STATE_SUCCEEDED\""));
  // The automatic layout was planned for the worker's CPU slots and recorded with the job.
  auto text_status = run("status " + job_id);
  ASSERT_THAT(text_status, IsOk());
  EXPECT_THAT(text_status->output, HasSubstr("plan: dp=2 tp=1 pp=1"));
  EXPECT_THAT(text_status->output, HasSubstr("on 2 x cpu ("));

  // `plan` with no device named asks the coordinator, which plans for its live cluster.
  auto plan = run("plan " + spec);
  ASSERT_THAT(plan, IsOk());
  EXPECT_EQ(plan->exit.exit_code, 0) << plan->output;
  EXPECT_THAT(plan->output, HasSubstr("Devices: 2 x cpu"));
  EXPECT_THAT(plan->output, HasSubstr("Chosen: dp=2"));

  std::ofstream(dir_.path() + "/bad.yaml") << "name: bad\nmax_stepz: 3\n";
  auto bad = run("submit " + dir_.path() + "/bad.yaml");
  ASSERT_THAT(bad, IsOk());
  EXPECT_EQ(bad->exit.exit_code, 1);
  EXPECT_THAT(bad->output, HasSubstr("max_stepz"));

  auto missing = run("status job-ffffffff");
  ASSERT_THAT(missing, IsOk());
  EXPECT_EQ(missing->exit.exit_code, 1);
  EXPECT_THAT(missing->output, HasSubstr("not found"));
}

TEST_F(ClusterTest, CancelStopsTheTrainers) {
  const std::string job_id = Submit(Spec(100000));
  ASSERT_FALSE(job_id.empty());
  v1::Job job = WaitFor(job_id, v1::JOB_STATE_RUNNING, 60);
  ASSERT_EQ(job.state(), v1::JOB_STATE_RUNNING) << job.reason();

  v1::CancelJobRequest cancel;
  cancel.set_job_id(job_id);
  v1::CancelJobResponse cancelled;
  ASSERT_TRUE(stub_->CancelJob(Context().get(), cancel, &cancelled).ok());
  // The worker gets the stop order with its next heartbeat and the trainers
  // go; the slots are free again.
  bool freed = false;
  for (int i = 0; i < 200 && !freed; ++i) {
    v1::ListNodesResponse nodes;
    ASSERT_TRUE(stub_->ListNodes(Context().get(), {}, &nodes).ok());
    freed = nodes.nodes(0).free_cpu_slots() == 2 && nodes.nodes(0).job_ids().empty();
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(freed);
  auto pgrep = RunCommand({"/bin/sh", "-c", "pgrep -f '[t]ask=" + dir_.path() + "' || true"});
  ASSERT_THAT(pgrep, IsOk());
  bool gone = pgrep->output.empty();
  for (int i = 0; i < 100 && !gone; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    pgrep = RunCommand({"/bin/sh", "-c", "pgrep -f '[t]ask=" + dir_.path() + "' || true"});
    gone = pgrep.ok() && pgrep->output.empty();
  }
  // ("[t]ask" keeps pgrep from matching the shell that runs it.)
  EXPECT_TRUE(gone) << "trainer processes left: " << pgrep->output;
}

}  // namespace
}  // namespace tessera

namespace tessera {
namespace {

// `tessera local` as its output tells a new user: it prepares the bundled corpus, prints the
// exports, and the example it names runs as printed, watched on an 80-column terminal.
TEST(LocalTest, TesseraLocalRunsAJobAndStopsCleanly) {
  ScopedTempDir dir("tessera_local");
  auto local = Subprocess::Start({BinDir() + "/tessera", "local", "--workers=2", "--cpu_slots=1",
                                  "--dir=" + dir.path() + "/cluster"},
                                 {.merge_stdout = true, .extra_env = {}});
  ASSERT_THAT(local, IsOk());
  auto line = local->WaitForStderrLine("then, e.g.: tessera submit examples/tiny-gpt.yaml --watch",
                                       absl::Seconds(90));
  ASSERT_THAT(line, IsOk()) << local->stderr_text();
  std::vector<std::string> exports;
  for (absl::string_view printed : absl::StrSplit(local->stderr_text(), '\n')) {
    if (absl::ConsumePrefix(&printed, "export ")) exports.emplace_back(printed);
  }
  ASSERT_EQ(exports.size(), 2u) << local->stderr_text();
  ASSERT_TRUE(absl::StartsWith(exports[0], "TESSERA_COORDINATOR=")) << exports[0];
  ASSERT_EQ(exports[1], "TESSERA_DATA_DIR=" + dir.path() + "/cluster/data");
  const std::string address = exports[0].substr(exports[0].find('=') + 1);
  EXPECT_THAT(local->stderr_text(), HasSubstr("worker-1"));

  // As printed, from the repository root, under a pseudo-terminal 80 columns wide.
  auto watched = testing::RunInPty(
      {"/bin/sh", "-c",
       "cd " + std::string(TESSERA_SOURCE_DIR) + " && " + BinDir() +
           "/tessera submit examples/tiny-gpt.yaml --watch"},
      exports, /*columns=*/80, /*rows=*/24, absl::Minutes(4));
  ASSERT_THAT(watched, IsOk());
  ASSERT_EQ(watched->exit.exit_code, 0) << watched->output;
  EXPECT_THAT(watched->output, HasSubstr("[SUCCEEDED]"));
  const std::string job_id = watched->output.substr(0, watched->output.find_first_of("\r\n"));
  // The live line is redrawn in place and never wider than the terminal: a wrapped line would
  // leave half lines behind on every redraw.
  int live_lines = 0;
  for (const std::string& piece : testing::TerminalPieces(watched->output)) {
    if (!absl::StrContains(piece, " step ")) continue;  // plain lines (paths) may wrap
    ++live_lines;
    EXPECT_LE(client::DisplayWidth(piece), 80) << piece;
  }
  EXPECT_GE(live_lines, 10);
  EXPECT_THAT(watched->output, HasSubstr("step 200/200"));

  auto tessera = [&](const std::string& args) {
    return RunCommand(
        {"/bin/sh", "-c", BinDir() + "/tessera --coordinator=" + address + " " + args},
        absl::Minutes(4));
  };
  // The curve has every step, and the loss fell.
  auto csv = tessera("metrics " + job_id);
  ASSERT_THAT(csv, IsOk());
  std::vector<std::string> rows = absl::StrSplit(csv->output, '\n', absl::SkipEmpty());
  ASSERT_EQ(rows.size(), 201u);  // header + 200 steps
  auto loss_of = [](const std::string& row) {
    std::vector<std::string> cells = absl::StrSplit(row, ',');
    EXPECT_GE(cells.size(), 2u) << row;
    return cells.size() >= 2 ? std::stod(cells[1]) : 0.0;
  };
  EXPECT_LT(loss_of(rows[200]), loss_of(rows[1]) - 0.5);
  auto checkpoints = tessera("checkpoints " + job_id);
  ASSERT_THAT(checkpoints, IsOk());
  EXPECT_THAT(checkpoints->output, HasSubstr("step 200"));

  // Both kinds of daemon serve their series: nodes on the coordinator,
  // training on the worker that ran rank 0.
  std::vector<int> ports;
  std::smatch match;
  std::string text = local->stderr_text();
  std::regex metrics_url(R"(127\.0\.0\.1:(\d+)/metrics)");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), metrics_url);
       it != std::sregex_iterator(); ++it) {
    ports.push_back(std::stoi((*it)[1]));
  }
  ASSERT_EQ(ports.size(), 3u);  // coordinator, worker-0, worker-1
  auto coordinator_page = testing::HttpGet(ports[0], "/metrics");
  ASSERT_THAT(coordinator_page, IsOk());
  EXPECT_THAT(coordinator_page->body, HasSubstr("tessera_nodes{state=\"ready\"} 2"));
  bool training_series = false;
  for (int i = 1; i < 3; ++i) {
    auto page = testing::HttpGet(ports[i], "/metrics");
    ASSERT_THAT(page, IsOk());
    training_series |= absl::StrContains(page->body, "tessera_train_loss{job_id=\"" + job_id);
  }
  EXPECT_TRUE(training_series);

  // A second job, cancelled mid-run, leaves no trainer behind.
  std::ofstream(dir.path() + "/long.yaml")
      << "name: long-job\nmodel: {preset: tiny-gpt2}\n"
      << "data: {train_shards: [" << dir.path() << "/cluster/data/train-*.bin], seq_len: 64}\n"
      << "batch: {global_batch_size: 8, micro_batch_size: 2}\n"
      << "optimizer: {schedule: {peak_learning_rate: 3e-3}}\nmax_steps: 100000\n"
      << "resources: {cpu_slots: 2}\n";
  auto second = tessera("submit " + dir.path() + "/long.yaml");
  ASSERT_THAT(second, IsOk());
  const std::string second_id = second->output.substr(0, second->output.find('\n'));
  bool running = false;
  for (int i = 0; i < 300 && !running; ++i) {
    auto status = tessera("status " + second_id);
    running = status.ok() && absl::StrContains(status->output, "RUNNING") &&
              !absl::StrContains(status->output, "step 0/");
    if (!running) absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_TRUE(running);
  auto cancelled = tessera("cancel " + second_id);
  ASSERT_THAT(cancelled, IsOk());
  EXPECT_THAT(cancelled->output, HasSubstr("CANCELLED"));
  bool gone = false;
  for (int i = 0; i < 200 && !gone; ++i) {
    auto left = RunCommand({"/bin/sh", "-c", "pgrep -f '[t]ask=" + dir.path() + "' || true"});
    gone = left.ok() && left->output.empty();
    if (!gone) absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(gone) << "trainers of the cancelled job are still running";

  auto exit = local->Stop(SIGINT);
  ASSERT_THAT(exit, IsOk());
  EXPECT_EQ(exit->exit_code, 0) << local->stderr_text();
  // Nothing it started is left running.
  auto left = RunCommand({"/bin/sh", "-c", "pgrep -f '[t]essera-.*" + dir.path() + "' || true"});
  ASSERT_THAT(left, IsOk());
  EXPECT_EQ(left->output, "");
}

}  // namespace
}  // namespace tessera

namespace tessera {
namespace {

class ThreeWorkerClusterTest : public ClusterTest {
 protected:
  void SetUp() override {
    third_worker_ = true;
    ClusterTest::SetUp();
  }

  v1::Node NodeNamed(const std::string& node_id) {
    v1::ListNodesRequest request;
    request.set_include_lost(true);
    v1::ListNodesResponse response;
    EXPECT_TRUE(stub_->ListNodes(Context().get(), request, &response).ok());
    for (const auto& node : response.nodes()) {
      if (node.node_id() == node_id) return node;
    }
    return v1::Node();
  }
};

// The rolling upgrade of docs/operations.md with the real binaries: a node of a running 2-node
// job is drained with --checkpoint; the job saves a checkpoint, stops and goes on on the other
// two nodes; the drained worker is restarted (the upgrade) and comes back still drained, then is
// undrained. The job, which may not restart at all (max_restarts 0), succeeds with no restart
// counted and the losses of an uninterrupted run.
TEST_F(ThreeWorkerClusterTest, ADrainedNodesJobCheckpointsMovesAndLosesNoStep) {
  constexpr int kSteps = 60;
  v1::JobSpec spec = Spec(kSteps);
  spec.set_max_restarts(0);
  const std::string job_id = Submit(spec);
  ASSERT_TRUE(WaitForStep(job_id, 5, 120)) << Get(job_id).ShortDebugString();
  v1::Job job = Get(job_id);
  ASSERT_EQ(job.placements_size(), 2);
  const std::string drained = job.placements(1).node_id();
  const int drained_index = drained == "e2e-node" ? 0 : drained == "e2e-node-2" ? 1 : 2;

  // Not an admin action a READY node allows.
  v1::RemoveNodeRequest remove;
  remove.set_node_id(drained);
  v1::RemoveNodeResponse removed;
  EXPECT_EQ(stub_->RemoveNode(Context().get(), remove, &removed).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);

  v1::DrainNodeRequest drain;
  drain.set_node_id(drained);
  drain.set_checkpoint(true);
  drain.set_reason("worker upgrade");
  v1::DrainNodeResponse drain_response;
  grpc::Status status = stub_->DrainNode(Context().get(), drain, &drain_response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(drain_response.node().state(), v1::NODE_STATE_DRAINING);
  ASSERT_EQ(drain_response.moving_job_ids_size(), 1);
  EXPECT_EQ(drain_response.moving_job_ids(0), job_id);

  // The job moves: attempt 1 runs on the two other nodes.
  absl::Time deadline = absl::Now() + absl::Seconds(120);
  while (absl::Now() < deadline) {
    job = Get(job_id);
    if (job.attempt() == 1 && job.state() == v1::JOB_STATE_RUNNING) break;
    ASSERT_NE(job.state(), v1::JOB_STATE_FAILED) << job.reason();
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_EQ(job.attempt(), 1) << job.ShortDebugString();
  for (const auto& rank : job.placements()) EXPECT_NE(rank.node_id(), drained);
  EXPECT_TRUE(TrainerPids(dir_.path() + "/" + drained + "/").empty());

  // The upgrade: the drained node's worker stops and starts again (a new binary would), and
  // registers again still drained.
  std::optional<Subprocess>& worker =
      drained_index == 0 ? worker_ : drained_index == 1 ? worker2_ : worker3_;
  ASSERT_THAT(worker->Stop(SIGTERM), IsOk());
  worker.reset();
  StartWorker(drained_index, 3);
  ASSERT_FALSE(HasFatalFailure());
  deadline = absl::Now() + absl::Seconds(30);
  while (NodeNamed(drained).state() != v1::NODE_STATE_DRAINING && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  v1::Node node = NodeNamed(drained);
  EXPECT_EQ(node.state(), v1::NODE_STATE_DRAINING);
  EXPECT_TRUE(node.drained());
  EXPECT_EQ(node.drain_reason(), "worker upgrade");
  v1::UndrainNodeRequest undrain;
  undrain.set_node_id(drained);
  v1::UndrainNodeResponse undrain_response;
  ASSERT_TRUE(stub_->UndrainNode(Context().get(), undrain, &undrain_response).ok());
  EXPECT_EQ(undrain_response.node().state(), v1::NODE_STATE_READY);

  job = WaitFor(job_id, v1::JOB_STATE_SUCCEEDED, 240);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
  EXPECT_EQ(job.restarts(), 0);
  ASSERT_EQ(job.attempts_size(), 2);
  EXPECT_THAT(job.attempts(0).reason(), HasSubstr("node " + drained + " drained"));
  EXPECT_FALSE(job.attempts(0).has_failure());
  EXPECT_GE(job.attempts(1).start_step(), 5) << "resumed from the checkpoint saved for the move";
  // That checkpoint is of the last step trained before the move: no step is trained twice.
  EXPECT_EQ(job.attempts(1).start_step(), job.attempts(0).end_step());
  std::cout << "moved off " << drained << " after step " << job.attempts(0).end_step() << "\n";
  std::vector<v1::StepMetrics> curve = Curve(job_id);
  ASSERT_EQ(curve.size(), static_cast<size_t>(kSteps));

  for (int i = 0; i < kSteps; ++i) EXPECT_EQ(curve[i].step(), i + 1);
  ExpectTheLossesOfAnUninterruptedRun(spec, curve);
}

}  // namespace
}  // namespace tessera

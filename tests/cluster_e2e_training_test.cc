// The whole system trains, end to end on loopback: a 2-rank data-parallel job through the
// coordinator and a worker (loss curve, checkpoints, logs, the worker's metrics), the LoRA example
// on an imported model, one rank on each of two nodes, the CLI (submit --watch, metrics, plot,
// status, plan) and `tessera local` as a new user runs it.

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/job_spec_file.h"
#include "client/progress_line.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/v1/trainer.pb.h"
#include "tests/cluster_e2e_fixture.h"
#include "tests/util/pty.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Another process on the machine (another cluster's trainer, a test beside this one) holds the
// port the coordinator would give the job's rendezvous. The job's ranks all run on one node,
// whose worker chooses a free port there and hands rank 0 the socket: the job trains on its
// first attempt, no restart, and its ranks' task files name the port they met on.
TEST_F(ClusterTest, APortHeldByAnotherProcessDoesNotStopASingleNodeJob) {
  const int base = MasterPortBase();
  const int held = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(held, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(base));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(held, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0)
      << "port " << base << ": " << std::strerror(errno);
  ASSERT_EQ(listen(held, 16), 0);

  const std::string job_id = Submit(Spec(5));
  ASSERT_FALSE(job_id.empty());
  const v1::Job job = WaitFor(job_id, v1::JOB_STATE_SUCCEEDED, 120);
  close(held);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
  EXPECT_EQ(job.restarts(), 0) << job.ShortDebugString();
  EXPECT_EQ(job.master_port(), base) << "the coordinator's choice, taken by another process";
  int port = -1;
  for (int rank = 0; rank < 2; ++rank) {
    v1::TrainerTask task;
    std::ifstream in(RankTask("e2e-node", job_id, 0, rank), std::ios::binary);
    ASSERT_TRUE(task.ParseFromIstream(&in)) << "rank " << rank;
    EXPECT_NE(task.assignment().master_port(), base) << "rank " << rank;
    EXPECT_EQ(task.assignment().master_listen_fd(), rank == 0 ? 3 : 0) << "rank " << rank;
    if (rank == 0) port = task.assignment().master_port();
    EXPECT_EQ(task.assignment().master_port(), port) << "rank " << rank;
  }
  EXPECT_GT(port, 0);
}

TEST_F(ClusterTest, TwoRankJobTrainsThroughCoordinatorAndWorker) {
  // Ten saves, of which retention keeps two: the coordinator lists what the directory holds.
  v1::JobSpec spec = Spec(30);
  spec.mutable_checkpoint()->set_interval_steps(3);
  spec.mutable_checkpoint()->set_keep_last(2);
  const std::string job_id = Submit(spec);
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
  ASSERT_EQ(checkpoints.checkpoints_size(), 2);  // steps 30 and 27 of 3, 6, ..., 30
  EXPECT_EQ(checkpoints.checkpoints(0).step(), 30);
  EXPECT_EQ(checkpoints.checkpoints(1).step(), 27);
  EXPECT_EQ(checkpoints.checkpoints(0).num_shards(), 2);
  EXPECT_EQ(checkpoints.checkpoints(0).retired_steps_size(), 0);
  std::set<std::string> listed, on_disk;
  for (const v1::Checkpoint& checkpoint : checkpoints.checkpoints()) {
    listed.insert(checkpoint.path());
  }
  for (const auto& entry : std::filesystem::directory_iterator(dir_.path() + "/ckpt/" + job_id)) {
    if (std::filesystem::exists(entry.path() / "manifest.pb")) on_disk.insert(entry.path());
  }
  EXPECT_EQ(listed, on_disk);

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
  // The job's totals are counters (rate() works), the last report is timestamped, and
  // the worker serves its own process metrics.
  const std::string rank0 = absl::StrCat("{job_id=\"", job_id, "\",rank=\"0\"}");
  EXPECT_THAT(metrics_page->body, HasSubstr("# TYPE tessera_train_steps_total counter\n"));
  EXPECT_THAT(metrics_page->body, HasSubstr("tessera_train_steps_total" + rank0 + " 30\n"));
  EXPECT_THAT(metrics_page->body, HasSubstr("tessera_train_max_steps" + rank0 + " 30\n"));
  EXPECT_THAT(metrics_page->body, HasSubstr("tessera_train_tokens_total" + rank0 + " "));
  EXPECT_THAT(metrics_page->body,
              HasSubstr("tessera_train_last_report_timestamp_seconds" + rank0 + " "));
  EXPECT_THAT(metrics_page->body, HasSubstr("# TYPE process_cpu_seconds_total counter\n"));
  EXPECT_THAT(metrics_page->body, HasSubstr("process_resident_memory_bytes "));
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
  auto exported = RunCommand({trainer, "--set=model.preset=tiny-llama", "--export_hf=" + base});
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
  // Where the time goes: shown when the trainer's metrics carry a breakdown, and
  // nothing extra when they do not (a trainer from before it).
  if (absl::StrContains(status->output, "\"breakdown\"")) {
    EXPECT_THAT(text_status->output, HasSubstr("Where the time goes (rank 0, step 25,"));
    EXPECT_THAT(submitted->output, HasSubstr("\n    time: fwd "));
  } else {
    EXPECT_THAT(text_status->output, Not(HasSubstr("Where the time goes")));
    EXPECT_THAT(submitted->output, Not(HasSubstr("time: fwd")));
  }
  // A CPU job holds no GPU: no GPU table.
  EXPECT_THAT(text_status->output, Not(HasSubstr("gpus:")));

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
      // 200 steps take about a minute on a quiet 2-core machine; the budget is for a loaded one
      // (the ctest timeout is 10 minutes).
      exports, /*columns=*/80, /*rows=*/24, absl::Minutes(7));
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
  // The finished job has no per-job series left on the coordinator.
  EXPECT_THAT(coordinator_page->body,
              Not(HasSubstr("tessera_job_running{job_id=\"" + job_id + "\"}")));
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
  const bool running = testing::WaitUntil(
      [&] {
        auto status = tessera("status " + second_id);
        return status.ok() && absl::StrContains(status->output, "RUNNING") &&
               !absl::StrContains(status->output, "step 0/");
      },
      absl::Seconds(60), absl::Milliseconds(100));
  ASSERT_TRUE(running);
  // While it runs, the coordinator exports it as running with its newest step's time;
  // cancelling removes both at once.
  auto running_page = testing::HttpGet(ports[0], "/metrics");
  ASSERT_THAT(running_page, IsOk());
  EXPECT_THAT(running_page->body, HasSubstr("tessera_job_running{job_id=\"" + second_id + "\"} 1"));
  EXPECT_THAT(running_page->body,
              HasSubstr("tessera_job_last_step_timestamp_seconds{job_id=\"" + second_id + "\"} "));
  auto cancelled = tessera("cancel " + second_id);
  ASSERT_THAT(cancelled, IsOk());
  EXPECT_THAT(cancelled->output, HasSubstr("CANCELLED"));
  auto cancelled_page = testing::HttpGet(ports[0], "/metrics");
  ASSERT_THAT(cancelled_page, IsOk());
  EXPECT_THAT(cancelled_page->body,
              Not(HasSubstr("tessera_job_running{job_id=\"" + second_id + "\"}")));
  EXPECT_THAT(cancelled_page->body,
              Not(HasSubstr("tessera_job_last_step_timestamp_seconds{job_id=\"" + second_id)));
  const bool gone = testing::WaitUntil(
      [&] {
        auto left = RunCommand({"/bin/sh", "-c", "pgrep -f '[t]ask=" + dir.path() + "' || true"});
        return left.ok() && left->output.empty();
      },
      absl::Seconds(30), absl::Milliseconds(100));
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

// tessera: the command-line client of a Tessera coordinator.
#include <signal.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "client/client_config.h"
#include "client/coordinator_client.h"
#include "client/job_spec_file.h"
#include "client/job_view.h"
#include "client/local_cluster.h"
#include "client/plan_command.h"
#include "client/plot.h"
#include "client/progress_line.h"
#include "client/queues_command.h"
#include "client/text_format.h"
#include "client/topology_command.h"
#include "common/command_line.h"
#include "common/daemon/failure_text.h"
#include "common/version.h"
#include "google/protobuf/util/json_util.h"

ABSL_FLAG(std::string, coordinator, "",
          "Coordinator gRPC address (host:port), or several, comma-separated (HA: calls go to the "
          "leader; watch resumes across a failover); empty: $TESSERA_COORDINATOR, else "
          "127.0.0.1:50051.");
ABSL_FLAG(std::string, config, "",
          "Config file (YAML: coordinator, token, tls_ca, tls_cert, tls_key); empty: "
          "$TESSERA_CONFIG, else ~/.config/tessera/config.yaml when it exists.");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA that signed the coordinator's certificate: connect with TLS.");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate (its CN is your user name).");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(10), "Deadline of each call, e.g. 10s.");
ABSL_FLAG(bool, watch, false, "submit: follow the job until it ends (exit 0 on SUCCEEDED).");
ABSL_FLAG(std::vector<std::string>, state, {},
          "list: only jobs in these states, e.g. running,pending.");
ABSL_FLAG(int, rank, -1, "logs: only this rank; -1 for every rank.");
ABSL_FLAG(bool, follow, false, "logs: keep streaming new output until the job ends.");
ABSL_FLAG(int, tail, 0, "logs: start with the last N lines per rank; 0 from the start.");
ABSL_FLAG(int, max_points, 0, "metrics: downsample the curve to at most N points; 0 all.");
ABSL_FLAG(std::string, reason, "", "cancel, nodes drain: why, recorded in the job or node.");
ABSL_FLAG(bool, topology, false,
          "nodes: the topology tree (--topology_levels of the coordinator) with free devices per "
          "domain and each level's fragmentation.");
ABSL_FLAG(bool, checkpoint, false,
          "nodes drain: the node's jobs save a checkpoint, stop and are placed on other nodes "
          "(no failure or restart counted); without it they run on until they end.");
ABSL_FLAG(std::string, output, "text",
          "text or json (protobuf JSON) for get, list, nodes, queues, plan.");
ABSL_FLAG(std::string, format, "csv", "metrics: csv or json.");
ABSL_FLAG(std::string, o, "", "plot: output SVG file (default <job>.svg).");
ABSL_FLAG(int, workers, 1, "local: workers to start.");
ABSL_FLAG(int, cpu_slots, 2, "local: CPU trainer slots per worker.");
ABSL_FLAG(std::string, dir, "",
          "local: directory for state, logs and work (default a new one in /tmp).");
ABSL_FLAG(std::string, corpus, "",
          "local: a text file to tokenize into DIR/data for the examples (default the bundled "
          "corpus, share/tessera/corpus beside the binaries).");

namespace {

// Environment variable with the coordinator address, used when --coordinator
// is not given.
constexpr char kCoordinatorEnv[] = "TESSERA_COORDINATOR";
// Bearer token presented to the coordinator (or `token:` in the config file).
constexpr char kTokenEnv[] = "TESSERA_TOKEN";

constexpr char kUsage[] =
    "Usage: tessera [--coordinator=HOST:PORT[,HOST:PORT...]] COMMAND [ARGS]\n\n"
    "The Tessera command-line client.\n\n"
    "Commands:\n"
    "  submit SPEC.yaml [--watch]   submit a job (YAML or JSON JobSpec); print its id\n"
    "  watch JOB                    follow a job: states, live loss and throughput; exit 0 on "
    "SUCCEEDED\n"
    "  get JOB | status JOB         one job\n"
    "  list [--state=...]           jobs, newest first\n"
    "  cancel JOB [--reason=...]    cancel a job\n"
    "  logs JOB [--rank=N] [--follow] [--tail=N]   trainer logs, relayed from the workers\n"
    "  metrics JOB [--format=csv|json] [--max_points=N]   the whole loss curve\n"
    "  plot JOB [-o FILE.svg]       loss and throughput curves as an SVG image\n"
    "  checkpoints JOB              retained checkpoints\n"
    "  nodes                        registered nodes and their free capacity\n"
    "  nodes drain NODE [--checkpoint] [--reason=...]   no new work on NODE (admin); with\n"
    "                               --checkpoint its jobs checkpoint and move to other nodes\n"
    "  nodes undrain NODE           NODE takes work again (admin)\n"
    "  nodes remove NODE            forget a LOST or drained, idle node (admin)\n"
    "  queues                       queues: quota, use, borrowing, waiting and placed jobs,\n"
    "                               fair share, preemptions\n"
    "  plan [SPEC.yaml] [--model=PRESET --seq_len=S --global_batch=B --micro_batch=M\n"
    "       --precision=bf16 --gpus=N --gpus_per_node=G --device=h100-sxm --gpu_memory=80GiB\n"
    "       --layout=tp=4,pp=2,zero=1,sp=on,ac=selective --lora_rank=R]\n"
    "                               memory, step time and rank of every layout; offline when\n"
    "                               a device is named, else for the coordinator's cluster\n"
    "  local [--workers=N] [--cpu_slots=N] [--dir=DIR] [--corpus=FILE]\n"
    "                               run a coordinator and workers on this machine until\n"
    "                               Ctrl-C, with the bundled corpus prepared for the examples\n"
    "  health                       whether the coordinator serves\n"
    "  version                      this build's version\n\n"
    "Connection: --coordinator, --tls_ca, --tls_cert, --tls_key, the token in $TESSERA_TOKEN;\n"
    "or coordinator, token, tls_ca, tls_cert, tls_key in --config (default\n"
    "~/.config/tessera/config.yaml, mode 600 when it holds a token). docs/security.md.\n\n"
    "Exit codes: 0 success (watch: the job SUCCEEDED), 1 the call or the job failed,\n"
    "2 bad usage.\n";

using tessera::client::CoordinatorClient;
using tessera::client::FormatRate;
namespace v1 = tessera::v1;
using tessera::DescribeFailure;

int Fail(const absl::Status& status) {
  // Who-may-do-what refusals say so; other messages already say what is wrong.
  std::string kind;
  switch (status.code()) {
    case absl::StatusCode::kUnauthenticated:
      kind = "unauthenticated: ";
      break;
    case absl::StatusCode::kPermissionDenied:
      kind = "permission denied: ";
      break;
    case absl::StatusCode::kResourceExhausted:
      kind = "limit reached: ";
      break;
    default:
      break;
  }
  std::cerr << "tessera: " << kind << status.message() << "\n";
  return 1;
}

std::string Json(const google::protobuf::Message& message) {
  std::string out;
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.preserve_proto_field_names = true;
  // Printing a message we hold fails only on a protobuf bug: say so on stderr.
  if (const auto status = google::protobuf::util::MessageToJsonString(message, &out, options);
      !status.ok()) {
    std::cerr << "tessera: cannot print " << message.GetTypeName() << " as JSON: " << status
              << "\n";
    return "{}";
  }
  return out;
}

std::string StateName(v1::JobState state) {
  std::string name = v1::JobState_Name(state);
  return name.substr(std::string("JOB_STATE_").size());
}

// The job's last step: the spec's max_steps, or (for a job that trains for `epochs`) what its
// trainer reported once it opened the data; 0 until then.
int64_t TotalSteps(const v1::Job& job) {
  return job.spec().max_steps() > 0 ? job.spec().max_steps() : job.latest_metrics().max_steps();
}

void PrintJob(const v1::Job& job) {
  std::cout << absl::StrFormat("%-14s %-10s %-10s %-20s step %lld/%lld", job.job_id(),
                               StateName(job.state()), job.owner(), job.spec().name(),
                               job.current_step(), TotalSteps(job));
  if (job.has_latest_metrics()) {
    std::cout << absl::StrFormat("  loss %.4f", job.latest_metrics().loss());
  }
  if (!job.reason().empty()) std::cout << "  (" << job.reason() << ")";
  std::cout << "\n";
}

// `get`: the queue, restarts, why each ended attempt ended, and the slowest rank when one holds
// the job back.
void PrintAttempts(const v1::Job& job) {
  if (!job.queue().empty()) std::cout << "  queue: " << job.queue() << "\n";
  if (job.restarts() > 0 || job.spec().max_restarts() > 0) {
    std::cout << absl::StrFormat("  restarts: %d of %d\n", job.restarts(),
                                 job.spec().max_restarts());
  }
  for (const auto& attempt : job.attempts()) {
    std::cout << absl::StrFormat("  attempt %d on %s (%d ranks), steps %lld-%lld: %s\n",
                                 attempt.attempt(), absl::StrJoin(attempt.node_ids(), ","),
                                 attempt.world_size(), attempt.start_step(), attempt.end_step(),
                                 attempt.reason());
    for (const auto& consequence : attempt.consequences()) {
      std::cout << "    then " << DescribeFailure(consequence) << "\n";
    }
  }
  const v1::StragglerReport& straggler = job.straggler();
  if (straggler.straggling()) {
    std::cout << absl::StrFormat(
        "  straggler: rank %d on %s computes %.3f s per step, %.2fx the median rank's %.3f s\n",
        straggler.slowest_rank(), straggler.slowest_node_id(),
        straggler.skew() * straggler.median_busy_seconds(), straggler.skew(),
        straggler.median_busy_seconds());
  }
}

// Columns of the terminal on stdout (it may be resized while watching); 80 when unknown.
int TerminalColumns() {
  winsize size{};
  if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &size) == 0 && size.ws_col > 0) return size.ws_col;
  return 80;
}

// Prints a job's events; returns main()'s exit code once it ends.
int Watch(CoordinatorClient& client, const std::string& job_id) {
  auto job = client.Get(job_id);
  if (!job.ok()) return Fail(job.status());
  const int64_t max_steps = TotalSteps(*job);
  v1::JobState last = v1::JOB_STATE_UNSPECIFIED;
  const bool tty = isatty(STDOUT_FILENO) != 0;
  bool progress_shown = false;
  tessera::client::ProgressLine progress(max_steps);
  auto status = client.Watch(job_id, 0, [&](const v1::JobEvent& event) {
    // Anything but a step ends the live progress line first.
    if (progress_shown && !event.has_metrics()) {
      std::cout << "\n";
      progress_shown = false;
    }
    if (event.has_state_change()) {
      last = event.state_change().new_state();
      std::cout << absl::StrFormat("[%s] %s", StateName(last), event.state_change().reason())
                << std::endl;
    } else if (event.has_metrics()) {
      progress.Add(event.metrics());
      // Empty for a trainer that sends no breakdown: its lines stay as they were.
      const std::string breakdown = tessera::client::BreakdownSummary(event.metrics());
      if (tty) {
        // One live line on a terminal, redrawn in place: narrower than the terminal (after the
        // two-space indent, and short of the last column, where some terminals wrap), or each
        // redraw would leave a wrapped half line behind. The breakdown joins it where it fits.
        const int columns = TerminalColumns() - 3;
        std::string line = progress.Render(columns);
        if (!breakdown.empty() &&
            tessera::client::DisplayWidth(line) + 2 + tessera::client::DisplayWidth(breakdown) <=
                columns) {
          line += "  " + breakdown;
        }
        std::cout << "\r  " << line << "\033[K" << std::flush;
        progress_shown = true;
      } else {
        // A log, one line per step: no chart.
        std::cout << "  " << progress.Render(1 << 20, /*chart=*/false) << std::endl;
        if (!breakdown.empty()) std::cout << "    time: " << breakdown << std::endl;
      }
      return true;
    } else if (event.has_checkpoint()) {
      std::cout << "  checkpoint " << event.checkpoint().path() << std::endl;
    } else if (event.has_eval()) {
      std::cout << absl::StrFormat("  eval at step %lld: loss %.4f  perplexity %.2f",
                                   event.eval().step(), event.eval().loss(),
                                   event.eval().perplexity())
                << std::endl;
    } else if (event.has_failure()) {
      std::cout << "  failure: " << DescribeFailure(event.failure()) << std::endl;
    } else if (event.has_rollback()) {
      std::cout << "  " << tessera::client::RollbackLine(event.rollback()) << std::endl;
    }
    return true;
  });
  if (!status.ok()) return Fail(status);
  return last == v1::JOB_STATE_SUCCEEDED ? 0 : 1;
}

// `tessera local`: a coordinator and workers on 127.0.0.1 until SIGINT/SIGTERM.
int Local() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  std::error_code error;
  auto self = std::filesystem::read_symlink("/proc/self/exe", error);
  std::string dir = absl::GetFlag(FLAGS_dir);
  if (dir.empty()) {
    char pattern[] = "/tmp/tessera-local.XXXXXX";
    dir = mkdtemp(pattern);
  }
  const std::string bin_dir = self.parent_path().string();
  std::string corpus = absl::GetFlag(FLAGS_corpus);
  if (corpus.empty()) corpus = tessera::client::BundledCorpus(bin_dir);
  if (!corpus.empty()) std::cout << "preparing " << corpus << " into " << dir << "/data" << std::endl;
  auto cluster = tessera::client::LocalCluster::Start({.bin_dir = bin_dir,
                                                       .dir = dir,
                                                       .workers = absl::GetFlag(FLAGS_workers),
                                                       .cpu_slots = absl::GetFlag(FLAGS_cpu_slots),
                                                       .corpus = corpus});
  if (!cluster.ok()) return Fail(cluster.status());
  for (const auto& daemon : (*cluster)->daemons()) {
    std::cout << absl::StrFormat("%-12s gRPC %s  metrics http://127.0.0.1:%d/metrics  log %s\n",
                                 daemon.name, daemon.address, daemon.metrics_port, daemon.log_path);
  }
  std::cout << "\nexport TESSERA_COORDINATOR=" << (*cluster)->coordinator().address << "\n";
  if (!(*cluster)->data_dir().empty()) {
    std::cout << "export TESSERA_DATA_DIR=" << (*cluster)->data_dir() << "\n"
              << "then, e.g.: tessera submit examples/tiny-gpt.yaml --watch\n";
  } else {
    std::cout << "(no corpus prepared: pass --corpus=FILE.txt to tokenize one)\n";
  }
  std::cout << "Ctrl-C stops everything (state stays in " << dir << ")." << std::endl;
  int signal_number = 0;
  sigwait(&signals, &signal_number);
  std::cout << "\nstopping..." << std::endl;
  cluster->reset();
  return 0;
}

// What a command is given: its words (args[1] is the command, args[2] its first argument),
// the client for the coordinator and the output format.
struct Invocation {
  const std::vector<char*>& args;
  const std::string& command;
  const std::string& arg;
  CoordinatorClient& client;
  bool json;
};

int Health(const Invocation& in) {
  auto serving = in.client.CheckHealth("tessera.v1.Coordinator");
  if (!serving.ok()) return Fail(serving.status());
  std::cout << in.client.options().address << ": "
            << grpc::health::v1::HealthCheckResponse::ServingStatus_Name(*serving) << "\n";
  return *serving == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
}

int Plan(const Invocation& in) { return tessera::client::RunPlan(in.arg, in.client, in.json); }

int Submit(const Invocation& in) {
  auto spec = tessera::client::LoadJobSpec(in.arg, tessera::client::ProcessEnvironment());
  if (!spec.ok()) return Fail(spec.status());
  auto job = in.client.Submit(*spec);
  if (!job.ok()) return Fail(job.status());
  std::cout << job->job_id() << "\n";
  return absl::GetFlag(FLAGS_watch) ? Watch(in.client, job->job_id()) : 0;
}

int WatchJob(const Invocation& in) { return Watch(in.client, in.arg); }

int Get(const Invocation& in) {
  auto job = in.client.Get(in.arg);
  if (!job.ok()) return Fail(job.status());
  // A job placed by an older coordinator records no GPU UUIDs: the nodes' inventories have
  // them; without those the indices still show.
  std::vector<v1::Node> nodes;
  if (tessera::client::HoldsGpus(*job)) {
    auto listed = in.client.Nodes(/*include_lost=*/true);
    if (listed.ok()) {
      nodes = *std::move(listed);
    } else {
      std::cerr << "tessera: cannot list nodes for the GPUs' UUIDs: " << listed.status().message()
                << "\n";
    }
  }
  *job = tessera::client::WithGpuIdentity(*std::move(job), nodes);
  if (in.json) {
    // The job as protobuf JSON, nothing added: a strict v1.Job parser reads it.
    std::cout << Json(*job);
    return 0;
  }
  PrintJob(*job);
  if (!job->plan().explanation().empty()) {
    std::cout << "  plan: " << job->plan().explanation() << "\n";
  }
  PrintAttempts(*job);
  std::cout << tessera::client::RollbackBlock(*job);
  std::cout << tessera::client::ExpertLoadBlock(job->latest_metrics());
  std::cout << tessera::client::TimeBreakdownBlock(job->latest_metrics())
            << tessera::client::RankBreakdownTable(job->straggler());
  std::cout << tessera::client::GpuTable(*job);
  return 0;
}

int List(const Invocation& in) {
  v1::ListJobsRequest request;
  for (const auto& name : absl::GetFlag(FLAGS_state)) {
    v1::JobState state;
    if (!v1::JobState_Parse("JOB_STATE_" + absl::AsciiStrToUpper(name), &state)) {
      std::cerr << "tessera list: unknown state '" << name << "'\n";
      return 2;
    }
    request.add_states(state);
  }
  do {
    auto page = in.client.List(request);
    if (!page.ok()) return Fail(page.status());
    for (const auto& job : page->jobs()) {
      if (in.json) {
        std::cout << Json(job);
      } else {
        PrintJob(job);
      }
    }
    request.set_page_token(page->next_page_token());
  } while (!request.page_token().empty());
  return 0;
}

int Cancel(const Invocation& in) {
  auto job = in.client.Cancel(in.arg, absl::GetFlag(FLAGS_reason));
  if (!job.ok()) return Fail(job.status());
  PrintJob(*job);
  return 0;
}

int Logs(const Invocation& in) {
  v1::GetLogsRequest request;
  request.set_job_id(in.arg);
  request.set_rank(absl::GetFlag(FLAGS_rank));
  request.set_attempt(-1);
  request.set_follow(absl::GetFlag(FLAGS_follow));
  request.set_tail_lines(absl::GetFlag(FLAGS_tail));
  auto status = in.client.Logs(request, [](const v1::LogChunk& chunk) {
    std::cout << chunk.data();
    std::cout.flush();
  });
  return status.ok() ? 0 : Fail(status);
}

int Metrics(const Invocation& in) {
  v1::GetMetricsRequest request;
  request.set_job_id(in.arg);
  request.set_max_points(absl::GetFlag(FLAGS_max_points));
  auto metrics = in.client.Metrics(request);
  if (!metrics.ok()) return Fail(metrics.status());
  const std::string format = absl::GetFlag(FLAGS_format);
  if (format == "json" || in.json) {
    std::cout << Json(*metrics);
    return 0;
  }
  if (format != "csv") {
    std::cerr << "tessera metrics: --format must be csv or json\n";
    return 2;
  }
  std::cout << "step,loss,grad_norm,learning_rate,tokens_per_second,samples_per_second,mfu,"
               "step_time_seconds,peak_memory_bytes,epoch\n";
  for (const auto& m : metrics->points()) {
    std::cout << absl::StrFormat("%d,%.6f,%.6f,%.6e,%.1f,%.2f,%.6f,%.6f,%d,%.4f\n", m.step(),
                                 m.loss(), m.grad_norm(), m.learning_rate(), m.tokens_per_second(),
                                 m.samples_per_second(), m.mfu(), m.step_time_seconds(),
                                 m.peak_memory_bytes(), m.epoch());
  }
  return 0;
}

int Plot(const Invocation& in) {
  v1::GetMetricsRequest request;
  request.set_job_id(in.arg);
  request.set_max_points(absl::GetFlag(FLAGS_max_points) > 0 ? absl::GetFlag(FLAGS_max_points)
                                                             : 2000);
  auto metrics = in.client.Metrics(request);
  if (!metrics.ok()) return Fail(metrics.status());
  auto job = in.client.Get(in.arg);
  if (!job.ok()) return Fail(job.status());
  std::string path = absl::GetFlag(FLAGS_o).empty() ? in.arg + ".svg" : absl::GetFlag(FLAGS_o);
  std::ofstream out(path);
  out << tessera::client::RenderTrainingPlot(
      absl::StrCat(in.arg, " (", job->spec().name(), "): ", StateName(job->state()), ", step ",
                   job->current_step(), "/", TotalSteps(*job)),
      *metrics);
  if (!out.good()) return Fail(absl::UnavailableError(absl::StrCat(path, ": cannot write")));
  std::cout << path << "\n";
  return 0;
}

int Checkpoints(const Invocation& in) {
  auto checkpoints = in.client.Checkpoints(in.arg);
  if (!checkpoints.ok()) return Fail(checkpoints.status());
  for (const auto& c : *checkpoints) {
    std::cout << absl::StrFormat("step %-8lld %8.1f MiB  %d shard(s)  %s\n", c.step(),
                                 c.size_bytes() / 1048576.0, c.num_shards(), c.path());
  }
  return 0;
}

int Queues(const Invocation& in) {
  auto queues = in.client.Queues();
  if (!queues.ok()) return Fail(queues.status());
  std::cout << (in.json ? Json(*queues) : tessera::client::QueuesTable(*queues));
  return 0;
}

// `tessera nodes drain|undrain|remove NODE`.
int ChangeNode(const Invocation& in) {
  const std::string& action = in.arg;
  const std::string node_id = in.args.size() > 3 ? in.args[3] : "";
  if (node_id.empty() || (action != "drain" && action != "undrain" && action != "remove")) {
    std::cerr << "tessera nodes: expected drain NODE, undrain NODE or remove NODE\n\n" << kUsage;
    return 2;
  }
  if (action == "remove") {
    if (auto status = in.client.RemoveNode(node_id); !status.ok()) return Fail(status);
    std::cout << "node " << node_id << " removed\n";
    return 0;
  }
  v1::Node node;
  std::string moving, remaining;
  if (action == "drain") {
    v1::DrainNodeRequest request;
    request.set_node_id(node_id);
    request.set_checkpoint(absl::GetFlag(FLAGS_checkpoint));
    request.set_reason(absl::GetFlag(FLAGS_reason));
    auto drained = in.client.DrainNode(request);
    if (!drained.ok()) return Fail(drained.status());
    if (in.json) {
      std::cout << Json(*drained);
      return 0;
    }
    node = drained->node();
    moving = absl::StrJoin(drained->moving_job_ids(), ", ");
    remaining = absl::StrJoin(drained->remaining_job_ids(), ", ");
  } else {
    auto undrained = in.client.UndrainNode(node_id);
    if (!undrained.ok()) return Fail(undrained.status());
    node = *undrained;
    if (in.json) {
      std::cout << Json(node);
      return 0;
    }
  }
  std::cout << "node " << node_id << ": "
            << v1::NodeState_Name(node.state()).substr(std::string("NODE_STATE_").size()) << "\n";
  if (!moving.empty()) std::cout << "  checkpointing and moving: " << moving << "\n";
  if (!remaining.empty()) std::cout << "  left to finish here: " << remaining << "\n";
  return 0;
}

// `tessera nodes` lists the nodes; `tessera nodes ACTION NODE` changes one.
int Nodes(const Invocation& in) {
  if (!in.arg.empty()) return ChangeNode(in);
  if (absl::GetFlag(FLAGS_topology)) {
    auto listed = in.client.ListNodes(/*include_lost=*/true);
    if (!listed.ok()) return Fail(listed.status());
    std::cout << (in.json ? Json(*listed) : tessera::client::TopologyTree(*listed));
    return 0;
  }
  auto nodes = in.client.Nodes(/*include_lost=*/true);
  if (!nodes.ok()) return Fail(nodes.status());
  for (const auto& node : *nodes) {
    if (in.json) {
      std::cout << Json(node);
      continue;
    }
    std::string state = v1::NodeState_Name(node.state()).substr(std::string("NODE_STATE_").size());
    std::cout << absl::StrFormat("%-20s %-8s gpus %d/%d free  cpu slots %d/%d free  jobs [%s]\n",
                                 node.node_id(), state, node.free_gpus_size(),
                                 node.resources().gpus_size(), node.free_cpu_slots(),
                                 node.resources().cpu_slots(), absl::StrJoin(node.job_ids(), ","));
    if (node.drained()) {
      std::cout << "    drained" << (node.drain_reason().empty() ? "" : ": ") << node.drain_reason()
                << "\n";
    }
    for (const auto& gpu : node.gpu_metrics()) {
      std::cout << absl::StrFormat(
          "    gpu %d  util %3.0f%%  memory %5.1f/%5.1f GiB  %3.0f W  %2.0f C  %4.0f MHz\n",
          gpu.index(), gpu.utilization_percent(), gpu.memory_used_bytes() / 1073741824.0,
          gpu.memory_total_bytes() / 1073741824.0, gpu.power_watts(), gpu.temperature_celsius(),
          gpu.sm_clock_mhz());
    }
  }
  return 0;
}

// The commands that talk to a coordinator, by name. `needs`: what the first argument names when
// the command cannot run without one ("tessera get: missing JOB"); null when it needs none.
struct Command {
  std::string_view name;
  const char* needs;
  int (*run)(const Invocation&);
};

constexpr Command kCommands[] = {
    {"health", nullptr, Health}, {"plan", nullptr, Plan},   {"submit", "SPEC file", Submit},
    {"watch", "JOB", WatchJob},  {"get", "JOB", Get},       {"status", "JOB", Get},
    {"list", nullptr, List},     {"cancel", "JOB", Cancel}, {"logs", "JOB", Logs},
    {"metrics", "JOB", Metrics}, {"plot", "JOB", Plot},     {"checkpoints", "JOB", Checkpoints},
    {"queues", nullptr, Queues}, {"nodes", nullptr, Nodes},
};

const Command* FindCommand(std::string_view name) {
  for (const Command& command : kCommands) {
    if (command.name == name) return &command;
  }
  return nullptr;
}

// The client options: flags, then the environment, then the config file. Exits with 2 on a bad
// config file (message printed).
std::optional<tessera::client::ClientOptions> ClientOptionsFromFlags() {
  auto config = tessera::client::LoadClientConfig(absl::GetFlag(FLAGS_config));
  if (!config.ok()) {
    std::cerr << "tessera: " << config.status().message() << "\n";
    return std::nullopt;
  }
  auto pick = [](const std::string& flag, const char* env, const std::string& from_file) {
    if (!flag.empty()) return flag;
    if (const char* value = env == nullptr ? nullptr : std::getenv(env);
        value != nullptr && *value != '\0') {
      return std::string(value);
    }
    return from_file;
  };
  std::string address =
      pick(absl::GetFlag(FLAGS_coordinator), kCoordinatorEnv, config->coordinator);
  if (address.empty()) address = "127.0.0.1:50051";
  tessera::client::ClientOptions options{.address = address,
                                         .timeout = absl::GetFlag(FLAGS_timeout)};
  options.token = pick("", kTokenEnv, config->token);
  options.tls.ca_file = pick(absl::GetFlag(FLAGS_tls_ca), nullptr, config->tls_ca);
  options.tls.cert_file = pick(absl::GetFlag(FLAGS_tls_cert), nullptr, config->tls_cert);
  options.tls.key_file = pick(absl::GetFlag(FLAGS_tls_key), nullptr, config->tls_key);
  return options;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> args = tessera::ParseCommandLine(argc, argv, kUsage);
  if (args.size() < 2) {
    std::cerr << kUsage;
    return 2;
  }
  const std::string command = args[1];
  const std::string arg = args.size() > 2 ? args[2] : "";
  // Commands that need no coordinator.
  if (command == "local") return Local();
  if (command == "version") {
    std::cout << tessera::BuildSummary() << "\n";
    return 0;
  }
  const Command* found = FindCommand(command);
  if (found == nullptr) {
    std::cerr << "tessera: unknown command '" << command << "'\n\n" << kUsage;
    return 2;
  }
  std::optional<tessera::client::ClientOptions> options = ClientOptionsFromFlags();
  if (!options.has_value()) return 2;
  CoordinatorClient client(*options);
  const std::string output = absl::GetFlag(FLAGS_output);
  if (output != "text" && output != "json") {
    std::cerr << "tessera: --output must be text or json, not '" << output << "'\n";
    return 2;
  }
  if (found->needs != nullptr && arg.empty()) {
    std::cerr << "tessera " << command << ": missing " << found->needs << "\n\n" << kUsage;
    return 2;
  }
  return found->run(Invocation{
      .args = args, .command = command, .arg = arg, .client = client, .json = output == "json"});
}

// fake_trainer: a stand-in for tessera-trainer in the worker's tests. It links only the proto
// library and does what its flags say, in this order:
//   prints RANK, WORLD_SIZE, LOCAL_RANK, CUDA_VISIBLE_DEVICES, TESSERA_WORKER_PID, OMP_NUM_THREADS
//   and MKL_NUM_THREADS ("<unset>"
//   when absent), its working directory (CWD=...) and each argument (ARG[i]=...) to stdout;
//   --task=PATH        a task file the worker wrote (one naming a report socket; other paths
//                      are only printed): reads the TrainerTask, takes more flags from
//                      $TESSERA_FAKE_TRAINER_ARGS_RANK<rank> (space-separated), and connects to
//                      the task's report socket;
//   --heartbeat        with a task: sends a RankHeartbeat (step = heartbeats sent so far) every
//                      heartbeat_interval_seconds from a thread, as the real trainer does,
//                      with a breakdown (forward 0.25 s, a dp all_reduce of 0.125 s);
//   --stop_after_heartbeats=N  with --heartbeat: SIGSTOPs itself after N heartbeats (a hung rank);
//   --rank_steps       with --heartbeat: a RankStepMetrics of one more step with the same
//                      breakdown follows each heartbeat;
//   --ignore_sigterm   ignores SIGTERM (a grandchild inherits that);
//   --checkpoint_on_signal=S  on the checkpoint-and-stop signal (kCheckpointAndStopSignal) takes
//                      S seconds "saving", prints CHECKPOINTED and exits 0, as the trainer does;
//                      without it the signal is ignored (a rank too busy to answer);
//   --spawn_child      forks a grandchild that sleeps for the --sleep time (or an hour) and prints
//                      CHILD_PID=<pid>;
//   --lines=N          prints N lines "line <i>" to stderr;
//   prints READY, after which signals find the dispositions above in place;
//   --crash            raises SIGSEGV;
//   --sleep=S          sleeps S seconds (interrupted only by a signal that kills);
//   --report_failure=K with a task: sends a TrainerFailure of FailureKind number K (time = now);
//   --exit=N           exits with N (default 0).
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/trainer_env.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "tessera/v1/trainer.pb.h"

namespace {

void SleepSeconds(double seconds) {
  timespec remaining;
  remaining.tv_sec = static_cast<time_t>(seconds);
  remaining.tv_nsec = static_cast<long>((seconds - static_cast<double>(remaining.tv_sec)) * 1e9);
  while (nanosleep(&remaining, &remaining) != 0) {
  }
}

// --checkpoint_on_signal's time; read by the handler.
double checkpoint_seconds = 0;

void CheckpointAndExit(int) {
  // Only async-signal-safe calls.
  timespec saving;
  saving.tv_sec = static_cast<time_t>(checkpoint_seconds);
  saving.tv_nsec =
      static_cast<long>((checkpoint_seconds - static_cast<double>(saving.tv_sec)) * 1e9);
  while (nanosleep(&saving, &saving) != 0) {
  }
  static const char kLine[] = "CHECKPOINTED\n";
  [[maybe_unused]] ssize_t written = write(STDOUT_FILENO, kLine, sizeof(kLine) - 1);
  _exit(0);
}

void PrintEnv(const char* name) {
  const char* value = std::getenv(name);
  std::printf("%s=%s\n", name, value != nullptr ? value : "<unset>");
}

bool FlagValue(const std::string& arg, const std::string& name, std::string* value) {
  const std::string prefix = "--" + name + "=";
  if (arg.rfind(prefix, 0) != 0) return false;
  *value = arg.substr(prefix.size());
  return true;
}

// Timestamps to the nanosecond, without the project's helpers.
void SetNow(google::protobuf::Timestamp* timestamp) {
  const auto nanos = std::chrono::duration_cast<std::chrono::nanoseconds>(
                         std::chrono::system_clock::now().time_since_epoch())
                         .count();
  timestamp->set_seconds(nanos / 1000000000);
  timestamp->set_nanos(static_cast<int>(nanos % 1000000000));
}

// The report socket of a task, as the worker's readers expect it: length-delimited reports.
class ReportChannel {
 public:
  bool Connect(const std::string& path) {
    fd_ = socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
    return fd_ >= 0 && connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  }
  void Send(const tessera::v1::TrainerReport& report) {
    std::string frame;
    {
      google::protobuf::io::StringOutputStream stream(&frame);
      google::protobuf::io::CodedOutputStream coded(&stream);
      coded.WriteVarint32(static_cast<uint32_t>(report.ByteSizeLong()));
      report.SerializeWithCachedSizes(&coded);
    }
    std::lock_guard<std::mutex> lock(mu_);
    size_t sent = 0;
    while (sent < frame.size()) {
      const ssize_t n = send(fd_, frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return;
      sent += static_cast<size_t>(n);
    }
  }

 private:
  int fd_ = -1;
  std::mutex mu_;
};

}  // namespace

int main(int argc, char** argv) {
  int exit_code = 0;
  double sleep_seconds = 0;
  int lines = 0;
  bool ignore_sigterm = false;
  bool spawn_child = false;
  bool crash = false;
  std::vector<std::string> args(argv + 1, argv + argc);
  tessera::v1::TrainerTask task;
  bool has_task = false;
  for (const std::string& arg : std::vector<std::string>(args)) {
    std::string path;
    if (!FlagValue(arg, "task", &path)) continue;
    std::ifstream in(path, std::ios::binary);
    std::stringstream bytes;
    bytes << in.rdbuf();
    // Only a task the worker wrote counts: tests also pass made-up --task paths.
    has_task = in && task.ParseFromString(bytes.str()) && !task.report_socket().empty();
    const std::string name =
        "TESSERA_FAKE_TRAINER_ARGS_RANK" + std::to_string(task.assignment().rank());
    if (const char* more = std::getenv(name.c_str()); more != nullptr) {
      std::istringstream words(more);
      for (std::string word; words >> word;) args.push_back(word);
    }
  }
  bool heartbeat = false;
  bool rank_steps = false;
  bool checkpoint_on_signal = false;
  int stop_after_heartbeats = -1;
  int report_failure = -1;
  for (const std::string& arg : args) {
    std::string value;
    if (arg == "--heartbeat") {
      heartbeat = true;
    } else if (arg == "--rank_steps") {
      rank_steps = true;
    } else if (FlagValue(arg, "stop_after_heartbeats", &value)) {
      stop_after_heartbeats = std::atoi(value.c_str());
    } else if (FlagValue(arg, "report_failure", &value)) {
      report_failure = std::atoi(value.c_str());
    } else if (FlagValue(arg, "exit", &value)) {
      exit_code = std::atoi(value.c_str());
    } else if (FlagValue(arg, "sleep", &value)) {
      sleep_seconds = std::atof(value.c_str());
    } else if (FlagValue(arg, "lines", &value)) {
      lines = std::atoi(value.c_str());
    } else if (FlagValue(arg, "checkpoint_on_signal", &value)) {
      checkpoint_on_signal = true;
      checkpoint_seconds = std::atof(value.c_str());
    } else if (arg == "--ignore_sigterm") {
      ignore_sigterm = true;
    } else if (arg == "--spawn_child") {
      spawn_child = true;
    } else if (arg == "--crash") {
      crash = true;
    }
  }

  PrintEnv("RANK");
  PrintEnv("WORLD_SIZE");
  PrintEnv("LOCAL_RANK");
  PrintEnv("CUDA_VISIBLE_DEVICES");
  PrintEnv("TESSERA_WORKER_PID");
  PrintEnv("OMP_NUM_THREADS");
  PrintEnv("MKL_NUM_THREADS");
  char cwd[4096];
  std::printf("CWD=%s\n", getcwd(cwd, sizeof(cwd)) != nullptr ? cwd : "<unknown>");
  for (int i = 1; i < argc; ++i) std::printf("ARG[%d]=%s\n", i, argv[i]);
  std::fflush(stdout);

  // Before the first heartbeat: a worker may stop a rank as soon as it has heard from it.
  if (ignore_sigterm) signal(SIGTERM, SIG_IGN);
  signal(tessera::kCheckpointAndStopSignal, checkpoint_on_signal ? CheckpointAndExit : SIG_IGN);
  ReportChannel channel;
  if (has_task && !channel.Connect(task.report_socket())) {
    std::fprintf(stderr, "cannot connect to %s\n", task.report_socket().c_str());
    return 2;
  }
  auto report = [&task] {
    tessera::v1::TrainerReport report;
    report.set_job_id(task.job_id());
    report.set_attempt(task.attempt());
    report.set_rank(task.assignment().rank());
    SetNow(report.mutable_time());
    return report;
  };
  if (has_task && heartbeat) {
    const double interval =
        task.heartbeat_interval_seconds() > 0 ? task.heartbeat_interval_seconds() : 1.0;
    std::thread([&channel, report, interval, stop_after_heartbeats, rank_steps] {
      tessera::v1::StepTimeBreakdown breakdown;
      breakdown.set_forward_seconds(0.25);
      tessera::v1::CollectiveTime* all_reduce = breakdown.add_collectives();
      all_reduce->set_kind("all_reduce");
      all_reduce->set_dim("dp");
      all_reduce->set_seconds(0.125);
      all_reduce->set_calls(1);
      for (int sent = 0;; ++sent) {
        if (sent == stop_after_heartbeats) raise(SIGSTOP);
        tessera::v1::TrainerReport beat = report();
        beat.mutable_heartbeat()->set_step(sent);
        // A fixed breakdown, so tests see it carried through to the worker and coordinator.
        *beat.mutable_heartbeat()->mutable_breakdown() = breakdown;
        channel.Send(beat);
        if (rank_steps) {
          tessera::v1::TrainerReport step = report();
          step.mutable_rank_step()->set_step(sent + 1);
          *step.mutable_rank_step()->mutable_breakdown() = breakdown;
          channel.Send(step);
        }
        SleepSeconds(interval);
      }
    }).detach();
  }

  if (spawn_child) {
    const pid_t child = fork();
    if (child == 0) {
      SleepSeconds(sleep_seconds > 0 ? sleep_seconds : 3600);
      _exit(0);
    }
    std::printf("CHILD_PID=%d\n", static_cast<int>(child));
    std::fflush(stdout);
  }
  for (int i = 1; i <= lines; ++i) std::fprintf(stderr, "line %d\n", i);
  std::fflush(stderr);
  std::printf("READY\n");
  std::fflush(stdout);

  if (crash) {
    const rlimit no_core = {0, 0};
    setrlimit(RLIMIT_CORE, &no_core);
    raise(SIGSEGV);
  }
  if (sleep_seconds > 0) SleepSeconds(sleep_seconds);
  if (has_task && report_failure >= 0) {
    tessera::v1::TrainerReport failed = report();
    failed.mutable_failure()->set_kind(static_cast<tessera::v1::FailureKind>(report_failure));
    failed.mutable_failure()->set_rank(task.assignment().rank());
    failed.mutable_failure()->set_message("fake failure");
    *failed.mutable_failure()->mutable_time() = failed.time();
    channel.Send(failed);
  }
  std::fflush(stdout);
  std::_Exit(exit_code);  // the heartbeat thread may still run
}

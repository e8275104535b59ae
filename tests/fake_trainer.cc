// fake_trainer: a stand-in for tessera-trainer in the worker's process tests. It links no project
// library and does what its flags say, in this order:
//   prints RANK, WORLD_SIZE, LOCAL_RANK and CUDA_VISIBLE_DEVICES ("<unset>" when absent), its
//   working directory (CWD=...) and each argument (ARG[i]=...) to stdout;
//   --ignore_sigterm   ignores SIGTERM (a grandchild inherits that);
//   --spawn_child      forks a grandchild that sleeps for the --sleep time (or an hour) and prints
//                      CHILD_PID=<pid>;
//   --lines=N          prints N lines "line <i>" to stderr;
//   prints READY, after which signals find the dispositions above in place;
//   --crash            raises SIGSEGV;
//   --sleep=S          sleeps S seconds (interrupted only by a signal that kills);
//   --exit=N           exits with N (default 0).
#include <signal.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace {

void SleepSeconds(double seconds) {
  timespec remaining;
  remaining.tv_sec = static_cast<time_t>(seconds);
  remaining.tv_nsec = static_cast<long>((seconds - static_cast<double>(remaining.tv_sec)) * 1e9);
  while (nanosleep(&remaining, &remaining) != 0) {
  }
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

}  // namespace

int main(int argc, char** argv) {
  int exit_code = 0;
  double sleep_seconds = 0;
  int lines = 0;
  bool ignore_sigterm = false;
  bool spawn_child = false;
  bool crash = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    std::string value;
    if (FlagValue(arg, "exit", &value)) {
      exit_code = std::atoi(value.c_str());
    } else if (FlagValue(arg, "sleep", &value)) {
      sleep_seconds = std::atof(value.c_str());
    } else if (FlagValue(arg, "lines", &value)) {
      lines = std::atoi(value.c_str());
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
  char cwd[4096];
  std::printf("CWD=%s\n", getcwd(cwd, sizeof(cwd)) != nullptr ? cwd : "<unknown>");
  for (int i = 1; i < argc; ++i) std::printf("ARG[%d]=%s\n", i, argv[i]);
  std::fflush(stdout);

  if (ignore_sigterm) signal(SIGTERM, SIG_IGN);
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
  return exit_code;
}

#include "tests/util/pty.h"

#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace tessera::testing {

absl::StatusOr<PtyRun> RunInPty(const std::vector<std::string>& argv,
                                const std::vector<std::string>& extra_env, int columns, int rows,
                                absl::Duration timeout) {
  if (argv.empty()) return absl::InvalidArgumentError("argv: empty");
  winsize size{};
  size.ws_col = static_cast<unsigned short>(columns);
  size.ws_row = static_cast<unsigned short>(rows);
  int master = -1;
  const pid_t pid = forkpty(&master, nullptr, nullptr, &size);
  if (pid < 0) return absl::InternalError(absl::StrCat("forkpty: ", strerror(errno)));
  if (pid == 0) {
    for (const std::string& entry : extra_env) putenv(const_cast<char*>(entry.c_str()));
    std::vector<char*> args;
    for (const auto& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  PtyRun run;
  const absl::Time deadline = absl::Now() + timeout;
  char buffer[4096];
  while (true) {
    const int wait_ms =
        static_cast<int>(std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now())));
    pollfd fd{master, POLLIN, 0};
    const int ready = poll(&fd, 1, std::min(wait_ms, 200));
    if (ready > 0) {
      const ssize_t n = read(master, buffer, sizeof(buffer));
      if (n > 0) {
        run.output.append(buffer, static_cast<size_t>(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      break;  // EIO: the child side closed (it exited)
    }
    if (ready < 0 && errno != EINTR) break;
    if (absl::Now() >= deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
      close(master);
      return absl::DeadlineExceededError(
          absl::StrCat(argv[0], " did not exit within ", absl::FormatDuration(timeout),
                       "; output so far:\n", run.output));
    }
  }
  close(master);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status)) run.exit.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) run.exit.signal = WTERMSIG(status);
  return run;
}

std::vector<std::string> TerminalPieces(const std::string& output) {
  std::vector<std::string> pieces;
  std::string piece;
  for (size_t i = 0; i < output.size(); ++i) {
    const char c = output[i];
    if (c == '\033' && i + 1 < output.size() && output[i + 1] == '[') {
      i += 2;
      while (i < output.size() && !(output[i] >= '@' && output[i] <= '~')) ++i;
      continue;
    }
    if (c == '\r' || c == '\n') {
      if (!piece.empty()) pieces.push_back(piece);
      piece.clear();
      continue;
    }
    piece += c;
  }
  if (!piece.empty()) pieces.push_back(piece);
  return pieces;
}

}  // namespace tessera::testing

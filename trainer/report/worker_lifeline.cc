#include "trainer/report/worker_lifeline.h"

#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace tessera::trainer {

absl::Status DieWithWorker(absl::string_view worker_pid) {
  int64_t pid = 0;
  if (!absl::SimpleAtoi(worker_pid, &pid) || pid <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("TESSERA_WORKER_PID: \"", worker_pid, "\" is not a pid"));
  }
  if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0) {
    return absl::InternalError(absl::StrCat("prctl(PR_SET_PDEATHSIG): ", std::strerror(errno)));
  }
  // Checked after arming: a worker that dies from here on sends the signal; one that died
  // before has already handed this process to a subreaper or init.
  if (getppid() != static_cast<pid_t>(pid)) {
    return absl::FailedPreconditionError(
        absl::StrCat("worker ", pid, " is gone (parent is now ", getppid(), ")"));
  }
  return absl::OkStatus();
}

}  // namespace tessera::trainer

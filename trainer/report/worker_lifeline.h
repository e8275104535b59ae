// Ties a trainer's life to the worker that launched it (common/trainer_env.h, kWorkerPidEnv):
// the kernel sends the trainer SIGKILL when its parent dies (PR_SET_PDEATHSIG), and a trainer
// whose parent died before it could ask for that finds itself re-parented and exits at once.
// Together with the report socket's hang-up (trainer/report/reporter.h) and the worker's pid files
// (worker/orphans.h), no trainer trains on for a worker that is gone. Call from main's thread,
// first thing: the parent-death signal is armed for the calling thread's process.
#pragma once

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace tessera::trainer {

// With `worker_pid` the value of kWorkerPidEnv: arms PR_SET_PDEATHSIG with SIGKILL, then checks
// that the parent is still that worker. FAILED_PRECONDITION when it is not (the caller exits);
// INVALID_ARGUMENT when `worker_pid` is not a pid; the errno status when prctl fails.
absl::Status DieWithWorker(absl::string_view worker_pid);

}  // namespace tessera::trainer

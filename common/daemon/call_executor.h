// CallExecutor: the threads a daemon's gRPC handlers do their blocking work on.
//
// gRPC's callback API runs every handler on a small pool of its own
// ("nexting_thread": half the cores, at least 2 and at most 16). A handler
// that waits there (a SQLite commit and its fsync, a lock held by a
// scheduling pass) stalls every other call on the server, heartbeats and
// health checks included, while the CPU sits idle. Handlers that may wait hand
// their work to a CallExecutor and return at once; the work finishes the
// call's reactor from one of the executor's threads.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/server_callback.h"

namespace tessera {

// Thread safety: Schedule and TrySchedule may be called from any thread.
class CallExecutor {
 public:
  // Starts `threads` (>= 1) threads named `name` (at most 15 characters show),
  // each at `nice` (Linux's per-thread nice value, added to the process's):
  // work that may wait its turn yields the CPU to the rest of the daemon.
  // TrySchedule refuses work while `max_queued` (> 0; 0: no limit) wait.
  CallExecutor(int threads, const std::string& name, int nice = 0, int max_queued = 0);
  // Runs the work already scheduled, then joins the threads. Work scheduled
  // while it is destroyed is a bug (the gRPC server must be shut down first).
  ~CallExecutor();
  CallExecutor(const CallExecutor&) = delete;
  CallExecutor& operator=(const CallExecutor&) = delete;

  // Runs `work` on one of the threads, in the order scheduled.
  void Schedule(absl::AnyInvocable<void() &&> work);
  // Schedule, unless max_queued pieces of work already wait: then false, and
  // `work` is dropped unrun.
  bool TrySchedule(absl::AnyInvocable<void() &&> work);

  int threads() const { return static_cast<int>(threads_.size()); }
  const std::string& name() const { return name_; }
  int max_queued() const { return static_cast<int>(max_queued_); }

  // How loaded it is now, and what it refused since it started (ExecutorMetrics serves these).
  struct Load {
    int busy_threads = 0;  // running work
    int queued = 0;        // waiting for a thread
    int64_t refused = 0;   // TrySchedule's refusals
  };
  Load load() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Loop();

  mutable absl::Mutex mu_;
  std::deque<absl::AnyInvocable<void() &&>> queue_ ABSL_GUARDED_BY(mu_);
  int busy_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t refused_ ABSL_GUARDED_BY(mu_) = 0;
  const std::string name_;
  const size_t max_queued_;
  absl::CondVar ready_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

// The status of a call refused because its executor's queue is full:
// RESOURCE_EXHAUSTED, retry after a second (kRetryAfterPayload, grpc_status.h).
absl::Status ExecutorBusy(const std::string& name, int max_queued);

// Runs `handle` (absl::Status(), filling the response) on `executor`, or
// inline when `executor` is null, then `finish` (void(const absl::Status&,
// grpc::ServerUnaryReactor*)), which must finish the reactor. When the
// executor's queue is full the call is finished at once with ExecutorBusy.
// The request and response stay valid until then: gRPC keeps them until the
// reactor finishes.
template <typename Handle, typename Finish>
grpc::ServerUnaryReactor* HandleOn(CallExecutor* executor, grpc::CallbackServerContext* context,
                                   Handle handle, Finish finish) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  Finish refuse = finish;
  auto run = [reactor, handle = std::move(handle), finish = std::move(finish)]() mutable {
    finish(handle(), reactor);
  };
  if (executor == nullptr) {
    run();
  } else if (!executor->TrySchedule(std::move(run))) {
    refuse(ExecutorBusy(executor->name(), executor->max_queued()), reactor);
  }
  return reactor;
}

}  // namespace tessera

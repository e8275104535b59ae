#include "common/daemon/call_executor.h"

#include <pthread.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "common/daemon/grpc_status.h"

namespace tessera {

CallExecutor::CallExecutor(int threads, const std::string& name, int nice, int max_queued)
    : name_(name), max_queued_(static_cast<size_t>(std::max(max_queued, 0))) {
  threads = std::max(threads, 1);
  threads_.reserve(threads);
  for (int i = 0; i < threads; ++i) {
    threads_.emplace_back([this, nice] {
      if (nice != 0) {
        // On Linux a thread's nice value is its own (setpriority with its thread id). A failure
        // (a container that forbids it) only leaves the thread at the daemon's priority.
        const int own = getpriority(PRIO_PROCESS, static_cast<id_t>(gettid()));
        setpriority(PRIO_PROCESS, static_cast<id_t>(gettid()), own + nice);
      }
      Loop();
    });
    // Linux keeps 15 characters; a longer name is refused, so cut it.
    pthread_setname_np(threads_.back().native_handle(), name.substr(0, 15).c_str());
  }
}

CallExecutor::~CallExecutor() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  ready_.SignalAll();
  for (std::thread& thread : threads_) thread.join();
}

void CallExecutor::Schedule(absl::AnyInvocable<void() &&> work) {
  {
    absl::MutexLock lock(&mu_);
    queue_.push_back(std::move(work));
  }
  ready_.Signal();
}

bool CallExecutor::TrySchedule(absl::AnyInvocable<void() &&> work) {
  {
    absl::MutexLock lock(&mu_);
    if (max_queued_ > 0 && queue_.size() >= max_queued_) {
      ++refused_;
      return false;
    }
    queue_.push_back(std::move(work));
  }
  ready_.Signal();
  return true;
}

absl::Status ExecutorBusy(const std::string& name, int max_queued) {
  absl::Status status = absl::ResourceExhaustedError(absl::StrCat(
      "the server is busy: ", max_queued, " calls already wait for its ", name,
      " threads; retry in 1 s"));
  status.SetPayload(kRetryAfterPayload, absl::Cord("1000"));
  return status;
}

void CallExecutor::Loop() {
  while (true) {
    absl::AnyInvocable<void() &&> work;
    {
      absl::MutexLock lock(&mu_);
      while (!stopping_ && queue_.empty()) ready_.Wait(&mu_);
      if (queue_.empty()) return;  // stopping, and everything scheduled has run
      work = std::move(queue_.front());
      queue_.pop_front();
      ++busy_;
    }
    std::move(work)();
    // The work's captures go before the thread counts as idle.
    work = nullptr;
    absl::MutexLock lock(&mu_);
    --busy_;
  }
}

CallExecutor::Load CallExecutor::load() const {
  absl::MutexLock lock(&mu_);
  return Load{
      .busy_threads = busy_, .queued = static_cast<int>(queue_.size()), .refused = refused_};
}

}  // namespace tessera

#include "common/daemon/call_executor.h"

#include <pthread.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <utility>

namespace tessera {

CallExecutor::CallExecutor(int threads, const std::string& name, int nice) {
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

void CallExecutor::Loop() {
  while (true) {
    absl::AnyInvocable<void() &&> work;
    {
      absl::MutexLock lock(&mu_);
      while (!stopping_ && queue_.empty()) ready_.Wait(&mu_);
      if (queue_.empty()) return;  // stopping, and everything scheduled has run
      work = std::move(queue_.front());
      queue_.pop_front();
    }
    std::move(work)();
  }
}

}  // namespace tessera

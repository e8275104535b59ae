// HandOffThread<T>: a thread of its own that does `work` on each item handed to it, one at a time,
// so that its producer goes on while the item is worked on. The scheduling pass hands it each
// pass's store writes: they are stored beside the next pass, which waits only if it reaches its
// own hand-over before the previous item is done. One item at most is in the thread's hands:
// HandOver blocks until the previous one has been worked on.
//
// Thread safety: every method may be called from any thread; mu_ guards the hand-over state.
// Start and Stop are not to be called concurrently with each other.
#pragma once

#include <pthread.h>

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace tessera::coordinator {

template <typename T>
class HandOffThread {
 public:
  // `name` names the thread for profiles (at most 15 characters).
  HandOffThread(std::function<void(T)> work, std::string name)
      : work_(std::move(work)), name_(std::move(name)) {}
  // Stops the thread, after working on what was handed over.
  ~HandOffThread() { Stop(); }
  HandOffThread(const HandOffThread&) = delete;
  HandOffThread& operator=(const HandOffThread&) = delete;

  void Start() ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = false;
    }
    thread_ = std::thread([this] {
      pthread_setname_np(pthread_self(), name_.substr(0, 15).c_str());
      Loop();
    });
  }

  // Returns once the item handed over before (if any) has been worked on.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    if (thread_.joinable()) thread_.join();
  }

  // Waits until the previous item has been worked on, then hands `item` over. Start() first.
  void HandOver(T item) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &HandOffThread::IdleLocked));
    next_ = std::move(item);
  }

  // Seconds spent in `work` since the previous call.
  double TakeBusySeconds() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return std::exchange(busy_seconds_, 0.0);
  }

 private:
  bool IdleLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !next_.has_value() && !busy_;
  }
  bool ReadyLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return next_.has_value() || stopping_;
  }

  void Loop() ABSL_LOCKS_EXCLUDED(mu_) {
    while (true) {
      std::optional<T> item;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(this, &HandOffThread::ReadyLocked));
        // What was handed over before Stop is worked on first.
        if (!next_.has_value()) return;
        item = std::move(next_);
        next_.reset();
        busy_ = true;
      }
      const auto start = std::chrono::steady_clock::now();
      work_(std::move(*item));
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      absl::MutexLock lock(&mu_);
      busy_ = false;
      busy_seconds_ += seconds;
    }
  }

  const std::function<void(T)> work_;
  const std::string name_;
  std::thread thread_;
  absl::Mutex mu_;
  std::optional<T> next_ ABSL_GUARDED_BY(mu_);
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  double busy_seconds_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace tessera::coordinator

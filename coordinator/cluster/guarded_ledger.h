// GuardedLedger: the allocation ledger (the live attempts: the devices each holds, what its nodes
// reported) behind the one lock that guards it, the cluster lock. The lock is the ledger's own:
// nothing else can name it, and the ledger is reached only through a Hold, which holds the lock
// for its lifetime. A function that reads or changes the attempts takes a `Hold&`: it cannot be
// called without the lock, and the compiler, not a comment, says so.
//
// Thread safety: a Hold may be made on any thread; Holds exclude one another. Lock order: the
// scheduling pass's serialization and the node registry's write lock (NodeRegistry::Remove asks
// the ledger) before it; the node registry's lock, then the order outbox's, after it. Code that
// holds it makes no store write.
#pragma once

#include <algorithm>
#include <chrono>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/cluster/allocation_ledger.h"

namespace tessera::coordinator {

class GuardedLedger {
 public:
  GuardedLedger() = default;
  GuardedLedger(const GuardedLedger&) = delete;
  GuardedLedger& operator=(const GuardedLedger&) = delete;

  // The lock, held from construction to destruction; the ledger through -> and *.
  class ABSL_SCOPED_LOCKABLE Hold {
   public:
    // With `held_seconds`, the time held is added to it on release, and the longest single
    // hold kept in `longest_seconds` (a scheduling pass's statistics).
    explicit Hold(GuardedLedger* owner, double* held_seconds = nullptr,
                  double* longest_seconds = nullptr) ABSL_EXCLUSIVE_LOCK_FUNCTION(owner->mu_)
        : owner_(owner), held_seconds_(held_seconds), longest_seconds_(longest_seconds) {
      owner_->mu_.Lock();
      if (held_seconds_ != nullptr) start_ = std::chrono::steady_clock::now();
    }
    ~Hold() ABSL_UNLOCK_FUNCTION() {
      if (held_seconds_ != nullptr) {
        // Measured up to the release, not past it: waking a waiter is not time held.
        const double held =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
        *held_seconds_ += held;
        if (longest_seconds_ != nullptr) *longest_seconds_ = std::max(*longest_seconds_, held);
      }
      owner_->mu_.Unlock();
    }
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;

    AllocationLedger* operator->() const { return &Ledger(); }
    AllocationLedger& operator*() const { return Ledger(); }

   private:
    AllocationLedger& Ledger() const {
      owner_->mu_.AssertHeld();
      return owner_->ledger_;
    }

    GuardedLedger* const owner_;
    double* const held_seconds_;
    double* const longest_seconds_;
    std::chrono::steady_clock::time_point start_;
  };

 private:
  absl::Mutex mu_;
  AllocationLedger ledger_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessera::coordinator

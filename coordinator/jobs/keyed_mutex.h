// KeyedMutex: one mutex per key (a job id, a request id), made when first wanted and dropped when
// nobody holds or waits for it any more.
//
// JobManager serializes the read-modify-write of each job. A fixed array of lock stripes did it
// before, but a scheduler pass that stores hundreds of placements took every stripe, and each
// stripe was usually held by a report or transition of some other job, waiting for a group
// commit: at 2,500 jobs/s offered the pass spent most of its time acquiring stripes (about 100-350
// ms a pass) for jobs nobody else was touching. Locks per key only make callers of the same key
// wait.
//
// Thread safety: all methods may be called from any thread. Lock several keys in ascending order
// (LockAll does) so that two callers cannot deadlock.
#pragma once

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"

namespace tessera::coordinator {

class KeyedMutex {
 public:
  KeyedMutex() = default;
  KeyedMutex(const KeyedMutex&) = delete;
  KeyedMutex& operator=(const KeyedMutex&) = delete;

  // Blocks until the calling thread holds `key`'s mutex. The mutex of a key exists only at run
  // time, so the thread-safety analysis cannot name it: Lock and Unlock are exempt, and callers
  // hold keys through Hold and HoldAll, which pair them.
  void Lock(const std::string& key) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    Entry* entry;
    {
      absl::MutexLock lock(&table_mu_);
      std::unique_ptr<Entry>& slot = entries_[key];
      if (slot == nullptr) slot = std::make_unique<Entry>();
      ++slot->users;
      entry = slot.get();
    }
    entry->mu.Lock();
  }

  // Releases `key`'s mutex, which the calling thread holds.
  void Unlock(const std::string& key) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    absl::MutexLock lock(&table_mu_);
    auto it = entries_.find(key);
    it->second->mu.Unlock();
    if (--it->second->users == 0) entries_.erase(it);
  }

  // Keys with a mutex now (held or waited for); for tests.
  size_t size() {
    absl::MutexLock lock(&table_mu_);
    return entries_.size();
  }
  // Holders and waiters of `key` now; for tests.
  int users(const std::string& key) {
    absl::MutexLock lock(&table_mu_);
    auto it = entries_.find(key);
    return it == entries_.end() ? 0 : it->second->users;
  }

  // Holds one key's mutex for its lifetime.
  class Hold {
   public:
    Hold(KeyedMutex* mutex, std::string key) : mutex_(mutex), key_(std::move(key)) {
      mutex_->Lock(key_);
    }
    ~Hold() { mutex_->Unlock(key_); }
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;

   private:
    KeyedMutex* mutex_;
    std::string key_;
  };

  // Holds the mutexes of several keys (duplicates allowed), taken in ascending order.
  class HoldAll {
   public:
    HoldAll(KeyedMutex* mutex, std::vector<std::string> keys)
        : mutex_(mutex), keys_(std::move(keys)) {
      std::sort(keys_.begin(), keys_.end());
      keys_.erase(std::unique(keys_.begin(), keys_.end()), keys_.end());
      for (const auto& key : keys_) mutex_->Lock(key);
    }
    ~HoldAll() {
      for (auto it = keys_.rbegin(); it != keys_.rend(); ++it) mutex_->Unlock(*it);
    }
    HoldAll(const HoldAll&) = delete;
    HoldAll& operator=(const HoldAll&) = delete;

   private:
    KeyedMutex* mutex_;
    std::vector<std::string> keys_;
  };

 private:
  struct Entry {
    absl::Mutex mu;
    int users = 0;  // holders and waiters; guarded by table_mu_
  };
  absl::Mutex table_mu_;
  // unique_ptr: an Entry stays put while the map rehashes.
  absl::flat_hash_map<std::string, std::unique_ptr<Entry>> entries_ ABSL_GUARDED_BY(table_mu_);
};

}  // namespace tessera::coordinator

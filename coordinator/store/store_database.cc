// Database (store_database.h): the group commit's queue and leader, shared by both engines.
#include "coordinator/store/store_database.h"

#include <time.h>

#include <algorithm>
#include <utility>

namespace tessera::coordinator {

double ThreadCpuSeconds() {
  timespec now{};
  if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now) != 0) return 0;
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
}

void Database::GroupCommit(const std::vector<QueuedWrite*>& writes) {
  if (writes.empty()) return;
  absl::MutexLock lock(&queue_mu_);
  queued_.insert(queued_.end(), writes.begin(), writes.end());
  // Ours are done once the last one is (a batch is finished as a whole).
  QueuedWrite* const first = writes.front();
  QueuedWrite* const last = writes.back();
  // Wakes when ours are done, or when no commit is under way and ours head the queue: then this
  // caller leads the next batch. Only that one caller wakes to lead, and the others only once
  // their writes are done (a condition variable woke every waiter after every batch).
  struct Turn {
    Database* database;
    QueuedWrite* first;
    QueuedWrite* last;
    static bool Ready(Turn* turn) ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return turn->last->done ||
             (!turn->database->committing_ && !turn->database->queued_.empty() &&
              turn->database->queued_.front() == turn->first);
    }
  } turn{this, first, last};
  while (true) {
    queue_mu_.Await(absl::Condition(&Turn::Ready, &turn));
    if (last->done) break;
    committing_ = true;
    std::vector<QueuedWrite*> batch = std::move(queued_);
    queued_.clear();
    queue_mu_.Unlock();
    const DatabaseCommitStats stats = RunBatch(batch);
    const bool any_applied = std::any_of(batch.begin(), batch.end(),
                                         [](const QueuedWrite* w) { return w->status.ok(); });
    if (any_applied) ReportCommit(stats);
    queue_mu_.Lock();
    for (QueuedWrite* write : batch) write->done = true;
    committing_ = false;
  }
}

void Database::SetCommitObserver(std::function<void(const DatabaseCommitStats&)> observer) {
  absl::MutexLock lock(&observer_mu_);
  commit_observer_ = std::move(observer);
}

void Database::SetFence(Fence fence) {
  absl::MutexLock lock(&fence_mu_);
  fence_ = std::move(fence);
}

absl::Status Database::CheckFence(DbConnection& writer) {
  Fence fence;
  {
    absl::MutexLock lock(&fence_mu_);
    fence = fence_;
  }
  return fence ? fence(writer) : absl::OkStatus();
}

void Database::ReportCommit(const DatabaseCommitStats& stats) {
  std::function<void(const DatabaseCommitStats&)> observer;
  {
    absl::MutexLock lock(&observer_mu_);
    observer = commit_observer_;
  }
  if (observer) observer(stats);
}

}  // namespace tessera::coordinator

// The coordinator's queue file (--queue_file, queue_config.h): read when the daemon starts (a bad
// file stops it), then re-read when it changes, checked at most once per reload_check_interval
// when the configuration is asked for. A version that does not parse or validate is refused: its
// error (the entry and field at fault) is logged once and the previous configuration stays, so a
// typo never disturbs what is queued or running. Without a path there is one implicit queue
// without quota (QueueConfig::implicit()).
//
// Thread safety: every method may be called from any thread; mu_ guards the configuration and
// the file's identity. A configuration handed out is immutable and stays valid while held.
#pragma once

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "coordinator/queues/queue_config.h"

namespace tessera::coordinator {

struct QueueFileOptions {
  // Path of the YAML file; empty: no queues.
  std::string path;
  // How often, at most, Current() checks whether the file changed.
  absl::Duration reload_check_interval = absl::Seconds(1);
  Clock* clock = Clock::Real();
};

class QueueFile {
 public:
  // Reads the file; its error is returned (INVALID_ARGUMENT naming the file, entry and field).
  static absl::StatusOr<std::unique_ptr<QueueFile>> Create(QueueFileOptions options);

  // The configuration in force, re-read first when the file changed and the check interval has
  // passed.
  std::shared_ptr<const QueueConfig> Current();

  // Re-reads the file now when its identity (inode, size, modification time) changed. A version
  // that does not parse keeps the previous configuration; its error is returned.
  absl::Status ReloadIfChanged();

  // Versions read so far, the first included (for logs and tests).
  int reloads() const;

  // The file's path; empty without one.
  const std::string& path() const { return options_.path; }

 private:
  explicit QueueFile(QueueFileOptions options) : options_(std::move(options)) {}
  absl::Status LoadLocked(const std::string& identity) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const QueueFileOptions options_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const QueueConfig> config_ ABSL_GUARDED_BY(mu_);
  std::string identity_ ABSL_GUARDED_BY(mu_);
  absl::Time last_check_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int reloads_ ABSL_GUARDED_BY(mu_) = 0;
  std::string last_error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessera::coordinator

// Store: the coordinator's durable state in one SQLite database: jobs, their
// numbered events, step and eval metric points, checkpoints, nodes and the job
// id counter. Everything one committed change of a job writes goes in one
// transaction (JobWrite), so a coordinator restarted after a crash reloads a
// consistent picture. The database runs in WAL mode with synchronous=FULL: a
// Commit that returned survives SIGKILL and power loss.
//
// Protobufs are stored as serialized blobs, next to the columns that queries
// filter and order on. A blob that does not parse is reported as DATA_LOSS,
// never a crash.
//
// Thread safety: every method may be called from any thread; one absl::Mutex
// serializes use of the single connection. The write observer is called after
// the mutex is released, on the writing thread.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "tessera/v1/checkpoint.pb.h"
#include "tessera/v1/job.pb.h"
#include "tessera/v1/metrics.pb.h"
#include "tessera/v1/node.pb.h"

struct sqlite3;
struct sqlite3_stmt;

namespace tessera::coordinator {

// Everything one committed change of a job writes, applied in ONE SQLite
// transaction, in this order: job upsert, events, metrics, evals, checkpoint
// upserts, checkpoint deletions.
struct JobWrite {
  // Upsert of the job row: the whole v1::Job, stored as a blob plus the
  // indexed columns job_id, state, priority, create_time and request_id.
  std::optional<v1::Job> job;
  // Appended. Commit assigns sequence = previous max + 1, 2, ... per job
  // (gap-free, from 1), sets `job_id`, and sets `time` when unset.
  std::vector<v1::JobEvent> events;
  // Metric points keyed (job_id, step); a repeated step replaces the old
  // point, so a relayed batch may be resent.
  std::vector<v1::StepMetrics> metrics;
  // Keyed (job_id, step), replaced likewise.
  std::vector<v1::EvalMetrics> evals;
  // Keyed (job_id, step), replaced likewise; `job_id` is set when empty.
  std::vector<v1::Checkpoint> checkpoints;
  // Retention: the checkpoint rows of these steps are removed.
  std::vector<int64_t> deleted_checkpoint_steps;
  // The job the write is about. Required; must match job->job_id() when set.
  // Without `job`, the job must already be stored (NOT_FOUND otherwise).
  std::string job_id;
  // The submission's idempotency key (SubmitJobRequest.request_id), recorded
  // with the job when non-empty (v1::Job has no field for it). A later write
  // with an empty request_id keeps the recorded one. Two jobs cannot share a
  // key: ALREADY_EXISTS.
  std::string request_id;
};

// One page of ListJobs.
struct JobPage {
  std::vector<v1::Job> jobs;
  // Empty on the last page.
  std::string next_page_token;
};

// Error mapping: SQLite failures become a status whose message names the
// operation and carries SQLite's message ("store: insert event for job-0001:
// database is locked"): UNAVAILABLE for SQLITE_BUSY/LOCKED, RESOURCE_EXHAUSTED
// for SQLITE_FULL, DATA_LOSS for SQLITE_CORRUPT, ALREADY_EXISTS for a unique
// key violation, INTERNAL otherwise.
class Store {
 public:
  // The schema version this binary writes; kept in the schema_version table.
  static constexpr int kSchemaVersion = 1;
  // How long a statement waits for a lock held by another connection.
  static constexpr int kBusyTimeoutMs = 5000;
  // ListJobs page size when 0 is asked for, and the largest honoured.
  static constexpr int kDefaultPageSize = 100;
  static constexpr int kMaxPageSize = 1000;

  // Opens or creates the database at `path` (":memory:" for tests), in WAL
  // mode with synchronous=FULL, foreign keys on and a busy timeout, and
  // creates or migrates the schema. A file that is not a SQLite database, or
  // whose schema is newer than kSchemaVersion: FAILED_PRECONDITION naming the
  // path.
  static absl::StatusOr<std::unique_ptr<Store>> Open(const std::string& path);

  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // Applies `write` atomically and returns the events as stored (with
  // sequence, job_id and time). INVALID_ARGUMENT when job_id is empty or an
  // object names another job.
  absl::StatusOr<std::vector<v1::JobEvent>> Commit(const JobWrite& write);

  // NOT_FOUND "job 'x' not found" when absent.
  absl::StatusOr<v1::Job> GetJob(const std::string& job_id);
  // The job submitted with this idempotency key, if any.
  absl::StatusOr<std::optional<v1::Job>> FindJobByRequestId(const std::string& request_id);
  // Newest first (create_time desc, then job_id desc); `states` empty means
  // all. page_size 0 means kDefaultPageSize; larger than kMaxPageSize is
  // capped. `page_token` is the previous page's next_page_token (opaque); a
  // malformed one is INVALID_ARGUMENT "page_token: ...".
  absl::StatusOr<JobPage> ListJobs(const std::vector<v1::JobState>& states, int page_size,
                                   const std::string& page_token);
  // Jobs in non-terminal states (PENDING, SCHEDULED, RUNNING, RESTARTING),
  // oldest first: what the coordinator reloads on start.
  absl::StatusOr<std::vector<v1::Job>> ListActiveJobs();
  // How many jobs are SUCCEEDED, FAILED and CANCELLED (each present, 0 when none).
  absl::StatusOr<std::map<v1::JobState, int64_t>> CountEndedJobs();

  // Events with sequence > after_sequence, ascending, at most `limit`
  // (0 means no limit).
  absl::StatusOr<std::vector<v1::JobEvent>> ReadEvents(const std::string& job_id,
                                                       int64_t after_sequence, int limit);
  // The newest event's sequence; 0 when the job has none.
  absl::StatusOr<int64_t> LastEventSequence(const std::string& job_id);

  // Points with from_step <= step <= to_step (to_step 0 means no upper
  // bound), ascending by step.
  absl::StatusOr<std::vector<v1::StepMetrics>> ReadMetrics(const std::string& job_id,
                                                           int64_t from_step, int64_t to_step);
  absl::StatusOr<std::vector<v1::EvalMetrics>> ReadEvals(const std::string& job_id,
                                                         int64_t from_step, int64_t to_step);
  // Newest step first.
  absl::StatusOr<std::vector<v1::Checkpoint>> ListCheckpoints(const std::string& job_id);

  // Upsert by node_id (INVALID_ARGUMENT when empty).
  absl::Status PutNode(const v1::Node& node);
  // Removing an absent node is OK.
  absl::Status DeleteNode(const std::string& node_id);
  // Ordered by node_id.
  absl::StatusOr<std::vector<v1::Node>> ListNodes();

  // The next job id, durable and monotonic across restarts: "job-" + 8
  // lower-case hex digits of a counter kept in the database (from 1). An id
  // already taken by a stored job is skipped. RESOURCE_EXHAUSTED after 2^32-1
  // ids.
  absl::StatusOr<std::string> NextJobId();

  // Called with the seconds a committed write took (Commit, PutNode,
  // DeleteNode, including the fsync), for the store-write-latency histogram.
  // Pass nullptr to remove.
  void SetWriteObserver(std::function<void(double seconds)> observer);

  // Fault injection for tests of what sits on the store: before each write
  // (Commit, PutNode) `injector` is called with the write's job or node id; a
  // non-OK status it returns fails the write unapplied, as a real SQLite
  // error would. Pass nullptr to remove.
  void SetWriteFailureInjector(std::function<absl::Status(const std::string& id)> injector);

 private:
  Store(sqlite3* db, std::string path);

  // A cached prepared statement, reset and cleared when the object dies.
  class Statement;

  absl::Status Configure() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Migrate() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Rows of a (job_id, step, metrics) table with from_step <= step <= to_step
  // (0 = no upper bound), in step order.
  template <typename Message>
  absl::StatusOr<std::vector<Message>> ReadStepRangeLocked(const char* table,
                                                           const std::string& job_id,
                                                           int64_t from_step, int64_t to_step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<sqlite3_stmt*> Prepare(absl::string_view sql, absl::string_view operation)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Exec(const char* sql, absl::string_view operation)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Commits when `status` is OK, else rolls back; returns the first failure.
  absl::Status FinishTransaction(absl::Status status, absl::string_view operation)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ApplyWrite(const JobWrite& write, std::vector<v1::JobEvent>& stored_events)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<bool> JobExists(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::vector<v1::Job>> QueryJobs(Statement& statement, absl::string_view operation)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReportWrite(double seconds) ABSL_LOCKS_EXCLUDED(mu_);

  const std::string path_;
  absl::Mutex mu_;
  sqlite3* const db_;  // Used under mu_ only.
  absl::flat_hash_map<absl::string_view, sqlite3_stmt*> statements_ ABSL_GUARDED_BY(mu_);
  std::function<void(double)> write_observer_ ABSL_GUARDED_BY(mu_);
  std::function<absl::Status(const std::string&)> write_failure_injector_ ABSL_GUARDED_BY(mu_);
  // The injected failure for a write of `id`, OK when none.
  absl::Status InjectedFailure(const std::string& id) ABSL_LOCKS_EXCLUDED(mu_);
};

}  // namespace tessera::coordinator

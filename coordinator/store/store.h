// Store: the coordinator's durable state in one database, SQLite (the default, a local file) or
// PostgreSQL (a postgresql:// URL; see docs/coordinator.md): jobs, their
// numbered events, step and eval metric points, checkpoints, nodes, the
// queues' fair-share usage and the job id counter. Everything one committed
// change of a job writes goes in one transaction (JobWrite), so a coordinator
// restarted after a crash reloads a consistent picture. The database runs in
// WAL mode with synchronous=FULL: a Commit that returned survives SIGKILL and
// power loss.
//
// Group commit: writes from concurrent callers (Commit, CommitAll, PutNode,
// DeleteNode, SaveQueueUsage, NextJobId, CommitNewJob) share one SQLite
// transaction and so one fsync. The first caller to find no transaction in
// progress becomes the leader: it takes every write queued so far, applies each inside its own
// SAVEPOINT (a write that fails is rolled back alone and only its caller sees the error), commits,
// and wakes the others; writes that arrive meanwhile form the next batch. Every caller still
// returns only once its write is durable (or has failed), so the guarantee above is unchanged; what
// is shared is the wait.
//
// Protobufs are stored as serialized blobs, next to the columns that queries
// filter and order on. A blob that does not parse is reported as DATA_LOSS,
// never a crash.
//
// Where it lives: the plumbing (connections, statement caches, the readers'
// pool, the group commit) is a Database (store_database.h): SqliteDatabase
// (sqlite_database.h) or PostgresDatabase (postgres_database.h), neither of
// which knows a table. The tables are the store's: the schema and its migrations in
// store_migrations.cc, and each family's SQL beside the Store methods that use
// it (store_jobs.cc, store_events.cc, store_metrics.cc, store_nodes.cc,
// store_queue_usage.cc; store_tables.h declares what store.cc composes into
// one JobWrite).
//
// Thread safety: every method may be called from any thread; the database
// serializes use of the writing connection under one mutex, reads share a
// small pool of read-only connections (one per read at a time), and the queue
// of writes waiting for the next group commit has a mutex of its own (taken
// before the writer's, never while holding it). The write observer is called
// after the mutexes are released, on the thread that led the commit, once per
// SQLite transaction.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "tessera/v1/checkpoint.pb.h"
#include "tessera/v1/job.pb.h"
#include "tessera/v1/metrics.pb.h"
#include "tessera/v1/node.pb.h"

namespace tessera::coordinator {

class Database;
class DbConnection;

// A checkpoint that retention deleted from its directory (Checkpoint.retired_steps of the
// commit that deleted it, at that commit's time).
struct CheckpointRetirement {
  int64_t step = 0;
  absl::Time time;
};

// Everything one committed change of a job writes, applied in ONE SQLite
// transaction, in this order: job upsert, events, metrics, evals, checkpoint
// upserts, checkpoint retirements.
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
  // Keyed (job_id, step), replaced likewise; `job_id` is set when empty. Reports arrive late and
  // out of order (a replaced attempt's, relayed after a partition heals): a checkpoint is not
  // recorded when its step's record is newer (create_time) or was retired after it was created
  // (a late report of a checkpoint retention already deleted).
  std::vector<v1::Checkpoint> checkpoints;
  // Retention: the records of these steps leave ListCheckpoints, unless recorded again by a
  // checkpoint created after the retirement. The store remembers the retirement (a row with
  // no checkpoint) so that the deleted checkpoint's late report stays out.
  std::vector<CheckpointRetirement> retired_checkpoints;
  // The job the write is about. Required; must match job->job_id() when set.
  // Without `job`, the job must already be stored (NOT_FOUND otherwise).
  std::string job_id;
  // The submission's idempotency key (SubmitJobRequest.request_id), recorded
  // with the job when non-empty (v1::Job has no field for it). A later write
  // with an empty request_id keeps the recorded one. Two jobs cannot share a
  // key: ALREADY_EXISTS.
  std::string request_id;
};

// One SQLite transaction of the group commit, as the write observer sees it.
struct StoreWriteStats {
  double seconds = 0;      // wall time, fsync included
  double cpu_seconds = 0;  // CPU time of the thread that led it (the writes are serial here)
  int writes = 0;          // the writes it applied, each in its savepoint (failed ones included)
};

// The queues' decayed fair-share usage (FairShareTracker::usage, fair_share.h) as saved across
// coordinator restarts: device-seconds per queue as of one time.
struct SavedQueueUsage {
  struct Usage {
    double gpu_seconds = 0;
    double cpu_slot_seconds = 0;
  };
  absl::Time as_of = absl::UnixEpoch();
  std::map<std::string, Usage> queues;
};

// How Store::Open reaches a PostgreSQL database (a SQLite file needs nothing).
struct StoreOptions {
  // A file whose first line is the PostgreSQL password (a mounted Secret); empty: libpq's own
  // PGPASSWORD or PGPASSFILE (~/.pgpass). Never put the password in the URL.
  std::string password_file;
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
  static constexpr int kSchemaVersion = 6;
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
  // As above, or, when `location` is a postgresql:// (or postgres://) URL, the same store in
  // that PostgreSQL database (postgres_database.h); migrated alike. Errors name the URL with its
  // password removed. A password file that cannot be read: FAILED_PRECONDITION naming it.
  static absl::StatusOr<std::unique_ptr<Store>> Open(const std::string& location,
                                                     const StoreOptions& options);
  // Whether Open(location) selects PostgreSQL.
  static bool IsPostgresUrl(const std::string& location);

  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // Applies `write` atomically and returns the events as stored (with
  // sequence, job_id and time). INVALID_ARGUMENT when job_id is empty or an
  // object names another job.
  absl::StatusOr<std::vector<v1::JobEvent>> Commit(const JobWrite& write);
  // Applies every write in ONE SQLite transaction (one fsync), each
  // atomically on its own: the result at index i is Commit(writes[i])'s. A
  // write that fails leaves no trace and does not stop the others; all that
  // succeed are durable together when this returns. Two writes of one job
  // are applied in order.
  std::vector<absl::StatusOr<std::vector<v1::JobEvent>>> CommitAll(
      const std::vector<JobWrite>& writes);

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
  // The key columns of a stored job, read without parsing its blob.
  struct JobSummary {
    std::string job_id;
    v1::JobState state = v1::JOB_STATE_UNSPECIFIED;
    int64_t create_time_ns = 0;
  };
  // What ListActiveJobs lists, in its order, as summaries: a scheduling pass needs only the
  // waiting jobs in full, and parsing every running job's blob cost more than the pass.
  absl::StatusOr<std::vector<JobSummary>> ListActiveJobSummaries();
  // Jobs PENDING or RESTARTING, oldest first (create_time, then job_id).
  absl::StatusOr<std::vector<v1::Job>> ListWaitingJobs();
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
  // The highest step h such that the job has a metric point for every step 1..h (0 when step 1
  // has none), looking no further than `up_to_step` (0: no bound): what a resuming attempt need
  // not report again (TrainerTask.metrics_complete_through_step). One row's read, whatever the
  // job's length: Commit keeps h per job (step_metrics_complete) as it stores metric points.
  absl::StatusOr<int64_t> MetricsCompleteThrough(const std::string& job_id, int64_t up_to_step);
  // Newest step first.
  absl::StatusOr<std::vector<v1::Checkpoint>> ListCheckpoints(const std::string& job_id);

  // Upsert by node_id (INVALID_ARGUMENT when empty).
  absl::Status PutNode(const v1::Node& node);
  // Removing an absent node is OK.
  absl::Status DeleteNode(const std::string& node_id);
  // Ordered by node_id.
  absl::StatusOr<std::vector<v1::Node>> ListNodes();

  // Replaces the saved queue usage with `usage`, in one transaction: a queue absent from it is
  // forgotten. INVALID_ARGUMENT for an empty queue name.
  absl::Status SaveQueueUsage(const SavedQueueUsage& usage);
  // What SaveQueueUsage saved last; nullopt when nothing was (or only an empty map).
  absl::StatusOr<std::optional<SavedQueueUsage>> LoadQueueUsage();

  // The next job id, durable and monotonic across restarts: "job-" + 8
  // lower-case hex digits of a counter kept in the database (from 1). An id
  // already taken by a stored job is skipped. RESOURCE_EXHAUSTED after 2^32-1
  // ids.
  absl::StatusOr<std::string> NextJobId();
  // A submission's first write, with the job's id allocated in the same transaction (one
  // commit and one fsync instead of NextJobId's and Commit's). `write` carries the job and no
  // id: its job_id, job->job_id and every event's and checkpoint's job_id are empty
  // (INVALID_ARGUMENT otherwise). Once the write is durable, write->job_id and
  // write->job->job_id hold the id NextJobId would have returned; a write that fails consumes
  // no id and leaves them empty. The failure injector is not consulted (the id is not known
  // before the transaction).
  absl::Status CommitNewJob(JobWrite* write);

  // Called for each committed SQLite transaction (one group commit of Commit, CommitAll,
  // PutNode, DeleteNode, NextJobId or CommitNewJob writes) with its wall time (the fsync
  // included), its CPU time and its writes: the store-write metrics. Pass nullptr to remove.
  void SetWriteObserver(std::function<void(const StoreWriteStats&)> observer);

  // The leader's fence (Database::SetFence, leader_election.h): checked at the start of every
  // write transaction; while it fails, every write fails with its status and nothing is stored.
  // Pass nullptr to remove.
  void SetWriteFence(std::function<absl::Status(DbConnection& writer)> fence);

  // Fault injection for tests of what sits on the store: before each write
  // (Commit, PutNode) `injector` is called with the write's job or node id; a
  // non-OK status it returns fails the write unapplied, as a real SQLite
  // error would. Pass nullptr to remove.
  void SetWriteFailureInjector(std::function<absl::Status(const std::string& id)> injector);

 private:
  explicit Store(std::unique_ptr<Database> database);

  // The checks Commit makes before queuing a write (ids, the injected failure).
  absl::Status CheckWrite(const JobWrite& write) ABSL_LOCKS_EXCLUDED(hooks_mu_);
  // The injected failure for a write of `id`, OK when none.
  absl::Status InjectedFailure(const std::string& id) ABSL_LOCKS_EXCLUDED(hooks_mu_);

  // The connections and the group commit; thread-safe on its own.
  const std::unique_ptr<Database> database_;
  // The failure injector has a mutex of its own: every write consults it before it is queued,
  // and waiting for the database's writer (a commit and its fsync) for that would be wasted.
  absl::Mutex hooks_mu_;
  std::function<absl::Status(const std::string&)> write_failure_injector_
      ABSL_GUARDED_BY(hooks_mu_);
};

}  // namespace tessera::coordinator

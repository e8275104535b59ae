// Store: the coordinator's durable state in one SQLite database: jobs, their
// numbered events, step and eval metric points, checkpoints, nodes and the job
// id counter. Everything one committed change of a job writes goes in one
// transaction (JobWrite), so a coordinator restarted after a crash reloads a
// consistent picture. The database runs in WAL mode with synchronous=FULL: a
// Commit that returned survives SIGKILL and power loss.
//
// Group commit: writes from concurrent callers (Commit, CommitAll, PutNode,
// DeleteNode, NextJobId, CommitNewJob) share one SQLite transaction and so one fsync. The
// first caller to find no transaction in progress becomes the leader: it
// takes every write queued so far, applies each inside its own SAVEPOINT (a
// write that fails is rolled back alone and only its caller sees the error),
// commits, and wakes the others; writes that arrive meanwhile form the next
// batch. Every caller still returns only once its write is durable (or has
// failed), so the guarantee above is unchanged; what is shared is the wait.
//
// Protobufs are stored as serialized blobs, next to the columns that queries
// filter and order on. A blob that does not parse is reported as DATA_LOSS,
// never a crash.
//
// Thread safety: every method may be called from any thread; one absl::Mutex
// (mu_) serializes use of the writing connection, reads share a small pool of
// read-only connections (one per read at a time), and queue_mu_ guards the
// queue of writes waiting for the next group commit (taken before mu_, never
// while holding it). The write observer is called after the mutexes are
// released, on the thread that led the commit, once per SQLite transaction.
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
#include "absl/functional/function_ref.h"
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

// One SQLite transaction of the group commit, as the write observer sees it.
struct StoreWriteStats {
  double seconds = 0;      // wall time, fsync included
  double cpu_seconds = 0;  // CPU time of the thread that led it (the writes are serial here)
  int writes = 0;          // the writes it applied, each in its savepoint (failed ones included)
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
  static constexpr int kSchemaVersion = 3;
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

  // Fault injection for tests of what sits on the store: before each write
  // (Commit, PutNode) `injector` is called with the write's job or node id; a
  // non-OK status it returns fails the write unapplied, as a real SQLite
  // error would. Pass nullptr to remove.
  void SetWriteFailureInjector(std::function<absl::Status(const std::string& id)> injector);

 private:
  // The last event sequence stored for `job_id` (0 without events), on `db` through `prepare`:
  // the writer's connection or a reader's.
  static absl::StatusOr<int64_t> LastSequence(
      sqlite3* db, absl::FunctionRef<absl::StatusOr<sqlite3_stmt*>(absl::string_view sql)> prepare,
      const std::string& job_id, absl::string_view operation);
  Store(sqlite3* db, std::string path);

  // A cached prepared statement, reset and cleared when the object dies.
  class Statement;
  // One write waiting for a group commit: `apply` runs under mu_ inside the
  // batch's transaction; `status` and `done` are set by the leader.
  struct QueuedWrite {
    std::function<absl::Status()> apply;
    absl::Status status;
    bool done = false;
  };

  // Queues `writes` (all in the same batch) and returns once they are
  // committed or failed, leading the commit when no other caller is.
  void GroupCommit(const std::vector<QueuedWrite*>& writes) ABSL_LOCKS_EXCLUDED(mu_, queue_mu_);
  // One transaction over `batch`; returns its times for the observer.
  StoreWriteStats RunBatch(const std::vector<QueuedWrite*>& batch) ABSL_LOCKS_EXCLUDED(mu_);
  // The checks Commit makes before queuing a write (ids, the injected failure).
  absl::Status CheckWrite(const JobWrite& write) ABSL_LOCKS_EXCLUDED(mu_);

  absl::Status Configure() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Migrate() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Rows of a (job_id, step, metrics) table with from_step <= step <= to_step
  // (0 = no upper bound), in step order.
  template <typename Message>
  absl::StatusOr<std::vector<Message>> ReadStepRange(const char* table, const std::string& job_id,
                                                     int64_t from_step, int64_t to_step);
  absl::StatusOr<sqlite3_stmt*> Prepare(absl::string_view sql, absl::string_view operation)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs one statement that returns no rows, prepared once (the transaction and savepoint
  // statements of every group commit).
  absl::Status Run(absl::string_view sql, absl::string_view operation)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FAILED_PRECONDITION unless `pragma` reads `want`.
  absl::Status ExpectPragma(const char* pragma, int64_t want, absl::string_view operation)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Inserts the job's row, or updates it (JobWrite::job, request_id).
  absl::Status UpsertJob(const std::string& job_id, const v1::Job& job,
                         const std::string& request_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Exec(const char* sql, absl::string_view operation)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Commits when `status` is OK, else rolls back; returns the first failure.
  absl::Status FinishTransaction(absl::Status status, absl::string_view operation)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ApplyWrite(const JobWrite& write, std::vector<v1::JobEvent>& stored_events)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<bool> JobExists(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // NextJobId's step inside a batch's transaction.
  absl::StatusOr<std::string> AllocateJobIdLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static absl::StatusOr<std::vector<v1::Job>> QueryJobs(Statement& statement,
                                                         absl::string_view operation);
  void ReportWrite(const StoreWriteStats& stats) ABSL_LOCKS_EXCLUDED(mu_);

  // The connection a read uses, held for the read: an idle reader when there are readers (it
  // waits for one when all are busy), else db_ (under mu_).
  class ReadLock;
  // A read-only connection and the statements prepared on it: used by one ReadLock at a time.
  struct Reader;

  const std::string path_;
  absl::Mutex mu_;
  sqlite3* const db_;  // Used under mu_ only.
  absl::flat_hash_map<std::string, sqlite3_stmt*> statements_ ABSL_GUARDED_BY(mu_);
  // Reads go through read-only connections (file databases only), so that they never wait for a
  // group commit and its fsync on db_: in WAL mode each reads the last committed state while a
  // transaction is open on db_. There are several, so that readers on different threads (the
  // scheduler pass's listings, reports, RPCs) do not queue behind one another. Empty for
  // ":memory:" (reads then use db_). Set once by Open.
  std::vector<std::unique_ptr<Reader>> readers_;
  absl::Mutex read_mu_;
  std::vector<Reader*> idle_readers_ ABSL_GUARDED_BY(read_mu_);
  // The test and metrics hooks have a mutex of their own: every write consults them, and
  // taking mu_ for that would wait for the commit in progress (its fsync included).
  absl::Mutex hooks_mu_;
  std::function<void(const StoreWriteStats&)> write_observer_ ABSL_GUARDED_BY(hooks_mu_);
  absl::Mutex queue_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  std::vector<QueuedWrite*> queued_ ABSL_GUARDED_BY(queue_mu_);
  bool committing_ ABSL_GUARDED_BY(queue_mu_) = false;
  std::function<absl::Status(const std::string&)> write_failure_injector_
      ABSL_GUARDED_BY(hooks_mu_);
  // The injected failure for a write of `id`, OK when none.
  absl::Status InjectedFailure(const std::string& id) ABSL_LOCKS_EXCLUDED(mu_);
};

}  // namespace tessera::coordinator

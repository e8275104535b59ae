// Store (store.h): opening the database, the checks on a write, and a JobWrite composed from
// each table's part (store_tables.h) into one write of the group commit. The tables' reads are
// in store_jobs.cc, store_events.cc, store_metrics.cc and store_nodes.cc; the engines' plumbing in
// sqlite_database.cc and postgres_database.cc. Thread safety as store.h says.
#include "coordinator/store/store.h"

#include <fstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "coordinator/store/postgres_database.h"
#include "coordinator/store/sqlite_database.h"
#include "coordinator/store/store_tables.h"

namespace tessera::coordinator {
namespace {

// Applies one JobWrite on the writer, in JobWrite's order: the job row, events, metric points,
// evaluations, checkpoint upserts, checkpoint deletions.
absl::Status ApplyWrite(DbConnection& writer, const JobWrite& write,
                        std::vector<v1::JobEvent>& stored_events) {
  // A batch whose other write failed applies this one again (Database::RunBatch).
  stored_events.clear();
  const std::string& job_id = write.job_id;
  if (write.job.has_value()) {
    RETURN_IF_ERROR(store_internal::UpsertJob(writer, job_id, *write.job, write.request_id));
  } else {
    ASSIGN_OR_RETURN(bool exists, store_internal::JobExists(writer, job_id));
    if (!exists) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
    if (!write.request_id.empty()) {
      RETURN_IF_ERROR(store_internal::RecordRequestId(writer, job_id, write.request_id));
    }
  }
  if (!write.events.empty()) {
    RETURN_IF_ERROR(store_internal::AppendEvents(writer, job_id, write.events, stored_events));
  }
  return store_internal::WriteStepRecords(writer, write);
}

// The first line of `path`, without its line end.
absl::StatusOr<std::string> ReadPasswordFile(const std::string& path) {
  std::ifstream file(path);
  std::string password;
  if (!file || !std::getline(file, password)) {
    return absl::FailedPreconditionError(
        absl::StrCat("store: database password file '", path, "' cannot be read"));
  }
  if (!password.empty() && password.back() == '\r') password.pop_back();
  if (password.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("store: database password file '", path, "' is empty"));
  }
  return password;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Store>> Store::Open(const std::string& path) {
  return Open(path, StoreOptions{});
}

bool Store::IsPostgresUrl(const std::string& location) {
  return absl::StartsWith(location, "postgresql://") || absl::StartsWith(location, "postgres://");
}

absl::StatusOr<std::unique_ptr<Store>> Store::Open(const std::string& location,
                                                   const StoreOptions& options) {
  if (IsPostgresUrl(location)) {
    PostgresDatabase::Options postgres;
    postgres.url = location;
    if (!options.password_file.empty()) {
      ASSIGN_OR_RETURN(postgres.password, ReadPasswordFile(options.password_file));
    }
    const std::string name = RedactPostgresUrl(location);
    postgres.migrate = [&name](DbConnection& writer) {
      return store_internal::MigrateSchema(writer, name);
    };
    ASSIGN_OR_RETURN(std::unique_ptr<PostgresDatabase> database, PostgresDatabase::Open(postgres));
    return std::unique_ptr<Store>(new Store(std::move(database)));
  }
  SqliteDatabase::Options sqlite;
  sqlite.busy_timeout_ms = kBusyTimeoutMs;
  sqlite.migrate = [&location](DbConnection& writer) {
    return store_internal::MigrateSchema(writer, location);
  };
  ASSIGN_OR_RETURN(std::unique_ptr<SqliteDatabase> database,
                   SqliteDatabase::Open(location, sqlite));
  return std::unique_ptr<Store>(new Store(std::move(database)));
}

Store::Store(std::unique_ptr<Database> database) : database_(std::move(database)) {}

Store::~Store() = default;

absl::Status Store::CheckWrite(const JobWrite& write) {
  if (write.job_id.empty()) return absl::InvalidArgumentError("store: job_id is empty");
  RETURN_IF_ERROR(InjectedFailure(write.job_id));
  if (write.job.has_value() && write.job->job_id() != write.job_id) {
    return absl::InvalidArgumentError(absl::StrCat("store: job.job_id '", write.job->job_id(),
                                                   "' does not match job_id '", write.job_id, "'"));
  }
  for (size_t i = 0; i < write.events.size(); ++i) {
    const std::string& event_job = write.events[i].job_id();
    if (!event_job.empty() && event_job != write.job_id) {
      return absl::InvalidArgumentError(absl::StrCat("store: events[", i, "].job_id '", event_job,
                                                     "' does not match job_id '", write.job_id,
                                                     "'"));
    }
  }
  for (size_t i = 0; i < write.checkpoints.size(); ++i) {
    const std::string& checkpoint_job = write.checkpoints[i].job_id();
    if (!checkpoint_job.empty() && checkpoint_job != write.job_id) {
      return absl::InvalidArgumentError(absl::StrCat("store: checkpoints[", i, "].job_id '",
                                                     checkpoint_job, "' does not match job_id '",
                                                     write.job_id, "'"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<v1::JobEvent>> Store::Commit(const JobWrite& write) {
  std::vector<absl::StatusOr<std::vector<v1::JobEvent>>> results = CommitAll({write});
  return std::move(results.front());
}

std::vector<absl::StatusOr<std::vector<v1::JobEvent>>> Store::CommitAll(
    const std::vector<JobWrite>& writes) {
  std::vector<absl::StatusOr<std::vector<v1::JobEvent>>> results(writes.size());
  std::vector<std::vector<v1::JobEvent>> stored_events(writes.size());
  std::vector<Database::QueuedWrite> queued(writes.size());
  std::vector<Database::QueuedWrite*> to_commit;
  for (size_t i = 0; i < writes.size(); ++i) {
    if (absl::Status checked = CheckWrite(writes[i]); !checked.ok()) {
      results[i] = std::move(checked);
      continue;
    }
    queued[i].apply = [&write = writes[i], &events = stored_events[i]](DbConnection& writer) {
      return ApplyWrite(writer, write, events);
    };
    to_commit.push_back(&queued[i]);
  }
  database_->GroupCommit(to_commit);
  for (size_t i = 0; i < writes.size(); ++i) {
    if (!queued[i].apply) continue;
    if (queued[i].status.ok()) {
      results[i] = std::move(stored_events[i]);
    } else {
      results[i] = std::move(queued[i].status);
    }
  }
  return results;
}

absl::Status Store::CommitNewJob(JobWrite* write) {
  if (!write->job_id.empty() || !write->job.has_value() || !write->job->job_id().empty()) {
    return absl::InvalidArgumentError(
        "store: a new job's write carries a job and no job_id (the store assigns it)");
  }
  for (const v1::JobEvent& event : write->events) {
    if (!event.job_id().empty()) {
      return absl::InvalidArgumentError("store: a new job's events cannot name a job_id");
    }
  }
  for (const v1::Checkpoint& checkpoint : write->checkpoints) {
    if (!checkpoint.job_id().empty()) {
      return absl::InvalidArgumentError("store: a new job's checkpoints cannot name a job_id");
    }
  }
  std::vector<v1::JobEvent> stored_events;
  Database::QueuedWrite queued;
  queued.apply = [write, &stored_events](DbConnection& writer) -> absl::Status {
    ASSIGN_OR_RETURN(write->job_id, store_internal::AllocateJobId(writer));
    write->job->set_job_id(write->job_id);
    return ApplyWrite(writer, *write, stored_events);
  };
  database_->GroupCommit({&queued});
  if (!queued.status.ok()) {
    write->job_id.clear();
    write->job->clear_job_id();
  }
  return queued.status;
}

void Store::SetWriteObserver(std::function<void(const StoreWriteStats&)> observer) {
  if (!observer) {
    database_->SetCommitObserver(nullptr);
    return;
  }
  database_->SetCommitObserver([observer = std::move(observer)](const DatabaseCommitStats& commit) {
    observer(StoreWriteStats{
        .seconds = commit.seconds, .cpu_seconds = commit.cpu_seconds, .writes = commit.writes});
  });
}

void Store::SetWriteFence(std::function<absl::Status(DbConnection& writer)> fence) {
  database_->SetFence(std::move(fence));
}

void Store::SetWriteFailureInjector(std::function<absl::Status(const std::string&)> injector) {
  absl::MutexLock lock(&hooks_mu_);
  write_failure_injector_ = std::move(injector);
}

absl::Status Store::InjectedFailure(const std::string& id) {
  std::function<absl::Status(const std::string&)> injector;
  {
    absl::MutexLock lock(&hooks_mu_);
    injector = write_failure_injector_;
  }
  return injector ? injector(id) : absl::OkStatus();
}

}  // namespace tessera::coordinator

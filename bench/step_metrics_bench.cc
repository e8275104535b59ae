// step_metrics_bench: what step metrics cost on a long job, each against a baseline measured in
// the same run (medians of --runs).
//
// The coordinator side, on SQLite and on a private PostgreSQL (tests/util/postgres_cluster.h), for a
// job of --points metric rows: Store::MetricsCompleteThrough (what a restart's scheduling pass
// reads) against the store's ReadMetrics of the same job, and against the scan it replaced (every
// step from 1, in order, as the store read it before step_metrics_complete). Also a 10-point
// report's Commit, which keeps that mark, and the one-off Commit that fills a gap at step 2 and
// so moves the mark over every row.
//
// The trainer side: rank 0's per-save snapshot of the last 10,000 points (StepMetricsLog::
// EncodedUpTo on the training thread, then WriteEncodedStepMetricsFile: write, XXH3-128) against
// the snapshot as it was (each point's message copied, then serialized) and against writing one
// model shard of --shard_mb through the same WriteHashedFile.
//
// Writes $TESSERA_BENCH_RESULTS/step_metrics.json.
#include <libpq-fe.h>
#include <sqlite3.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench_env.h"
#include "common/command_line.h"
#include "tests/util/postgres_cluster.h"
#include "common/status_macros.h"
#include "coordinator/store/store.h"
#include "nlohmann/json.hpp"
#include "tessera/v1/metrics.pb.h"
#include "trainer/io/checkpoint.h"
#include "trainer/io/step_metrics_log.h"

ABSL_FLAG(std::string, points, "100000,1000000",
          "Metric rows of the long job, one store run per value (comma-separated).");
ABSL_FLAG(std::string, backends, "",
          "sqlite, postgres or both (comma-separated); empty: both, PostgreSQL when its server "
          "binaries are there.");
ABSL_FLAG(int, runs, 7, "Timed runs of each measurement; the median is reported.");
ABSL_FLAG(int, shard_mb, 48,
          "The baseline model shard's size in MB (48: about 4M parameters' fp32 weights and "
          "AdamW moments).");
ABSL_FLAG(std::string, dir, "", "Scratch directory's parent; empty: $TMPDIR or /tmp.");

namespace tessera::bench {
namespace {

using Json = nlohmann::json;
constexpr char kJobId[] = "job-long-0001";
constexpr char kGapJobId[] = "job-gap-0002";
constexpr int kReportPoints = 10;

double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

// Runs `body` `runs` times; the median of its wall times, in seconds. Stops at its first error.
absl::StatusOr<double> MedianSeconds(int runs, const std::function<absl::Status()>& body) {
  std::vector<double> times;
  for (int i = 0; i < runs; ++i) {
    const auto start = std::chrono::steady_clock::now();
    RETURN_IF_ERROR(body());
    times.push_back(Seconds(std::chrono::steady_clock::now() - start));
  }
  return Median(times);
}

// A point as rank 0 reports it: every scalar, the step breakdown with three collectives.
v1::StepMetrics RealisticPoint(int64_t step) {
  v1::StepMetrics point;
  point.set_step(step);
  point.set_loss(3.25 - 1e-6 * step);
  point.set_grad_norm(0.84);
  point.set_learning_rate(3e-4);
  point.set_tokens_per_second(412345.5);
  point.set_samples_per_second(201.3);
  point.set_mfu(0.41);
  point.set_step_time_seconds(0.318);
  point.set_peak_memory_bytes(int64_t{61} << 30);
  point.set_tokens_seen(step * 131072);
  point.mutable_time()->set_seconds(1790000000 + step);
  point.mutable_time()->set_nanos(123456789);
  point.set_epoch(0.001 * step);
  point.set_max_steps(1000000);
  point.set_checkpoint_blocked_seconds(0.002);
  v1::StepTimeBreakdown* breakdown = point.mutable_breakdown();
  breakdown->set_forward_seconds(0.1);
  breakdown->set_backward_seconds(0.18);
  breakdown->set_optimizer_seconds(0.02);
  breakdown->set_data_wait_seconds(0.001);
  breakdown->set_other_seconds(0.017);
  for (const char* kind : {"all_reduce", "reduce_scatter", "all_gather"}) {
    v1::CollectiveTime* collective = breakdown->add_collectives();
    collective->set_kind(kind);
    collective->set_dim("data");
    collective->set_seconds(0.004);
    collective->set_calls(12);
    collective->set_bytes(int64_t{1} << 28);
  }
  return point;
}

// The scan MetricsCompleteThrough ran before step_metrics_complete, on a connection of its own.
class ScanBaseline {
 public:
  virtual ~ScanBaseline() = default;
  virtual absl::StatusOr<int64_t> CompleteThrough() = 0;
  // Stores steps from..to of the job behind the store's back, each with `blob`: filling a long
  // job through Commit would take minutes on PostgreSQL.
  virtual absl::Status BulkInsert(int64_t from, int64_t to, const std::string& blob) = 0;
};

constexpr char kScanSql[] =
    "SELECT step FROM step_metrics WHERE job_id = ?1 AND step >= 1 ORDER BY step";

class SqliteScan final : public ScanBaseline {
 public:
  static absl::StatusOr<std::unique_ptr<SqliteScan>> Open(const std::string& path) {
    sqlite3* db = nullptr;
    if (sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READWRITE, nullptr) != SQLITE_OK) {
      const std::string error = db != nullptr ? sqlite3_errmsg(db) : "out of memory";
      sqlite3_close(db);
      return absl::UnavailableError(absl::StrCat(path, ": ", error));
    }
    sqlite3_busy_timeout(db, 10000);
    return std::unique_ptr<SqliteScan>(new SqliteScan(db, path));
  }
  ~SqliteScan() override { sqlite3_close(db_); }

  absl::StatusOr<int64_t> CompleteThrough() override {
    sqlite3_stmt* select = nullptr;
    RETURN_IF_ERROR(Check(sqlite3_prepare_v2(db_, kScanSql, -1, &select, nullptr)));
    sqlite3_bind_text(select, 1, kJobId, -1, SQLITE_STATIC);
    int64_t complete = 0;
    int rc;
    while ((rc = sqlite3_step(select)) == SQLITE_ROW &&
           sqlite3_column_int64(select, 0) == complete + 1) {
      ++complete;
    }
    sqlite3_finalize(select);
    if (rc != SQLITE_ROW && rc != SQLITE_DONE) return Check(rc);
    return complete;
  }

  absl::Status BulkInsert(int64_t from, int64_t to, const std::string& blob) override {
    sqlite3_stmt* insert = nullptr;
    RETURN_IF_ERROR(Check(sqlite3_prepare_v2(db_, R"sql(
WITH RECURSIVE steps(step) AS (SELECT ?2 UNION ALL SELECT step + 1 FROM steps WHERE step < ?3)
INSERT INTO step_metrics (job_id, step, metrics) SELECT ?1, step, ?4 FROM steps)sql",
                                             -1, &insert, nullptr)));
    sqlite3_bind_text(insert, 1, kJobId, -1, SQLITE_STATIC);
    sqlite3_bind_int64(insert, 2, from);
    sqlite3_bind_int64(insert, 3, to);
    sqlite3_bind_blob(insert, 4, blob.data(), static_cast<int>(blob.size()), SQLITE_STATIC);
    const int rc = sqlite3_step(insert);
    sqlite3_finalize(insert);
    return rc == SQLITE_DONE ? absl::OkStatus() : Check(rc);
  }

 private:
  SqliteScan(sqlite3* db, std::string path) : db_(db), path_(std::move(path)) {}
  absl::Status Check(int rc) {
    if (rc == SQLITE_OK) return absl::OkStatus();
    return absl::InternalError(absl::StrCat(path_, ": ", sqlite3_errmsg(db_)));
  }
  sqlite3* db_;
  std::string path_;
};

class PostgresScan final : public ScanBaseline {
 public:
  static absl::StatusOr<std::unique_ptr<PostgresScan>> Open(const std::string& url) {
    PGconn* conn = PQconnectdb(url.c_str());
    if (PQstatus(conn) != CONNECTION_OK) {
      const std::string error = PQerrorMessage(conn);
      PQfinish(conn);
      return absl::UnavailableError(absl::StrCat(url, ": ", error));
    }
    return std::unique_ptr<PostgresScan>(new PostgresScan(conn));
  }
  ~PostgresScan() override { PQfinish(conn_); }

  absl::StatusOr<int64_t> CompleteThrough() override {
    const char* values[] = {kJobId};
    PGresult* result = PQexecParams(
        conn_, "SELECT step FROM step_metrics WHERE job_id = $1 AND step >= 1 ORDER BY step", 1,
        nullptr, values, nullptr, nullptr, 0);
    if (PQresultStatus(result) != PGRES_TUPLES_OK) return Error(result);
    int64_t complete = 0;
    const int rows = PQntuples(result);
    for (int row = 0; row < rows; ++row) {
      int64_t step = 0;
      if (!absl::SimpleAtoi(PQgetvalue(result, row, 0), &step) || step != complete + 1) break;
      ++complete;
    }
    PQclear(result);
    return complete;
  }

  absl::Status BulkInsert(int64_t from, int64_t to, const std::string& blob) override {
    const std::string from_text = absl::StrCat(from);
    const std::string to_text = absl::StrCat(to);
    const char* values[] = {kJobId, from_text.c_str(), to_text.c_str(), blob.data()};
    const int lengths[] = {0, 0, 0, static_cast<int>(blob.size())};
    const int formats[] = {0, 0, 0, 1};
    PGresult* result =
        PQexecParams(conn_,
                     "INSERT INTO step_metrics (job_id, step, metrics) "
                     "SELECT $1, g, $4::bytea FROM generate_series($2::bigint, $3::bigint) g",
                     4, nullptr, values, lengths, formats, 0);
    if (PQresultStatus(result) != PGRES_COMMAND_OK) return Error(result);
    PQclear(result);
    return absl::OkStatus();
  }

 private:
  explicit PostgresScan(PGconn* conn) : conn_(conn) {}
  absl::Status Error(PGresult* result) {
    const std::string error = PQresultErrorMessage(result);
    PQclear(result);
    return absl::InternalError(absl::StrCat("postgres: ", error));
  }
  PGconn* conn_;
};

struct StoreFigures {
  std::string backend;
  int64_t points = 0;
  double fill_gap_seconds = 0;  // One run: the Commit that moves the mark over every row.
  double complete_through_seconds = 0;
  double read_metrics_seconds = 0;
  double scan_seconds = 0;
  double report_commit_seconds = 0;
  double report_commit_no_mark_seconds = 0;
};

absl::StatusOr<StoreFigures> MeasureStore(const std::string& backend, const std::string& location,
                                          int64_t points, int runs) {
  using coordinator::JobWrite;
  using coordinator::Store;
  StoreFigures figures{.backend = backend, .points = points};
  ASSIGN_OR_RETURN(std::unique_ptr<Store> store, Store::Open(location, {}));
  {
    JobWrite submit;
    submit.job_id = kJobId;
    v1::Job& job = submit.job.emplace();
    job.set_job_id(kJobId);
    job.set_state(v1::JOB_STATE_RUNNING);
    job.mutable_spec()->set_name("long");
    job.mutable_create_time()->set_seconds(1790000000);
    submit.metrics = {RealisticPoint(1)};
    RETURN_IF_ERROR(store->Commit(submit).status());
  }
  std::unique_ptr<ScanBaseline> scan;
  if (backend == "postgres") {
    ASSIGN_OR_RETURN(scan, PostgresScan::Open(location));
  } else {
    ASSIGN_OR_RETURN(scan, SqliteScan::Open(location));
  }
  std::string blob;
  RealisticPoint(points / 2).SerializeToString(&blob);
  std::cout << absl::StrFormat("  %s, %d rows: filling (points of %d bytes)\n", backend, points,
                               blob.size())
            << std::flush;
  RETURN_IF_ERROR(scan->BulkInsert(3, points, blob));

  // Step 2 arrives last (a replay): the mark moves from 1 over every row.
  JobWrite fill;
  fill.job_id = kJobId;
  fill.metrics = {RealisticPoint(2)};
  auto start = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(store->Commit(fill).status());
  figures.fill_gap_seconds = Seconds(std::chrono::steady_clock::now() - start);

  auto expect = [&](const absl::StatusOr<int64_t>& complete, int64_t want,
                    const char* what) -> absl::Status {
    if (!complete.ok()) return complete.status();
    if (*complete != want) {
      return absl::InternalError(absl::StrCat(what, " says ", *complete, ", not ", want));
    }
    return absl::OkStatus();
  };
  ASSIGN_OR_RETURN(figures.complete_through_seconds, MedianSeconds(runs, [&]() {
                     return expect(store->MetricsCompleteThrough(kJobId, 0), points,
                                   "MetricsCompleteThrough");
                   }));
  ASSIGN_OR_RETURN(figures.scan_seconds, MedianSeconds(runs, [&]() {
                     return expect(scan->CompleteThrough(), points, "the scan");
                   }));
  ASSIGN_OR_RETURN(
      figures.read_metrics_seconds, MedianSeconds(runs, [&]() -> absl::Status {
        ASSIGN_OR_RETURN(std::vector<v1::StepMetrics> read, store->ReadMetrics(kJobId, 0, 0));
        if (static_cast<int64_t>(read.size()) != points) {
          return absl::InternalError(absl::StrCat("ReadMetrics read ", read.size(), " points"));
        }
        return absl::OkStatus();
      }));
  // 10-point reports, alternately to this job (the mark moves by 10) and to a job without step 1,
  // whose mark never moves: that commit reads the mark and stops, so it costs a report without
  // the mark's upkeep but that read. Alternated so that both meet the same WAL and cache state;
  // 5 x --runs of each (a commit is an fsync: noisy).
  {
    JobWrite submit;
    v1::Job& job = submit.job.emplace();
    job.set_job_id(kGapJobId);
    job.set_state(v1::JOB_STATE_RUNNING);
    job.mutable_spec()->set_name("gap");
    job.mutable_create_time()->set_seconds(1790000001);
    submit.job_id = kGapJobId;
    RETURN_IF_ERROR(store->Commit(submit).status());
  }
  int64_t next = points + 1;
  int64_t gap_next = 2;
  std::vector<double> tip_times;
  std::vector<double> gap_times;
  for (int i = 0; i < 5 * runs; ++i) {
    for (const bool tip : {true, false}) {
      JobWrite report;
      report.job_id = tip ? kJobId : kGapJobId;
      int64_t& step = tip ? next : gap_next;
      for (int p = 0; p < kReportPoints; ++p) report.metrics.push_back(RealisticPoint(step++));
      const auto start = std::chrono::steady_clock::now();
      RETURN_IF_ERROR(store->Commit(report).status());
      (tip ? tip_times : gap_times).push_back(Seconds(std::chrono::steady_clock::now() - start));
    }
  }
  figures.report_commit_seconds = Median(tip_times);
  figures.report_commit_no_mark_seconds = Median(gap_times);
  RETURN_IF_ERROR(expect(store->MetricsCompleteThrough(kJobId, 0), next - 1,
                         "MetricsCompleteThrough after the reports"));
  RETURN_IF_ERROR(expect(store->MetricsCompleteThrough(kGapJobId, 0), 0,
                         "MetricsCompleteThrough of the job without step 1"));
  return figures;
}

struct SnapshotFigures {
  int64_t points = 0;
  int64_t file_bytes = 0;
  // On the training thread: the snapshot (StepMetricsLog::EncodedUpTo, bytes copied).
  double snapshot_seconds = 0;
  // On the checkpoint thread: write and XXH3-128 of step_metrics.pb.
  double write_file_seconds = 0;
  // The snapshot as it was: each point's message copied into a v1::StepMetricsLog on the
  // training thread, serialized on the checkpoint thread.
  double message_copy_seconds = 0;
  double message_serialize_seconds = 0;
  double shard_seconds = 0;
};

absl::StatusOr<SnapshotFigures> MeasureSnapshot(const std::string& dir, int shard_mb, int runs) {
  trainer::StepMetricsLog log;
  std::map<int64_t, v1::StepMetrics> messages;
  // A long run: the log holds its capacity, and the save's step is the newest.
  const int64_t last_step = 3 * static_cast<int64_t>(trainer::kStepMetricsLogCapacity);
  for (int64_t step = 1; step <= last_step; ++step) {
    const v1::StepMetrics point = RealisticPoint(step);
    log.Add(point);
    messages[step] = point;
    if (messages.size() > trainer::kStepMetricsLogCapacity) messages.erase(messages.begin());
  }
  SnapshotFigures figures;
  std::string encoded;
  ASSIGN_OR_RETURN(figures.snapshot_seconds, MedianSeconds(runs, [&]() {
                     encoded = log.EncodedUpTo(last_step);
                     return absl::OkStatus();
                   }));
  ASSIGN_OR_RETURN(figures.write_file_seconds, MedianSeconds(runs, [&]() -> absl::Status {
                     ASSIGN_OR_RETURN(v1::CheckpointFile file,
                                      trainer::WriteEncodedStepMetricsFile(dir, encoded));
                     figures.file_bytes = file.size_bytes();
                     return absl::OkStatus();
                   }));
  v1::StepMetricsLog copied;
  ASSIGN_OR_RETURN(figures.message_copy_seconds, MedianSeconds(runs, [&]() {
                     copied.Clear();
                     for (const auto& [step, point] : messages) *copied.add_points() = point;
                     return absl::OkStatus();
                   }));
  figures.points = copied.points_size();
  std::string serialized;
  ASSIGN_OR_RETURN(figures.message_serialize_seconds, MedianSeconds(runs, [&]() -> absl::Status {
                     serialized.clear();
                     if (!copied.SerializeToString(&serialized)) {
                       return absl::InternalError("cannot serialize the copied log");
                     }
                     return absl::OkStatus();
                   }));
  if (serialized != encoded) {
    return absl::InternalError("the encoded snapshot differs from the serialized messages");
  }
  const std::string shard(static_cast<size_t>(shard_mb) << 20, '\x5a');
  const std::string shard_path = absl::StrCat(dir, "/shard.bin");
  ASSIGN_OR_RETURN(
      figures.shard_seconds, MedianSeconds(runs, [&]() -> absl::Status {
        size_t written = 0;
        RETURN_IF_ERROR(trainer::WriteHashedFile(shard_path, [&](const trainer::ByteSink& sink) {
                          written = sink(shard.data(), shard.size());
                        }).status());
        if (written != shard.size()) return absl::DataLossError(shard_path);
        return absl::OkStatus();
      }));
  return figures;
}

struct Options {
  std::vector<int64_t> points;
  std::vector<std::string> backends;
  int runs = 7;
  int shard_mb = 48;
  std::string parent_dir;
};

absl::StatusOr<Options> ReadOptions() {
  Options options;
  for (absl::string_view text :
       absl::StrSplit(absl::GetFlag(FLAGS_points), ',', absl::SkipWhitespace())) {
    int64_t points = 0;
    if (!absl::SimpleAtoi(text, &points) || points < 3) {
      return absl::InvalidArgumentError(
          absl::StrCat("--points: '", text, "' is not a number of rows of at least 3"));
    }
    options.points.push_back(points);
  }
  const std::string bin_dir = EnvOr(kPostgresBinDirEnv, kDefaultPostgresBinDir);
  for (absl::string_view name :
       absl::StrSplit(absl::GetFlag(FLAGS_backends), ',', absl::SkipWhitespace())) {
    if (name != "sqlite" && name != "postgres") {
      return absl::InvalidArgumentError(
          absl::StrCat("--backends: unknown backend '", name, "' (sqlite or postgres)"));
    }
    options.backends.emplace_back(name);
  }
  if (options.backends.empty()) {
    options.backends.push_back("sqlite");
    if (access((bin_dir + "/initdb").c_str(), X_OK) == 0) {
      options.backends.push_back("postgres");
    } else {
      std::cout << "step_metrics_bench: postgres skipped: no PostgreSQL server binaries in "
                << bin_dir << " (set " << kPostgresBinDirEnv << ")\n";
    }
  }
  options.runs = absl::GetFlag(FLAGS_runs);
  if (options.runs < 1) return absl::InvalidArgumentError("--runs: must be at least 1");
  options.shard_mb = absl::GetFlag(FLAGS_shard_mb);
  if (options.shard_mb < 1) return absl::InvalidArgumentError("--shard_mb: must be at least 1");
  options.parent_dir = absl::GetFlag(FLAGS_dir);
  if (options.parent_dir.empty()) options.parent_dir = EnvOr("TMPDIR", "/tmp");
  return options;
}

absl::Status Run(const Options& options) {
  std::string scratch = absl::StrCat(options.parent_dir, "/step_metrics_bench.XXXXXX");
  if (mkdtemp(scratch.data()) == nullptr) {
    return absl::InternalError(absl::StrCat(scratch, ": cannot create the scratch directory"));
  }
  struct RemoveScratch {
    std::string path;
    ~RemoveScratch() {
      std::error_code ignored;
      std::filesystem::remove_all(path, ignored);
    }
  } remove_scratch{scratch};

  Json json;
  const Provenance provenance = ReadProvenance();
  json["benchmark"] = "step_metrics";
  json["commit"] = provenance.commit;
  json["date"] = provenance.date;
  json["machine"] = provenance.machine;
  json["runs"] = options.runs;

  std::cout << "step_metrics_bench: snapshot of the last " << trainer::kStepMetricsLogCapacity
            << " points against a " << options.shard_mb << " MB model shard, in " << scratch << "\n"
            << std::flush;
  ASSIGN_OR_RETURN(SnapshotFigures snapshot,
                   MeasureSnapshot(scratch, options.shard_mb, options.runs));
  const double total = snapshot.snapshot_seconds + snapshot.write_file_seconds;
  const double was_total = snapshot.message_copy_seconds + snapshot.message_serialize_seconds +
                           snapshot.write_file_seconds;
  std::cout << absl::StrFormat(
      "  snapshot on the training thread: %.3f ms (copying the messages, as before: %.2f ms; "
      "ratio %.3f)\n"
      "  step_metrics.pb (%.2f MB): write + XXH3-128 %.2f ms (serializing the copied messages "
      "first, as before: +%.2f ms)\n"
      "  whole: %.2f ms (before %.2f ms); a %d MB model shard's write + XXH3-128 %.1f ms; "
      "whole/shard %.3f (before %.3f)\n",
      1e3 * snapshot.snapshot_seconds, 1e3 * snapshot.message_copy_seconds,
      snapshot.snapshot_seconds / snapshot.message_copy_seconds, snapshot.file_bytes / 1e6,
      1e3 * snapshot.write_file_seconds, 1e3 * snapshot.message_serialize_seconds, 1e3 * total,
      1e3 * was_total, options.shard_mb, 1e3 * snapshot.shard_seconds,
      total / snapshot.shard_seconds, was_total / snapshot.shard_seconds);
  json["snapshot"] = {
      {"points", snapshot.points},
      {"file_bytes", snapshot.file_bytes},
      {"snapshot_seconds", snapshot.snapshot_seconds},
      {"write_file_seconds", snapshot.write_file_seconds},
      {"message_copy_seconds", snapshot.message_copy_seconds},
      {"message_serialize_seconds", snapshot.message_serialize_seconds},
      {"shard_mb", options.shard_mb},
      {"shard_seconds", snapshot.shard_seconds},
      {"ratio_snapshot_to_message_copy", snapshot.snapshot_seconds / snapshot.message_copy_seconds},
      {"ratio_whole_to_shard", total / snapshot.shard_seconds},
      {"ratio_whole_before_to_shard", was_total / snapshot.shard_seconds}};

  std::unique_ptr<PostgresCluster> cluster;
  json["store"] = Json::array();
  for (const std::string& backend : options.backends) {
    for (int64_t points : options.points) {
      std::string location;
      if (backend == "postgres") {
        if (cluster == nullptr) {
          PostgresClusterOptions cluster_options;
          cluster_options.bin_dir = EnvOr(kPostgresBinDirEnv, kDefaultPostgresBinDir);
          cluster_options.parent_dir = options.parent_dir;
          ASSIGN_OR_RETURN(cluster, PostgresCluster::Start(cluster_options));
        }
        ASSIGN_OR_RETURN(location, cluster->NewDatabase("stepmet"));
      } else {
        location = absl::StrCat(scratch, "/coordinator-", points, ".db");
      }
      ASSIGN_OR_RETURN(StoreFigures figures, MeasureStore(backend, location, points, options.runs));
      std::cout << absl::StrFormat(
          "  %s, %d rows: MetricsCompleteThrough %.3f ms; the scan it replaced %.1f ms "
          "(ratio %.5f); ReadMetrics %.1f ms (ratio %.5f); a %d-point report's Commit %.3f ms "
          "(to a job whose mark cannot move %.3f ms; ratio %.2f); the Commit filling step 2 "
          "%.1f ms\n",
          backend, points, 1e3 * figures.complete_through_seconds, 1e3 * figures.scan_seconds,
          figures.complete_through_seconds / figures.scan_seconds,
          1e3 * figures.read_metrics_seconds,
          figures.complete_through_seconds / figures.read_metrics_seconds, kReportPoints,
          1e3 * figures.report_commit_seconds, 1e3 * figures.report_commit_no_mark_seconds,
          figures.report_commit_seconds / figures.report_commit_no_mark_seconds,
          1e3 * figures.fill_gap_seconds);
      json["store"].push_back(
          {{"backend", backend},
           {"points", points},
           {"complete_through_seconds", figures.complete_through_seconds},
           {"scan_seconds", figures.scan_seconds},
           {"read_metrics_seconds", figures.read_metrics_seconds},
           {"report_commit_seconds", figures.report_commit_seconds},
           {"report_commit_no_mark_seconds", figures.report_commit_no_mark_seconds},
           {"report_points", kReportPoints},
           {"fill_gap_seconds", figures.fill_gap_seconds},
           {"ratio_complete_through_to_scan",
            figures.complete_through_seconds / figures.scan_seconds},
           {"ratio_complete_through_to_read_metrics",
            figures.complete_through_seconds / figures.read_metrics_seconds}});
      if (backend == "sqlite") {
        for (const char* suffix : {"", "-wal", "-shm"}) {
          std::error_code ignored;
          std::filesystem::remove(absl::StrCat(location, suffix), ignored);
        }
      }
    }
  }

  return WriteResultsFile(ResultsDir(ResultsBesideExecutable()), "step_metrics.json",
                          json.dump(2) + "\n");
}

}  // namespace
}  // namespace tessera::bench

int main(int argc, char** argv) {
  using namespace tessera::bench;
  tessera::ParseCommandLine(
      argc, argv,
      "Usage: step_metrics_bench [--points=100000,1000000] [--backends=sqlite,postgres] "
      "[--runs=N] [--shard_mb=MB] [--dir=DIR]\n\n"
      "What step metrics cost on a long job: the coordinator's MetricsCompleteThrough against\n"
      "ReadMetrics and the scan it replaced, and rank 0's per-save snapshot against a model\n"
      "shard's write. Writes $TESSERA_BENCH_RESULTS/step_metrics.json.\n");
  absl::StatusOr<Options> options = ReadOptions();
  absl::Status status = options.ok() ? Run(*options) : options.status();
  if (!status.ok()) {
    std::cerr << "step_metrics_bench: " << status << "\n";
    return 1;
  }
  return 0;
}

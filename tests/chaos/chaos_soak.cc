#include "tests/chaos/chaos_soak.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <random>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "tests/chaos/chaos_cluster.h"
#include "tests/postgres_fixture.h"
#include "tests/util/subprocess.h"
#include "tests/util/wait.h"
#include "trainer/io/checkpoint.h"

namespace tessera::chaos {
namespace {

// Losses of a rerun are "equal" within this (the tolerance of the end-to-end tests' comparisons
// of a restarted run with an uninterrupted one: float reductions in another order).
constexpr double kLossTolerance = 1e-4;

bool Terminal(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED ||
         state == v1::JOB_STATE_CANCELLED;
}

std::unique_ptr<grpc::ClientContext> Deadline(int seconds = 5) {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
  return context;
}

struct TrackedJob {
  v1::JobSpec spec;
  v1::Job last;
};

// A fault's undoing (heal, restart), due at `at`.
struct Undo {
  absl::Time at;
  std::string what;
  std::function<absl::Status()> action;
};

class Soak {
 public:
  Soak(const SoakOptions& options, ChaosCluster& cluster, uint64_t seed)
      : options_(options), cluster_(cluster), rng_(seed), start_(absl::Now()) {}

  nlohmann::json Run();

 private:
  double Uniform(double low, double high) {
    return std::uniform_real_distribution<double>(low, high)(rng_);
  }
  int Pick(int n) { return std::uniform_int_distribution<int>(0, n - 1)(rng_); }
  void Log(const std::string& line) {
    std::cout << absl::StrFormat("[chaos %7.1fs] %s", absl::ToDoubleSeconds(absl::Now() - start_),
                                 line)
              << std::endl;
  }

  v1::JobSpec NextSpec();
  void KeepJobsInFlight();
  void PollJobs();
  // Injects one fault of a kind drawn at random among those possible now; false when none was.
  bool InjectFault();
  bool Inject(const std::string& kind);
  void Schedule(absl::Duration after, std::string what, std::function<absl::Status()> action);
  void RunDueUndos(bool all);
  void Drain();
  grpc::Status GetJob(const std::string& job_id, v1::Job* job);
  std::vector<v1::StepMetrics> Curve(const std::string& job_id);
  nlohmann::json CountJobs();
  nlohmann::json CheckOrphans();
  nlohmann::json CheckCheckpoints();
  nlohmann::json CheckLosses();
  nlohmann::json CheckCurves();

  const SoakOptions& options_;
  ChaosCluster& cluster_;
  std::mt19937_64 rng_;
  const absl::Time start_;
  std::map<std::string, TrackedJob> jobs_;
  int submitted_ = 0;
  std::vector<Undo> undos_;
  std::set<int> cut_from_coordinator_;
  std::set<std::pair<int, int>> cut_pairs_;
  std::set<int> lossy_;
  std::set<int> slow_;
  std::map<std::string, int> faults_;
  std::vector<std::string> fault_errors_;
};

v1::JobSpec Soak::NextSpec() {
  v1::JobSpec spec;
  spec.set_name(absl::StrCat("chaos-", submitted_));
  spec.mutable_model()->set_preset("tiny-gpt2");
  spec.mutable_data()->add_train_shards(cluster_.data_glob());
  spec.mutable_data()->set_seq_len(64);
  spec.mutable_batch()->set_global_batch_size(8);
  spec.mutable_batch()->set_micro_batch_size(2);
  spec.mutable_optimizer()->mutable_schedule()->set_peak_learning_rate(3e-3);
  spec.mutable_optimizer()->mutable_schedule()->set_warmup_steps(5);
  // By default 10 to 30 s of training on this machine's tiny model: long enough that faults
  // land mid-job.
  const int step_choices = (options_.max_job_steps - options_.min_job_steps) / 10 + 1;
  spec.set_max_steps(options_.min_job_steps + 10 * Pick(std::max(1, step_choices)));
  spec.mutable_checkpoint()->set_interval_steps(10);
  // One rank, or two that (one slot per worker) sit on two hosts and talk over the lab network.
  spec.mutable_resources()->set_cpu_slots(1 + Pick(2));
  // Generous: the soak asks that jobs survive, not that they give up early.
  spec.set_max_restarts(50);
  // A partition between two ranks hangs their collectives: found in this time, not Gloo's 30 min.
  spec.set_hang_timeout_seconds(10);
  spec.set_seed(1000 + submitted_);
  return spec;
}

grpc::Status Soak::GetJob(const std::string& job_id, v1::Job* job) {
  v1::GetJobRequest request;
  request.set_job_id(job_id);
  v1::GetJobResponse response;
  grpc::Status status = cluster_.OnLeader([&](v1::Coordinator::Stub& stub) {
    return stub.GetJob(Deadline().get(), request, &response);
  });
  if (status.ok()) *job = response.job();
  return status;
}

void Soak::KeepJobsInFlight() {
  int unfinished = 0;
  for (const auto& [id, job] : jobs_) unfinished += Terminal(job.last.state()) ? 0 : 1;
  while (unfinished < options_.jobs_in_flight) {
    v1::SubmitJobRequest request;
    *request.mutable_spec() = NextSpec();
    v1::SubmitJobResponse response;
    grpc::Status status = cluster_.OnLeader([&](v1::Coordinator::Stub& stub) {
      return stub.SubmitJob(Deadline(10).get(), request, &response);
    });
    // No leader answered (one was just killed): the next tick tries again. A submission whose
    // answer was lost still shows in the final ListJobs.
    if (!status.ok()) return;
    ++submitted_;
    jobs_[response.job().job_id()] = {request.spec(), response.job()};
    Log(absl::StrCat("submitted ", response.job().job_id(), " (", request.spec().max_steps(),
                     " steps, ", request.spec().resources().cpu_slots(), " ranks)"));
    ++unfinished;
  }
}

void Soak::PollJobs() {
  for (auto& [id, job] : jobs_) {
    if (Terminal(job.last.state())) continue;
    v1::Job now;
    if (!GetJob(id, &now).ok()) continue;
    if (Terminal(now.state())) {
      Log(absl::StrCat(id, " ended ", v1::JobState_Name(now.state()), " after ", now.restarts(),
                       " restarts", now.reason().empty() ? "" : ": " + now.reason()));
    }
    job.last = now;
  }
}

void Soak::Schedule(absl::Duration after, std::string what, std::function<absl::Status()> action) {
  undos_.push_back({absl::Now() + after, std::move(what), std::move(action)});
}

void Soak::RunDueUndos(bool all) {
  const absl::Time now = absl::Now();
  std::vector<Undo> pending;
  for (Undo& undo : undos_) {
    if (!all && undo.at > now) {
      pending.push_back(std::move(undo));
      continue;
    }
    absl::Status done = undo.action();
    Log(absl::StrCat("undo: ", undo.what,
                     done.ok() ? "" : absl::StrCat(" FAILED: ", done.message())));
    if (!done.ok()) fault_errors_.push_back(absl::StrCat(undo.what, ": ", done.message()));
  }
  undos_ = std::move(pending);
}

bool Soak::Inject(const std::string& kind) {
  const int workers = cluster_.workers();
  absl::Status injected;
  std::string what;
  if (kind == "kill_trainer") {
    std::vector<pid_t> pids = cluster_.TrainerPids();
    if (pids.empty()) return false;
    const pid_t pid = pids[Pick(static_cast<int>(pids.size()))];
    what = absl::StrCat("kill -9 trainer ", pid);
    if (kill(pid, SIGKILL) != 0) return false;  // it ended meanwhile
  } else if (kind == "kill_worker") {
    // One worker down at a time: the others keep training.
    for (int w = 0; w < workers; ++w) {
      if (!cluster_.WorkerUp(w)) return false;
    }
    const int w = Pick(workers);
    what = absl::StrCat("kill -9 worker ", w);
    injected = cluster_.KillWorker(w);
    Schedule(absl::Seconds(Uniform(2, 8)), absl::StrCat("restart worker ", w),
             [this, w] { return cluster_.StartWorker(w); });
  } else if (kind == "kill_coordinator") {
    if (!cluster_.ha()) return false;
    for (int c = 0; c < cluster_.coordinators(); ++c) {
      if (!cluster_.CoordinatorUp(c)) return false;
    }
    const int leader = cluster_.Leader();
    if (leader < 0) return false;
    what = absl::StrCat("kill -9 leading coordinator ", leader);
    injected = cluster_.KillCoordinator(leader);
    Schedule(absl::Seconds(Uniform(3, 10)), absl::StrCat("restart coordinator ", leader),
             [this, leader] { return cluster_.StartCoordinator(leader); });
  } else if (kind == "partition_coordinator") {
    const int w = Pick(workers);
    if (cut_from_coordinator_.count(w)) return false;
    const absl::Duration length = absl::Seconds(Uniform(2, 20));
    what =
        absl::StrCat("cut worker ", w, " from the coordinators for ", absl::FormatDuration(length));
    injected = cluster_.lab().PartitionFromMachine(w);
    if (injected.ok()) {
      cut_from_coordinator_.insert(w);
      Schedule(length, absl::StrCat("heal worker ", w, " with the coordinators"), [this, w] {
        cut_from_coordinator_.erase(w);
        return cluster_.lab().HealFromMachine(w);
      });
    }
  } else if (kind == "partition_workers") {
    if (workers < 2) return false;
    const int a = Pick(workers);
    const int b = (a + 1 + Pick(workers - 1)) % workers;
    const std::pair<int, int> pair{std::min(a, b), std::max(a, b)};
    if (cut_pairs_.count(pair)) return false;
    const absl::Duration length = absl::Seconds(Uniform(2, 20));
    what = absl::StrCat("cut workers ", pair.first, " and ", pair.second, " apart for ",
                        absl::FormatDuration(length));
    injected = cluster_.lab().Partition(pair.first, pair.second);
    if (injected.ok()) {
      cut_pairs_.insert(pair);
      Schedule(length, absl::StrCat("heal workers ", pair.first, " and ", pair.second),
               [this, pair] {
                 cut_pairs_.erase(pair);
                 return cluster_.lab().Heal(pair.first, pair.second);
               });
    }
  } else if (kind == "packet_loss") {
    const int w = Pick(workers);
    if (lossy_.count(w)) return false;
    const double fraction = std::round(Uniform(0.02, 0.10) * 100) / 100;
    const absl::Duration length = absl::Seconds(Uniform(5, 20));
    what = absl::StrCat("drop ", fraction * 100, "% of worker ", w, "'s packets for ",
                        absl::FormatDuration(length));
    injected = cluster_.lab().SetLoss(w, fraction);
    if (injected.ok()) {
      lossy_.insert(w);
      Schedule(length, absl::StrCat("no more loss on worker ", w), [this, w] {
        lossy_.erase(w);
        return cluster_.lab().SetLoss(w, 0);
      });
    }
  } else if (kind == "latency") {
    const int w = Pick(workers);
    if (slow_.count(w)) return false;
    // Each way, on all of the worker's traffic: heartbeats, reports, Gloo's collectives.
    const absl::Duration delay = absl::Milliseconds(50 * (1 + Pick(6)));
    const absl::Duration jitter = delay / 5;
    const absl::Duration length = absl::Seconds(Uniform(5, 20));
    what = absl::StrCat("delay worker ", w, "'s packets ", absl::FormatDuration(delay), " + 0-",
                        absl::FormatDuration(jitter), " each way for ",
                        absl::FormatDuration(length));
    injected = cluster_.lab().Delay(w, delay, jitter);
    if (injected.ok()) {
      slow_.insert(w);
      Schedule(length, absl::StrCat("no more latency on worker ", w), [this, w] {
        slow_.erase(w);
        return cluster_.lab().Undelay(w);
      });
    }
  }
  if (!injected.ok()) {
    Log(absl::StrCat("fault ", what, " FAILED: ", injected.message()));
    fault_errors_.push_back(absl::StrCat(what, ": ", injected.message()));
    return false;
  }
  Log("fault: " + what);
  ++faults_[kind];
  return true;
}

const std::vector<std::string>& FaultKinds() {
  static const auto* kinds =
      new std::vector<std::string>{"kill_trainer",          "kill_worker",       "kill_coordinator",
                                   "partition_coordinator", "partition_workers", "packet_loss",
                                   "latency"};
  return *kinds;
}

bool Soak::InjectFault() {
  const std::vector<std::string>& kKinds = FaultKinds();
  // A few draws: a kind impossible right now (nothing to kill, already cut) gives way to another.
  for (int attempt = 0; attempt < 6; ++attempt) {
    if (Inject(kKinds[Pick(static_cast<int>(kKinds.size()))])) return true;
  }
  return false;
}

void Soak::Drain() {
  RunDueUndos(/*all=*/true);
  for (int c = 0; c < cluster_.coordinators(); ++c) {
    if (!cluster_.CoordinatorUp(c)) cluster_.StartCoordinator(c).IgnoreError();  // counted below
  }
  for (int w = 0; w < cluster_.workers(); ++w) {
    if (!cluster_.WorkerUp(w)) {
      absl::Status started = cluster_.StartWorker(w);
      if (!started.ok())
        fault_errors_.push_back(absl::StrCat("restart worker: ", started.message()));
    }
  }
  Log("faults stopped; waiting for every job to end");
  testing::WaitUntil(
      [&] {
        PollJobs();
        return std::all_of(jobs_.begin(), jobs_.end(),
                           [](const auto& entry) { return Terminal(entry.second.last.state()); });
      },
      options_.drain_timeout, absl::Seconds(1));
}

nlohmann::json Soak::CountJobs() {
  // Jobs whose submission answer was lost are still the coordinator's: count them too.
  v1::ListJobsResponse listed;
  if (cluster_
          .OnLeader([&](v1::Coordinator::Stub& stub) {
            v1::ListJobsRequest request;
            request.set_page_size(1000);
            return stub.ListJobs(Deadline(10).get(), request, &listed);
          })
          .ok()) {
    for (const v1::Job& job : listed.jobs()) {
      if (!absl::StartsWith(job.spec().name(), "chaos-") || jobs_.count(job.job_id())) continue;
      v1::Job full;
      if (GetJob(job.job_id(), &full).ok()) jobs_[job.job_id()] = {full.spec(), full};
    }
  }
  int succeeded = 0, failed_named = 0, restarts = 0;
  nlohmann::json causes = nlohmann::json::object();
  nlohmann::json lost = nlohmann::json::array();
  // How the restarts were blamed: each ended attempt's failure kind.
  nlohmann::json blamed = nlohmann::json::object();
  for (const auto& [id, job] : jobs_) {
    restarts += job.last.restarts();
    for (const v1::JobAttempt& attempt : job.last.attempts()) {
      if (!attempt.has_failure()) continue;
      const std::string kind = v1::FailureKind_Name(attempt.failure().kind());
      blamed[kind] = blamed.value(kind, 0) + 1;
    }
    if (job.last.state() == v1::JOB_STATE_SUCCEEDED) {
      ++succeeded;
    } else if (job.last.state() == v1::JOB_STATE_FAILED && !job.last.reason().empty()) {
      ++failed_named;
      causes[job.last.reason()] = causes.value(job.last.reason(), 0) + 1;
    } else {
      lost.push_back({{"job_id", id},
                      {"state", v1::JobState_Name(job.last.state())},
                      {"reason", job.last.reason()},
                      {"step", job.last.current_step()}});
    }
  }
  return {{"submitted", jobs_.size()}, {"succeeded", succeeded},    {"failed_named", failed_named},
          {"lost", lost.size()},       {"lost_jobs", lost},         {"failure_causes", causes},
          {"restarts", restarts},      {"attempt_failures", blamed}};
}

nlohmann::json Soak::CheckOrphans() {
  // Every job has ended: a trainer still running belongs to nobody. Workers stop theirs within
  // their stop grace (2 s) of a job's end; allow for a loaded machine.
  std::vector<pid_t> pids;
  testing::WaitUntil(
      [&] {
        pids = cluster_.TrainerPids();
        return pids.empty();
      },
      absl::Seconds(30), absl::Milliseconds(500));
  nlohmann::json commands = nlohmann::json::array();
  for (pid_t pid : pids) {
    absl::StatusOr<testing::RunResult> ps =
        testing::RunCommand({"ps", "-o", "args=", "-p", absl::StrCat(pid)}, absl::Seconds(5));
    commands.push_back(ps.ok() ? ps->output : absl::StrCat(pid));
    // Ours to end: the soak started them (through its workers), one by one by pid.
    kill(pid, SIGKILL);
  }
  return {{"orphaned_trainers", pids.size()}, {"orphans", commands}};
}

nlohmann::json Soak::CheckCheckpoints() {
  int verified = 0, staging_left = 0;
  nlohmann::json corrupt = nlohmann::json::array();
  // What the coordinators recorded must be there and whole too (retention keeps every one), and
  // a SUCCEEDED job's last step is always saved.
  nlohmann::json missing = nlohmann::json::array();
  for (const auto& [id, job] : jobs_) {
    std::set<std::string> whole;
    std::error_code error;
    for (const auto& entry :
         std::filesystem::directory_iterator(cluster_.CheckpointDir(id), error)) {
      const std::string name = entry.path().filename().string();
      if (absl::StartsWith(name, ".staging-")) ++staging_left;
      if (!absl::StartsWith(name, "step-")) continue;
      absl::StatusOr<v1::CheckpointManifest> manifest =
          trainer::VerifyCheckpoint(entry.path().string(), trainer::DigestCheck::kAll);
      if (manifest.ok()) {
        ++verified;
        whole.insert(entry.path().lexically_normal().string());
      } else {
        corrupt.push_back(std::string(manifest.status().message()));
      }
    }
    v1::ListCheckpointsRequest request;
    request.set_job_id(id);
    v1::ListCheckpointsResponse recorded;
    if (!cluster_
             .OnLeader([&](v1::Coordinator::Stub& stub) {
               return stub.ListCheckpoints(Deadline(10).get(), request, &recorded);
             })
             .ok()) {
      missing.push_back(id + ": ListCheckpoints failed");
      continue;
    }
    for (const v1::Checkpoint& checkpoint : recorded.checkpoints()) {
      const std::string path = std::filesystem::path(checkpoint.path()).lexically_normal().string();
      if (!whole.count(path)) missing.push_back(absl::StrCat(id, ": recorded ", path));
    }
    const std::string last = std::filesystem::path(cluster_.CheckpointDir(id) + "/" +
                                                   trainer::CheckpointDirName(job.spec.max_steps()))
                                 .lexically_normal()
                                 .string();
    if (job.last.state() == v1::JOB_STATE_SUCCEEDED && !whole.count(last)) {
      missing.push_back(absl::StrCat(id, ": final ", last));
    }
  }
  return {{"verified", verified},           {"corrupt", corrupt.size()},
          {"corrupt_errors", corrupt},      {"missing", missing.size()},
          {"missing_checkpoints", missing}, {"staging_dirs_left", staging_left}};
}

std::vector<v1::StepMetrics> Soak::Curve(const std::string& job_id) {
  v1::GetMetricsRequest request;
  request.set_job_id(job_id);
  v1::GetMetricsResponse response;
  if (!cluster_
           .OnLeader([&](v1::Coordinator::Stub& stub) {
             return stub.GetMetrics(Deadline(10).get(), request, &response);
           })
           .ok()) {
    return {};
  }
  return {response.points().begin(), response.points().end()};
}

nlohmann::json Soak::CheckCurves() {
  // A SUCCEEDED job trained every step from 1 to max_steps: the coordinator should hold each
  // step's metrics once. A step missing is a report lost on its way (trained and checkpointed,
  // but never recorded).
  int64_t missing_total = 0;
  nlohmann::json incomplete = nlohmann::json::array();
  for (const auto& [id, job] : jobs_) {
    if (job.last.state() != v1::JOB_STATE_SUCCEEDED) continue;
    std::set<int64_t> steps;
    for (const v1::StepMetrics& point : Curve(id)) steps.insert(point.step());
    std::vector<std::string> gaps;
    int64_t missing = 0;
    for (int64_t step = 1; step <= job.spec.max_steps(); ++step) {
      if (steps.count(step)) continue;
      int64_t last = step;
      while (last + 1 <= job.spec.max_steps() && !steps.count(last + 1)) ++last;
      gaps.push_back(last == step ? absl::StrCat(step) : absl::StrCat(step, "-", last));
      missing += last - step + 1;
      step = last;
    }
    if (missing == 0) continue;
    missing_total += missing;
    incomplete.push_back(
        {{"job_id", id}, {"missing_steps", gaps}, {"restarts", job.last.restarts()}});
    Log(absl::StrCat(id, ": the coordinator has no metrics for steps ", absl::StrJoin(gaps, ",")));
  }
  return {{"steps_missing", missing_total}, {"jobs", incomplete}};
}

nlohmann::json Soak::CheckLosses() {
  // The restarted jobs first: they are the ones whose losses a fault could have changed.
  // Only jobs every attempt of which ran at the spec's world size: an attempt the coordinator
  // shrank to fewer ranks (a node lost) sums the same gradients in another order, and that
  // rounding grows over hundreds of steps (seen: 5e-4 by step 80, 0.08 by step 450 of a job that
  // trained 350 steps on one rank instead of two). Such jobs are counted, not compared.
  std::vector<const std::pair<const std::string, TrackedJob>*> succeeded;
  int layout_changed = 0;
  for (const auto& entry : jobs_) {
    if (entry.second.last.state() != v1::JOB_STATE_SUCCEEDED) continue;
    bool same_layout = true;
    for (const v1::JobAttempt& attempt : entry.second.last.attempts()) {
      same_layout =
          same_layout && (attempt.world_size() == 0 ||
                          attempt.world_size() == entry.second.spec.resources().cpu_slots());
    }
    if (same_layout) {
      succeeded.push_back(&entry);
    } else {
      ++layout_changed;
    }
  }
  std::stable_sort(succeeded.begin(), succeeded.end(), [](auto* a, auto* b) {
    return a->second.last.restarts() > b->second.last.restarts();
  });
  if (static_cast<int>(succeeded.size()) > options_.loss_checks) {
    succeeded.resize(options_.loss_checks);
  }
  // Submitted together: the reruns train side by side, without faults.
  std::vector<std::pair<std::string, std::string>> reruns;  // faulted job, rerun
  for (auto* entry : succeeded) {
    v1::SubmitJobRequest request;
    *request.mutable_spec() = entry->second.spec;
    request.mutable_spec()->set_name("rerun-" + entry->first);
    request.mutable_spec()->mutable_checkpoint()->set_directory(
        absl::StrCat(cluster_.dir(), "/rerun/", entry->first));
    v1::SubmitJobResponse response;
    if (cluster_
            .OnLeader([&](v1::Coordinator::Stub& stub) {
              return stub.SubmitJob(Deadline(10).get(), request, &response);
            })
            .ok()) {
      reruns.push_back({entry->first, response.job().job_id()});
    }
  }
  nlohmann::json checks = nlohmann::json::array();
  int unequal = 0;
  for (const auto& [faulted, rerun] : reruns) {
    v1::Job done;
    testing::WaitUntil([&] { return GetJob(rerun, &done).ok() && Terminal(done.state()); },
                       absl::Minutes(8), absl::Seconds(1));
    const std::vector<v1::StepMetrics> expected = Curve(rerun);
    const std::vector<v1::StepMetrics> actual = Curve(faulted);
    // Step by step, on the steps the faulted run has: a step it lacks is counted by
    // CheckCurves, and must not hide that the others are equal.
    std::map<int64_t, double> rerun_loss;
    for (const v1::StepMetrics& point : expected) rerun_loss[point.step()] = point.loss();
    double max_diff = 0;
    int64_t steps_without_rerun = 0;
    for (const v1::StepMetrics& point : actual) {
      auto it = rerun_loss.find(point.step());
      if (it == rerun_loss.end()) {
        ++steps_without_rerun;
        continue;
      }
      max_diff = std::max(max_diff, std::abs(point.loss() - it->second));
    }
    const bool rerun_whole =
        done.state() == v1::JOB_STATE_SUCCEEDED &&
        static_cast<int64_t>(expected.size()) == jobs_[faulted].spec.max_steps();
    const bool equal =
        rerun_whole && !actual.empty() && steps_without_rerun == 0 && max_diff <= kLossTolerance;
    unequal += equal ? 0 : 1;
    Log(absl::StrCat("losses of ", faulted, " vs its fault-free rerun ", rerun, ": ",
                     equal ? "equal" : "UNEQUAL", " at the ", actual.size(),
                     " steps it reported (rerun: ", expected.size(), " steps), max |diff| ",
                     max_diff));
    checks.push_back({{"job_id", faulted},
                      {"restarts", jobs_[faulted].last.restarts()},
                      {"steps_compared", actual.size()},
                      {"rerun_steps", expected.size()},
                      {"rerun_state", v1::JobState_Name(done.state())},
                      {"max_abs_loss_diff", max_diff},
                      {"equal", equal}});
  }
  return {{"compared", checks.size()},
          {"unequal", unequal},
          {"skipped_layout_changed", layout_changed},
          {"jobs", checks}};
}

nlohmann::json Soak::Run() {
  for (const std::string& kind : FaultKinds()) faults_[kind] = 0;
  absl::Time next_fault = absl::Now() + absl::Seconds(Uniform(5, 10));
  const absl::Time end = start_ + options_.duration;
  while (absl::Now() < end) {
    RunDueUndos(/*all=*/false);
    KeepJobsInFlight();
    PollJobs();
    if (absl::Now() >= next_fault) {
      InjectFault();
      next_fault = absl::Now() + absl::Seconds(options_.mean_fault_interval_s * Uniform(0.5, 1.5));
    }
    absl::SleepFor(absl::Milliseconds(500));
  }
  Drain();
  nlohmann::json result;
  result["faults"] = faults_;
  int total = 0;
  for (const auto& [kind, count] : faults_) total += count;
  result["faults_total"] = total;
  result["fault_errors"] = fault_errors_;
  result["jobs"] = CountJobs();
  result["trainers"] = CheckOrphans();
  result["checkpoints"] = CheckCheckpoints();
  result["metrics"] = CheckCurves();
  result["loss_checks"] = CheckLosses();
  result["passed"] = result["jobs"]["lost"] == 0 && result["trainers"]["orphaned_trainers"] == 0 &&
                     result["checkpoints"]["corrupt"] == 0 &&
                     result["checkpoints"]["missing"] == 0 &&
                     result["metrics"]["steps_missing"] == 0 &&
                     result["loss_checks"]["unequal"] == 0 && fault_errors_.empty();
  return result;
}

}  // namespace

absl::StatusOr<nlohmann::json> RunChaosSoak(const SoakOptions& options) {
  const uint64_t seed =
      options.seed != 0 ? options.seed : static_cast<uint64_t>(absl::ToUnixMicros(absl::Now()));
  std::cout << "chaos soak: seed " << seed << " (replay with --seed=" << seed << "), "
            << absl::FormatDuration(options.duration) << " of faults" << std::endl;

  std::string dir = options.dir;
  if (dir.empty()) {
    char pattern[] = "/tmp/tessera-chaos.XXXXXX";
    if (mkdtemp(pattern) == nullptr) return absl::InternalError("mkdtemp failed");
    dir = pattern;
  }
  std::filesystem::create_directories(dir);
  ClusterOptions cluster_options;
  cluster_options.dir = dir;
  cluster_options.bin_dir = options.bin_dir;
  cluster_options.corpus = options.corpus;
  cluster_options.workers = options.workers;
  std::string ha_note = "off";
  if (options.ha) {
    cluster_options.postgres_url = testing::PostgresCluster::Shared().NewDatabase();
    ha_note = cluster_options.postgres_url.empty()
                  ? "off: " + testing::PostgresCluster::Shared().Reason()
                  : "two coordinators on PostgreSQL";
    if (cluster_options.postgres_url.empty() && options.require_ha) {
      std::error_code ignored;
      if (options.dir.empty()) std::filesystem::remove_all(dir, ignored);
      return absl::FailedPreconditionError(
          "no PostgreSQL for the coordinators' failover: " +
          testing::PostgresCluster::Shared().Reason());
    }
  }
  std::cout << "chaos soak: " << options.workers << " workers, coordinators: " << ha_note
            << ", files in " << dir << std::endl;
  absl::StatusOr<std::unique_ptr<ChaosCluster>> started_cluster =
      ChaosCluster::Start(cluster_options);
  if (!started_cluster.ok()) {
    std::error_code ignored;
    if (options.dir.empty()) std::filesystem::remove_all(dir, ignored);
    return started_cluster.status();
  }
  std::unique_ptr<ChaosCluster> cluster = std::move(*started_cluster);

  const absl::Time started = absl::Now();
  Soak soak(options, *cluster, seed);
  nlohmann::json result = soak.Run();
  cluster->StopAll();
  result["seed"] = seed;
  result["duration_s"] = absl::ToDoubleSeconds(options.duration);
  result["wall_s"] = absl::ToDoubleSeconds(absl::Now() - started);
  result["workers"] = options.workers;
  result["coordinators"] = ha_note;
  result["dir"] = dir;
  // A clean run leaves nothing behind; a failed one keeps its logs and checkpoints to read.
  if (result["passed"] == true && options.dir.empty()) {
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
    result["dir"] = "";
  }
  return result;
}

}  // namespace tessera::chaos

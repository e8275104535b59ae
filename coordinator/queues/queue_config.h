// Queues and quotas for a shared cluster: the configuration (a YAML file the coordinator re-reads
// on change, queue_file.h), its validation, and which queue a job goes to. Pure
// logic: no gRPC, store, threads or clock. Admission against the quotas is queue_admission.h,
// fair share is fair_share.h, preemption selection is queue_preemption.h.
//
// The file:
//
//   cohorts:                      # optional; queues of one cohort lend each other unused quota
//     - name: research
//   queues:
//     - name: nlp                 # [a-z0-9-], 1..63 characters, unique
//       cohort: research          # optional; must be listed under cohorts
//       nominal: {gpus: 32, cpu_slots: 8}       # guaranteed quota; absent fields are 0
//       borrowing_limit: {gpus: 16}             # optional, per resource; absent = no limit
//       weight: 2.0                             # fair-share weight, > 0, default 1
//       submitters: {users: [alice], groups: [nlp-team]}  # absent = anyone may submit
//       default_for: {users: [alice], groups: [nlp-team], labels: {team: nlp}}
//   default_queue: shared         # optional: for jobs that name no queue and match no default_for
//   fair_share: {half_life: 7d}   # s, m, h or d; default 7d
//   preemption: {checkpoint_deadline: 2m}  # s, m, h or d; default 120s (see below)
//
// Quota. A queue's nominal quota is guaranteed to it. Within a cohort, quota a queue does not use
// is lent to the others: a queue may use more than its nominal (borrow) up to its borrowing limit,
// while the cohort as a whole never uses more than the sum of its queues' nominal quotas. A queue
// outside any cohort never borrows. GPUs and CPU slots are separate resources, as in the gang
// scheduler: a GPU job counts world_size GPUs, a CPU job world_size CPU slots.
//
// Routing (QueueFor). A job that names its queue goes there if its owner may submit there. A job
// that names none goes, in this order, to the queue whose default_for lists its owner; else the
// first queue (in file order) whose default_for lists one of its owner's groups; else the first
// whose default_for labels are all carried by the job; else default_queue. Submission rights are
// granted by submitters (user or group) only: labels route, they never grant, since a submitter
// chooses its job's labels.
//
// Preemption (queue_preemption.h). A preempted job's ranks are asked to save a checkpoint and
// exit; those still running checkpoint_deadline later are stopped (SIGTERM, then SIGKILL after
// the worker's stop grace), and the job resumes from its last periodic checkpoint instead.
//
// Without any queue (no file, or a file with no queues) every job goes to one implicit queue,
// kImplicitQueue, without quota: admission is then the gang scheduler's alone, as before queues.
//
// Thread safety: plain values and pure functions. A QueueConfig is not changed once validated;
// the daemon can swap a shared_ptr<const QueueConfig> on reload and read it from any thread.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace tessera::coordinator {

// The queue every job goes to when the configuration defines none.
inline constexpr absl::string_view kImplicitQueue = "default";

// The fair-share half-life when the file sets none.
inline constexpr absl::Duration kDefaultFairShareHalfLife = absl::Hours(7 * 24);

// How long a preempted job's ranks have to save a checkpoint when the file sets nothing.
inline constexpr absl::Duration kDefaultPreemptionCheckpointDeadline = absl::Seconds(120);

// An amount of each schedulable resource.
struct Resources {
  int64_t gpus = 0;
  int64_t cpu_slots = 0;

  Resources& operator+=(const Resources& other) {
    gpus += other.gpus;
    cpu_slots += other.cpu_slots;
    return *this;
  }
  Resources& operator-=(const Resources& other) {
    gpus -= other.gpus;
    cpu_slots -= other.cpu_slots;
    return *this;
  }
  friend bool operator==(const Resources&, const Resources&) = default;
};

// The two resources, for code that treats them alike.
enum class ResourceKind { kGpus, kCpuSlots };
inline int64_t Get(const Resources& resources, ResourceKind kind) {
  return kind == ResourceKind::kGpus ? resources.gpus : resources.cpu_slots;
}
inline int64_t& Get(Resources& resources, ResourceKind kind) {
  return kind == ResourceKind::kGpus ? resources.gpus : resources.cpu_slots;
}
// "GPUs" or "CPU slots".
absl::string_view ResourceName(ResourceKind kind);

// Who may submit into a queue (any match grants); both empty = anyone.
struct Submitters {
  std::vector<std::string> users{};
  std::vector<std::string> groups{};
};

// Which jobs that name no queue go to this one (see Routing above).
struct DefaultFor {
  std::vector<std::string> users{};
  std::vector<std::string> groups{};
  // All must be carried by the job; empty = matches no job.
  std::map<std::string, std::string> labels{};
};

struct QueueSpec {
  std::string name{};
  // "" = none.
  std::string cohort{};
  Resources nominal{};
  // Per resource: how much above nominal the queue may use; nullopt = only the cohort's unused
  // quota bounds it.
  std::optional<int64_t> borrowing_limit_gpus{};
  std::optional<int64_t> borrowing_limit_cpu_slots{};
  double weight = 1.0;
  Submitters submitters{};
  DefaultFor default_for{};

  std::optional<int64_t> BorrowingLimit(ResourceKind kind) const {
    return kind == ResourceKind::kGpus ? borrowing_limit_gpus : borrowing_limit_cpu_slots;
  }
};

// A validated configuration. Build it with ParseQueueConfig (or by hand in tests, then
// ValidateQueueConfig).
struct QueueConfig {
  std::vector<std::string> cohorts{};
  std::vector<QueueSpec> queues{};
  // "" = none.
  std::string default_queue{};
  absl::Duration fair_share_half_life = kDefaultFairShareHalfLife;
  absl::Duration preemption_checkpoint_deadline = kDefaultPreemptionCheckpointDeadline;

  // True when the file defines no queue: one implicit queue without quota.
  bool implicit() const { return queues.empty(); }
  // nullptr when there is no such queue.
  const QueueSpec* Find(absl::string_view queue) const;
  // What the queue's cohort may use in all: the sum of its queues' nominal quotas; a queue
  // without cohort is its own cohort.
  Resources CohortNominal(const QueueSpec& queue) const;
};

// The queue a job counts against: `job_queue` (Job.queue), or for one submitted before queues were
// configured (empty or the implicit queue) the file's default_queue when it names one. A queue the
// file no longer defines stays as it is.
std::string CountingQueue(const std::string& job_queue, const QueueConfig& config);

// Parses and validates the file's text. INVALID_ARGUMENT naming the entry and field at fault,
// e.g. "queues[2] (nlp).nominal.gpus: must be >= 0, got -4".
absl::StatusOr<QueueConfig> ParseQueueConfig(absl::string_view yaml);

// The checks ParseQueueConfig makes after reading: names, duplicates, cohorts, quotas, weights,
// defaults; for configurations built in code.
absl::Status ValidateQueueConfig(const QueueConfig& config);

// "90s", "30m", "12h", "7d" (a positive whole or decimal number and one unit).
absl::StatusOr<absl::Duration> ParseConfigDuration(absl::string_view text);

// Who submits a job, and what it asks for.
struct Submission {
  std::string owner{};
  std::vector<std::string> groups{};
  std::map<std::string, std::string> labels{};
  // The queue the job names; "" = none.
  std::string requested_queue{};
};

// The queue the job goes to, by the routing rule above. NOT_FOUND for a queue the file does not
// define, PERMISSION_DENIED when the owner may not submit into the queue it named or was routed
// to, FAILED_PRECONDITION when it names none and no default applies.
absl::StatusOr<std::string> QueueFor(const QueueConfig& config, const Submission& submission);

}  // namespace tessera::coordinator

// Quota admission: which waiting jobs may try placement this scheduling pass, given what their
// queues already hold. It runs before the gang scheduler (scheduler.h): the pass hands Schedule()
// only the requests admitted here, and stores the reasons of the others as their pending
// reasons. Pure logic: no gRPC, store, threads or clock; shares come from fair_share.h.
//
// Policy (each resource, GPUs and CPU slots, on its own: a GPU job counts world_size GPUs
// against its queue, a CPU job world_size CPU slots, and the two never block each other):
//
// * Order in a queue. A queue's requests are taken by priority (higher first), then submit_order
//   (older first), then job_id. The first that cannot be admitted (the queue's head) holds back
//   every later one of the same resource: "waiting behind <job>". A request that can never start
//   under the quota (QuotaUnsatisfiable) is skipped with that reason and holds nothing back.
// * Nominal (first round). Queues in ascending fair share (then name) admit, in their order,
//   each request that keeps the queue within its nominal quota. It also needs the cohort to have
//   that much unused: when other queues have borrowed the queue's quota, the request waits for
//   it to come back (or for preemption, queue_preemption.h) and reserves it: no queue may
//   borrow it meanwhile. Such reservations never exceed the cohort's total, since each lies
//   within its queue's nominal quota.
// * Borrowing (second round, cohorts only). Each queue's head that needs more than its nominal
//   quota may borrow: it needs the cohort's unused quota (total minus in use minus reservations)
//   to hold it and the queue to stay within nominal + borrowing limit. Queues of a cohort take
//   turns, one request per turn, starting from the lowest fair share, so the capacity lent in a
//   pass goes first to the queue that has had least. The first head that fits its borrowing limit
//   but not the cohort's unused quota reserves what it needs (like the scheduler's backfill
//   reservation): later borrowers may use only what is unused beyond it, so a large gang of a
//   low-share queue is not starved by a stream of small ones. One such reservation per cohort
//   and resource and pass. While it waits its usage decays and the borrowers' grows, so it stays
//   first in line on later passes unless another queue's share falls lower still.
// * Admitted requests count at once against their queue and cohort, so a pass never admits
//   more than the quotas allow together. A request admitted here that the scheduler then cannot
//   place (no free node fits it) only ends its pass unplaced; the next pass recounts from what
//   actually runs. Hence a queue never holds more than nominal + borrowing limit, and a cohort
//   never more than the sum of its nominal quotas, counting only running jobs.
// * No queues configured (QueueConfig::implicit()): every request is admitted, in priority and
//   age order; quotas do not exist.
//
// Each request held back gets a reason a person can read, e.g.
// "queue research: 56 of 64 GPUs in use, needs 16; cohort lab has 4 GPUs unused to lend".
//
// Cost: O((Q + R) log(Q + R)) per pass for Q queues and R requests.
//
// Thread safety: AdmitByQuota and QuotaUnsatisfiable are pure functions; a QuotaLedger is a
// plain value (not for concurrent use).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "coordinator/queues/queue_config.h"

namespace tessera::coordinator {

// One waiting job as quota admission sees it (the pass builds it beside its GangRequest).
struct QueuedRequest {
  std::string job_id{};
  // As QueueFor chose it at submission.
  std::string queue{};
  // Higher first.
  int priority = 0;
  // Smaller = older.
  int64_t submit_order = 0;
  // False: the devices are CPU slots.
  bool use_gpus = true;
  // world_size: devices of one kind, all at once.
  int64_t devices = 1;
};

// What each queue holds, and what its cohort holds, for one resource at a time. The queue's
// cohort is the queue itself when it has none.
class QuotaLedger {
 public:
  // `in_use`: devices held by each queue's running jobs (those the pass's allocations hold).
  // Holdings of queues config does not define are ignored.
  QuotaLedger(const QueueConfig& config, const std::map<std::string, Resources>& in_use);

  int64_t Used(const QueueSpec& queue, ResourceKind kind) const;
  int64_t CohortUsed(const QueueSpec& queue, ResourceKind kind) const;
  int64_t CohortTotal(const QueueSpec& queue, ResourceKind kind) const;
  // Devices the queue uses beyond its nominal quota (0 when within it).
  int64_t Borrowed(const QueueSpec& queue, ResourceKind kind) const;
  // Counts `devices` more (fewer when negative) against the queue and its cohort.
  void Add(const QueueSpec& queue, ResourceKind kind, int64_t devices);

  // nullopt when `devices` more fit the queue's quota with `reserved` of the cohort's unused
  // quota kept for others; otherwise why not, in the words of the reasons above.
  std::optional<std::string> WhyNotFit(const QueueSpec& queue, ResourceKind kind, int64_t devices,
                                       int64_t reserved = 0) const;

  // nullopt when `devices` more keep the queue within nominal, or (in a cohort) within nominal +
  // borrowing limit, whatever the cohort has unused; otherwise why not.
  std::optional<std::string> WhyOverLimit(const QueueSpec& queue, ResourceKind kind,
                                          int64_t devices) const;

  // "cohort lab" or "queue nlp" (no cohort).
  static std::string CohortLabel(const QueueSpec& queue);

 private:
  static std::string CohortKey(const QueueSpec& queue);
  // "queue nlp: 56 of 64 GPUs in use, needs 16".
  std::string Head(const QueueSpec& queue, ResourceKind kind, int64_t devices) const;

  std::map<std::string, Resources> queue_used_;
  std::map<std::string, Resources> cohort_used_;
  std::map<std::string, Resources> cohort_total_;
};

// Why `request` can never start under its queue's quota, even with the cohort idle: more devices
// than nominal + borrowing limit, or than the cohort holds, or an unknown queue. nullopt when it
// could. For submission (FAILED_PRECONDITION), beside the scheduler's Unsatisfiable().
std::optional<std::string> QuotaUnsatisfiable(const QueueConfig& config,
                                              const QueuedRequest& request);

struct QuotaAdmission {
  // Job ids allowed to try placement this pass, in the order admission took them.
  std::vector<std::string> admitted{};
  // Of those, the ones that take their queue beyond its nominal quota (they borrow, and may be
  // reclaimed later).
  std::set<std::string> borrowing{};
  // Every request not admitted, keyed by job_id: why.
  std::map<std::string, std::string> held{};
};

// One pass of quota admission, by the policy above. `in_use`: what each queue's running jobs
// hold; `shares`: each queue's fair share (FairShareTracker::Shares), queues absent count 0.
// Deterministic: the result does not depend on the order of `requests`.
QuotaAdmission AdmitByQuota(const QueueConfig& config,
                            const std::map<std::string, Resources>& in_use,
                            const std::map<std::string, double>& shares,
                            std::vector<QueuedRequest> requests);

}  // namespace tessera::coordinator

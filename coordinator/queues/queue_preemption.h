// Preemption selection: which running jobs to stop so that a waiting job can start under its
// queue's quota. The decision only: it stops nothing and checkpoints nothing; the coordinator
// asks the victims to checkpoint and stop, and the waiting job starts on a later pass. Pure
// logic: no gRPC, store, threads or clock.
//
// Policy, for the waiting job's resource (GPUs or CPU slots) only:
//
// * Nothing is preempted for a job that already fits its queue's quota (if it waits, it waits
//   for free nodes, which preemption by quota cannot judge), in an unknown queue, or when no
//   queues are configured.
// * Reclaim. When the job would keep its queue within its nominal quota but the cohort's quota
//   is lent to other queues, running jobs of the other queues of the cohort that borrow (use
//   more than their nominal quota at that moment) are reclaimed until the job fits. A job is a
//   candidate only while its queue still borrows, counting the victims taken before it.
// * Priority. Otherwise (or when reclaiming cannot free enough), running jobs of the job's own
//   queue with a strictly lower priority are preempted until the job fits its quota (within
//   nominal, or within its borrowing limit and what the cohort has unused).
// * Victims are taken by priority (lowest first), then least progress lost (shortest time since
//   their last checkpoint), then larger first (fewer victims), then job_id. Only a set of
//   victims that makes the job fit is returned: never a partial one.
//
// Preemption frees quota; whether the gang then fits on the freed nodes (topology, gpu_type,
// node_selector) is the gang scheduler's question: the caller should check Schedule() against
// the capacity the victims would leave before acting.
//
// Thread safety: a pure function.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "coordinator/queues/queue_admission.h"
#include "coordinator/queues/queue_config.h"

namespace tessera::coordinator {

// One running job as preemption sees it.
struct RunningJob {
  std::string job_id{};
  std::string queue{};
  int priority = 0;
  bool use_gpus = true;
  // Devices it holds (world_size).
  int64_t devices = 0;
  // Progress lost if it stops now: the time since its last checkpoint (or since it started).
  absl::Duration since_checkpoint{};
};

// Why a job is preempted: its queue borrows quota another queue of its cohort reclaims, or a
// job of higher priority in its own queue needs its devices.
enum class PreemptionKind { kReclaim, kPriority };

// "reclaim" or "priority": the reason label of the preemption metrics.
const char* PreemptionKindName(PreemptionKind kind);

struct Victim {
  std::string job_id{};
  PreemptionKind kind = PreemptionKind::kReclaim;
  // Why this job, e.g. "reclaimed for queue nlp (below its nominal 32 GPUs): queue vision
  // borrows 8 GPUs".
  std::string reason{};
};

struct PreemptionDecision {
  // In the order they were chosen; empty: preempt nothing.
  std::vector<Victim> victims{};
  // Why these victims, or why none.
  std::string reason{};
};

// The victim order above: whether `a` is taken before `b`.
bool VictimBefore(const RunningJob& a, const RunningJob& b);

// "priority 0, 42s since its last checkpoint": why a victim was taken, for its reason.
std::string DescribeVictim(const RunningJob& job);

// The victims that let `waiting` start under its quota, by the policy above. `running` must hold
// every running job (their holdings are the queues' usage).
PreemptionDecision SelectPreemption(const QueueConfig& config,
                                    const std::vector<RunningJob>& running,
                                    const QueuedRequest& waiting);

}  // namespace tessera::coordinator

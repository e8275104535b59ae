// The planning stage of a scheduling pass: each waiting job becomes a gang request for the devices
// it would get. An automatic layout is chosen for the nodes free now (a restarting job that lost
// devices is fitted to fewer data-parallel replicas when that is all there is), an explicit one is
// checked against them; a job nothing fits is set aside with the planner's explanation as its
// pending reason. Plans are cached per job until the device they were made for changes: planning
// every waiting job in every pass would cost more than the rest of the pass.
//
// It reads only its inputs (the waiting jobs and the free capacity the pass's snapshot left) and
// its cache: no store, no cluster lock. Thread safety: not thread-safe; the scheduling pass owns
// one and runs one pass at a time.
#pragma once

#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/scheduler/scheduler.h"
#include "planner/job_plan.h"
#include "tessera/v1/job.pb.h"
#include "tessera/v1/layout.pb.h"

namespace tessera::coordinator {

// What the planning stage hands on: the requests to place and, by job id, what each placement
// would start with.
struct PlannedJobs {
  // One per planned job, in the order of the waiting list.
  std::vector<GangRequest> requests;
  // The waiting jobs that have a request (pointers into the pass's listing).
  std::map<std::string, const v1::Job*> jobs;
  // The spec each starts with: the submitted one, or fitted to fewer devices (a restart).
  std::map<std::string, v1::JobSpec> specs;
  // The plan each starts with: fitted to the devices on offer, or its provisional plan where it
  // cannot be planned here (no matching node yet: the scheduler says why it waits).
  std::map<std::string, v1::LayoutPlan> plans;
  // Jobs set aside because no layout fits the devices on offer, with the planner's explanation.
  std::map<std::string, std::string> unfit;
};

class PlanStage {
 public:
  // Plans the jobs of `listed` whose ids are in `waiting` (those without an allocation) for
  // `capacity` (the free devices of the pass's snapshot). The result points into `listed`.
  PlannedJobs Run(const std::vector<v1::Job>& listed, const std::set<std::string>& waiting,
                  const std::vector<NodeCapacity>& capacity);
  // Nothing waits: the cache is emptied.
  void Clear() { cache_.clear(); }
  // Plans made (not found in the cache) since construction, for tests and statistics.
  int64_t plans_made() const { return plans_made_; }

  // `spec` asking for `devices` devices of the kind it runs on.
  static v1::JobSpec WithDevices(v1::JobSpec spec, int devices);
  // The devices `spec` asks for (GPUs, or CPU slots for a CPU job).
  static int RequestedDevices(const v1::JobSpec& spec);

 private:
  // `job`'s plan for `target`, computed again only when the target (or the device count, for a
  // job re-planned after losing devices) changed.
  const absl::StatusOr<v1::LayoutPlan>& Cached(const v1::Job& job, const v1::JobSpec& spec,
                                               const absl::StatusOr<planner::DeviceTarget>& target);

  struct Entry {
    std::string fingerprint;
    std::optional<absl::StatusOr<v1::LayoutPlan>> plan;
  };
  std::map<std::string, Entry> cache_;
  int64_t plans_made_ = 0;
};

}  // namespace tessera::coordinator

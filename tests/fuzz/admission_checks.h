// What the job_spec and job_validation fuzz targets do with a spec: the coordinator's admission
// (coordinator/admission/job_validation.h) in SubmitJob's order, aborting when a result breaks the
// contract that header states.
#pragma once

#include <cstdint>

#include "coordinator/admission/job_validation.h"
#include "tessera/v1/job.pb.h"
#include "tests/fuzz/contract.h"

namespace tessera::fuzz {

inline void CheckAdmission(const v1::JobSpec& spec) {
  if (!coordinator::ValidateJobSpec(spec).ok()) return;
  const absl::Status runs = coordinator::ValidateTrainerRuns(spec);
  if (!runs.ok() && !absl::IsUnimplemented(runs)) {
    ContractBroken("ValidateTrainerRuns: an error other than UNIMPLEMENTED");
  }
  // PlanJob plans every spec that ValidateJobSpec accepts.
  const absl::StatusOr<v1::LayoutPlan> plan = coordinator::PlanJob(spec);
  if (!plan.ok()) ContractBroken("PlanJob refused a spec that ValidateJobSpec accepted");
  const v1::Layout& layout = plan->layout();
  if (plan->world_size() < 1 || layout.data_parallel() < 1 || plan->micro_batch_size() < 1 ||
      plan->gradient_accumulation_steps() < 1) {
    ContractBroken("PlanJob: a world size, data_parallel, micro batch or accumulation below 1");
  }
  if (int64_t{plan->gradient_accumulation_steps()} * plan->micro_batch_size() *
          layout.data_parallel() !=
      spec.batch().global_batch_size()) {
    ContractBroken("PlanJob: accumulation x micro batch x data_parallel != global_batch_size");
  }
}

}  // namespace tessera::fuzz

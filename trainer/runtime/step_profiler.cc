#include "trainer/runtime/step_profiler.h"

#include <torch/csrc/autograd/profiler_kineto.h>

#include <filesystem>
#include <set>
#include <system_error>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "trainer/torch_pch.h"
#if TESSERA_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace tessera::trainer {
namespace {

namespace profiler = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

std::set<ActivityType> Activities(bool cuda) {
  std::set<ActivityType> activities{ActivityType::CPU};
  if (cuda) activities.insert(ActivityType::CUDA);
  return activities;
}

}  // namespace

absl::Status ParseProfileSteps(const std::string& text, StepProfileOptions* options) {
  const std::vector<std::string> parts = absl::StrSplit(text, ':');
  int64_t first = 0, steps = 0;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &first) ||
      !absl::SimpleAtoi(parts[1], &steps) || first < 1 || steps < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "profile steps must be FIRST:COUNT with both at least 1 (e.g. 6:3), not '", text, "'"));
  }
  options->first_step = first;
  options->steps = steps;
  return absl::OkStatus();
}

StepProfiler::~StepProfiler() {
  if (recording_) profiler::disableProfiler();
}

void StepProfiler::BeforeStep(int64_t step) {
  if (options_.directory.empty() || recording_ || !written_.empty() ||
      step != options_.first_step) {
    return;
  }
  const ProfilerConfig config(ProfilerState::KINETO, /*report_input_shapes=*/false,
                              /*profile_memory=*/false, /*with_stack=*/false);
  profiler::prepareProfiler(config, Activities(cuda_));
  profiler::enableProfiler(config, Activities(cuda_));
  recording_ = true;
}

absl::StatusOr<std::string> StepProfiler::AfterStep(int64_t step, bool training_ends) {
  if (!recording_) return std::string();
  if (step < options_.first_step + options_.steps - 1 && !training_ends) return std::string();
  if (absl::Status status = Stop(); !status.ok()) return status;
  return written_;
}

absl::Status StepProfiler::Stop() {
#if TESSERA_WITH_CUDA
  // The kernels of the last step may still be queued: the trace ends when they have run.
  if (cuda_) c10::cuda::device_synchronize();
#endif
  std::unique_ptr<profiler::ProfilerResult> result = profiler::disableProfiler();
  recording_ = false;
  std::error_code error;
  std::filesystem::create_directories(options_.directory, error);
  if (error) {
    return absl::FailedPreconditionError(absl::StrCat("cannot create the profile directory ",
                                                      options_.directory, ": ", error.message()));
  }
  const std::string path =
      (std::filesystem::path(options_.directory) / absl::StrCat("trace-rank-", rank_, ".json"))
          .string();
  if (result == nullptr) {
    return absl::InternalError("the profiler returned no result");
  }
  result->save(path);
  if (!std::filesystem::exists(path)) {
    return absl::InternalError(absl::StrCat("the profiler did not write ", path));
  }
  written_ = path;
  return absl::OkStatus();
}

}  // namespace tessera::trainer

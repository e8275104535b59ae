// A profile of a few training steps: LibTorch's Kineto profiler (the one torch.profiler drives)
// records the operators the trainer runs and, on a GPU, every kernel, copy and CUDA runtime call,
// and writes a Chrome trace (chrome://tracing, Perfetto). bench/profile_summary.py reads it; so it
// does the PyTorch baseline's trace (bench/pytorch_baseline.py "profile_dir"), which makes the two
// sides' kernels and idle time comparable.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tessera::trainer {

struct StepProfileOptions {
  std::string directory;   // empty: no profile
  int64_t first_step = 0;  // 1-based; profiling starts before it
  int64_t steps = 0;       // how many steps are recorded
};

// Parses --profile_steps's FIRST:COUNT (both >= 1).
absl::Status ParseProfileSteps(const std::string& text, StepProfileOptions* options);

class StepProfiler {
 public:
  StepProfiler(StepProfileOptions options, int rank, bool cuda)
      : options_(std::move(options)), rank_(rank), cuda_(cuda) {}
  ~StepProfiler();
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  // Before step `step` (1-based) runs: starts recording at the first profiled step.
  void BeforeStep(int64_t step);
  // After step `step` finished: at the last profiled step, waits for the device, stops and
  // writes DIRECTORY/trace-rank-R.json. Also called when training ends early (a shorter run
  // than the range writes what it recorded). Returns the trace's path when this call wrote it,
  // else an empty string.
  absl::StatusOr<std::string> AfterStep(int64_t step, bool training_ends);

  // The trace's path once written; empty before.
  const std::string& written() const { return written_; }

 private:
  absl::Status Stop();

  StepProfileOptions options_;
  int rank_;
  bool cuda_;
  bool recording_ = false;
  std::string written_;
};

}  // namespace tessera::trainer

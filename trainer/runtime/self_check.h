// A quick end-to-end check of the LibTorch runtime on one device: a small
// MLP trained for a few AdamW steps. `tessera-trainer --check` runs it so an
// operator can see that a node's LibTorch, device and kernels work before
// scheduling real jobs onto it.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "trainer/kernels/device.h"

namespace tessera::trainer {

struct SelfCheckOptions {
  // GPU ordinal, or -1 for the CPU.
  int gpu_index = -1;
  // AdamW steps to run.
  int steps = 50;
  // Seed of data and initialisation.
  unsigned long long seed = 1234;
};

struct SelfCheckResult {
  DeviceInfo device;
  double first_loss = 0;
  double last_loss = 0;
  int steps = 0;
  double seconds = 0;
};

// Runs the check. LibTorch errors come back as INTERNAL with their message;
// a loss that does not fall is FAILED_PRECONDITION.
absl::StatusOr<SelfCheckResult> RunSelfCheck(const SelfCheckOptions& options);

// One JSON object on one line, for logs and scripts.
std::string ToJson(const SelfCheckResult& result);

}  // namespace tessera::trainer

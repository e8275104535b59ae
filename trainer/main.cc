// tessera-trainer: the process that trains one rank of a job. Launched by a
// worker with a task file, or run standalone.
#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "common/command_line.h"
#include "common/version.h"
#include "trainer/self_check.h"

ABSL_FLAG(bool, check, false,
          "Train a small MLP for a few AdamW steps on --gpu (or the CPU) and print the "
          "result as one JSON line; exit 0 when the loss falls.");
ABSL_FLAG(int, gpu, -1, "CUDA device ordinal for --check; -1 uses the CPU.");
ABSL_FLAG(int, steps, 50, "Optimizer steps of --check.");
ABSL_FLAG(std::string, task, "",
          "Path of the TrainerTask file written by the worker (tessera.v1.TrainerTask).");

constexpr char kUsage[] =
    "Usage: tessera-trainer --task=PATH | --check [--gpu=N] [--steps=N]\n\n"
    "Trains one rank of a Tessera job.\n"
    "  --task=PATH  run the rank described by a worker's task file\n"
    "  --check      train a small MLP on this device to check LibTorch\n";

int main(int argc, char** argv) {
  tessera::ParseCommandLine(argc, argv, kUsage);

  if (absl::GetFlag(FLAGS_check)) {
    auto result = tessera::trainer::RunSelfCheck(
        {.gpu_index = absl::GetFlag(FLAGS_gpu), .steps = absl::GetFlag(FLAGS_steps)});
    if (!result.ok()) {
      std::cerr << "tessera-trainer: check failed: " << result.status() << "\n";
      return 1;
    }
    std::cout << tessera::trainer::ToJson(*result) << "\n";
    return 0;
  }
  if (!absl::GetFlag(FLAGS_task).empty()) {
    std::cerr << "tessera-trainer: running a task file is not built yet (trainer runtime issue); "
                 "use --check\n";
    return 2;
  }
  std::cerr << "tessera-trainer: nothing to do; pass --task=PATH or --check (see --help)\n";
  return 2;
}

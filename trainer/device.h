// Device selection for a trainer rank: the CUDA device when this build has
// CUDA code paths and a GPU is visible, else the CPU. Plain types only, so
// callers need no LibTorch headers.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace tessera::trainer {

struct DeviceInfo {
  // "cuda" or "cpu".
  std::string type;
  // CUDA ordinal, -1 for CPU.
  int index = -1;
  // e.g. "NVIDIA H100 80GB HBM3", or "cpu (N threads)".
  std::string name;
  // Device memory, 0 for CPU.
  long long memory_bytes = 0;
  // Collective backend c10d uses on it: "nccl" or "gloo".
  std::string backend;
};

// Number of CUDA devices LibTorch sees; 0 in CPU builds.
int CudaDeviceCount();

// Describes the device for `gpu_index` (-1 for CPU). NOT_FOUND for an
// index that does not exist; FAILED_PRECONDITION asking for a GPU in a CPU build.
absl::StatusOr<DeviceInfo> DescribeDevice(int gpu_index);

// The device a rank should use when nothing is specified: GPU `local_rank`
// when there are GPUs, else the CPU.
DeviceInfo DefaultDevice(int local_rank);

}  // namespace tessera::trainer

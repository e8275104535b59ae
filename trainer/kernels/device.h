// Device selection for a trainer rank: the CUDA device when this build has
// CUDA code paths and a GPU is visible, else the CPU. Plain types only, so
// callers need no LibTorch headers.
#pragma once

#include <cstddef>
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

// Blocks up to this size come from malloc's heap instead of a mapping of their own: glibc's
// maximum on 64-bit (a larger value is refused and the dynamic threshold stays).
inline constexpr size_t kHostMmapThresholdBytes = size_t{32} << 20;
// Free memory at the heap's top is handed back to the kernel only beyond this.
inline constexpr size_t kHostTrimThresholdBytes = size_t{1} << 30;

// Keeps the host memory a training step frees for the next step. By default glibc's malloc
// returns large freed blocks to the kernel (munmap, or trimming the heap's top), so every step
// pays a page fault and the kernel's zeroing for each page of its activations and gradients
// again: ~25,000 faults a step, a tenth of the step's time in the kernel, for the CPU benchmark's
// GPT-2 (docs/performance.md). The trainer's steps repeat the same allocations, so the memory
// is kept at the step's peak instead, as a caching allocator would. Process-wide: call once at
// start-up, before other threads allocate. False when malloc refused a setting.
bool RetainFreedHostMemory();

}  // namespace tessera::trainer

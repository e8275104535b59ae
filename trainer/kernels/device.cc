#include "trainer/kernels/device.h"

#include <malloc.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "trainer/torch_pch.h"

#if TESSERA_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace tessera::trainer {

int CudaDeviceCount() {
#if TESSERA_WITH_CUDA
  return static_cast<int>(c10::cuda::device_count());
#else
  return 0;
#endif
}

absl::StatusOr<DeviceInfo> DescribeDevice(int gpu_index) {
  if (gpu_index < 0) {
    return DeviceInfo{.type = "cpu",
                      .index = -1,
                      .name = absl::StrCat("cpu (", at::get_num_threads(), " threads)"),
                      .memory_bytes = 0,
                      .backend = "gloo"};
  }
#if TESSERA_WITH_CUDA
  int count = CudaDeviceCount();
  if (gpu_index >= count) {
    return absl::NotFoundError(
        absl::StrCat("gpu_index ", gpu_index, ": this machine has ", count, " CUDA device(s)"));
  }
  const cudaDeviceProp* props = at::cuda::getDeviceProperties(gpu_index);
  return DeviceInfo{.type = "cuda",
                    .index = gpu_index,
                    .name = props->name,
                    .memory_bytes = static_cast<long long>(props->totalGlobalMem),
                    .backend = "nccl"};
#else
  return absl::FailedPreconditionError(absl::StrCat(
      "gpu_index ", gpu_index, ": this build has no CUDA code paths (TESSERA_WITH_CUDA=OFF)"));
#endif
}

DeviceInfo DefaultDevice(int local_rank) {
  int count = CudaDeviceCount();
  if (count > 0) {
    auto gpu = DescribeDevice(local_rank % count);
    if (gpu.ok()) return *gpu;
  }
  return *DescribeDevice(-1);
}

bool RetainFreedHostMemory() {
  // Setting either threshold also turns off glibc's dynamic adjustment of both.
  const bool mmap_set = mallopt(M_MMAP_THRESHOLD, static_cast<int>(kHostMmapThresholdBytes)) == 1;
  const bool trim_set = mallopt(M_TRIM_THRESHOLD, static_cast<int>(kHostTrimThresholdBytes)) == 1;
  return mmap_set && trim_set;
}

}  // namespace tessera::trainer

// What the ShardedEngine's source files share and its header keeps private: the bf16 autocast
// scope of forward, and the definition of the micro-batch CUDA graph (sharded_engine.h declares
// it only). Include it from sharded_engine*.cc alone.
#pragma once

#include <ATen/autocast_mode.h>

#include <cstdint>
#include <memory>

#if TESSERA_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#endif

#include "trainer/engine/sharded_engine.h"

namespace tessera::trainer::sharded_engine_internal {

// Enables bf16 autocast on CUDA for its lifetime.
class AutocastScope {
 public:
  explicit AutocastScope(bool enabled) : enabled_(enabled) {
    if (!enabled_) return;
    at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
    at::autocast::set_autocast_enabled(at::kCUDA, true);
  }
  ~AutocastScope() {
    if (!enabled_) return;
    at::autocast::set_autocast_enabled(at::kCUDA, false);
    at::autocast::clear_cache();
  }

 private:
  bool enabled_;
};

}  // namespace tessera::trainer::sharded_engine_internal

namespace tessera::trainer {

// The micro-batch graph of cuda_graphs, and the static tensors it reads and writes.
struct ShardedEngine::CudaGraph {
  // Eager micro-batches before the capture, so that lazily created state (cuBLAS handles and
  // workspaces, the attention kernels' choices) exists before it.
  static constexpr int kWarmupMicroBatches = 3;
  int eager_micro_batches = 0;
  int64_t micro_batches = 0;  // every one seen, for the status
  bool live = false;
  bool off = false;
#if TESSERA_WITH_CUDA
  std::unique_ptr<at::cuda::CUDAGraph> graph;
#endif
  at::Tensor inputs, targets, scale, loss;
};

}  // namespace tessera::trainer

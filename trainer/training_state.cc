#include "trainer/training_state.h"

#include <ATen/CPUGeneratorImpl.h>
#if TESSERA_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace tessera::trainer {
namespace {

constexpr char kStepName[] = "optimizer.step";
// Threads reading a checkpoint's ranges at once (at most the machine's cores).
constexpr size_t kReadThreads = 4;

std::string RngName(int rank) { return absl::StrFormat("rng/cpu/rank-%05d", rank); }

}  // namespace

namespace {

// The shard's slices: every range, AdamW's step (rank 0) and the RNG state. `host` keeps the
// CPU copies of device tensors alive; `step` must outlive the slices.
std::vector<SliceToWrite> SlicesOf(const std::vector<TensorRange>& ranges, const int64_t* step,
                                   const at::Tensor& rng, int rank, std::vector<at::Tensor>* host) {
  std::vector<SliceToWrite> slices;
  slices.reserve(ranges.size() + 2);
  for (const TensorRange& range : ranges) {
    host->push_back(range.data.to(at::kCPU).contiguous());
    slices.push_back({.name = range.name,
                      .dtype = "F32",
                      .global_shape = range.global_shape,
                      .offset = range.offset,
                      .numel = host->back().numel(),
                      .data = host->back().data_ptr(),
                      .box_offset = range.box_offset,
                      .box_shape = range.box_shape});
  }
  if (rank == 0) slices.push_back({.name = kStepName, .dtype = "I64", .numel = 1, .data = step});
  slices.push_back({.name = RngName(rank),
                    .dtype = "U8",
                    .global_shape = {rng.numel()},
                    .numel = rng.numel(),
                    .data = rng.data_ptr()});
  return slices;
}

}  // namespace

absl::StatusOr<WrittenShard> WriteTrainingState(
    const std::string& path, ShardedEngine& engine, int rank,
    const std::map<std::string, std::string>& metadata) {
  const std::vector<TensorRange> ranges = engine.SaveRanges();
  const int64_t step = engine.optimizer_step();
  const at::Tensor rng = at::detail::getDefaultCPUGenerator().get_state().contiguous();
  // Shard files are written from host memory; keep the CPU copies alive until then.
  std::vector<at::Tensor> host;
  return WriteShardFile(path, SlicesOf(ranges, &step, rng, rank, &host), metadata);
}

LiveTrainingState CaptureTrainingState(ShardedEngine& engine) {
  LiveTrainingState live;
  live.state.ranges = engine.SaveRanges();
  live.state.optimizer_step = engine.optimizer_step();
  live.state.rng = at::detail::getDefaultCPUGenerator().get_state().contiguous();
#if TESSERA_WITH_CUDA
  for (const TensorRange& range : live.state.ranges) {
    if (!range.data.is_cuda()) continue;
    // The engine keeps its state on one device: one event on that device's current stream.
    auto event = std::make_shared<at::cuda::CUDAEvent>();
    event->record(c10::cuda::getCurrentCUDAStream(range.data.get_device()));
    live.ready = std::move(event);
    break;
  }
#endif
  return live;
}

TrainingStateSnapshot CopyTrainingState(const LiveTrainingState& live,
                                        TrainingStateSnapshot* reuse) {
  torch::NoGradGuard no_grad;
  TrainingStateSnapshot snapshot;
  snapshot.ranges = live.state.ranges;
  snapshot.optimizer_step = live.state.optimizer_step;
  snapshot.rng = live.state.rng;
#if TESSERA_WITH_CUDA
  // Device ranges are copied on a stream of this thread's own, after the work that wrote them.
  std::optional<c10::cuda::CUDAStreamGuard> stream_guard;
  if (live.ready != nullptr) {
    auto* event = static_cast<at::cuda::CUDAEvent*>(live.ready.get());
    c10::cuda::CUDAStream stream = c10::cuda::getStreamFromPool(
        /*isHighPriority=*/false, static_cast<c10::DeviceIndex>(event->device_index()));
    event->block(stream);
    stream_guard.emplace(stream);
  }
#endif
  const bool reusable = reuse != nullptr && reuse->ranges.size() == snapshot.ranges.size();
  [[maybe_unused]] bool device_copies = false;
  for (size_t i = 0; i < snapshot.ranges.size(); ++i) {
    TensorRange& range = snapshot.ranges[i];
    const at::Tensor live_data = range.data;
    at::Tensor copy;
    if (reusable && reuse->ranges[i].data.numel() == live_data.numel() &&
        reuse->ranges[i].data.scalar_type() == live_data.scalar_type()) {
      copy = std::move(reuse->ranges[i].data);
    } else {
      // Pinned host memory for a device tensor: the copy runs at full DMA speed.
      copy = at::empty(
          {live_data.numel()},
          at::TensorOptions().dtype(live_data.scalar_type()).pinned_memory(live_data.is_cuda()));
    }
    if (live_data.is_cuda()) {
      copy.copy_(live_data.reshape({-1}), /*non_blocking=*/true);
      device_copies = true;
    } else if (live_data.is_contiguous()) {
      // The ranges are views of flat buffers: one memcpy, on this thread only (copy_ would use
      // the intra-op pool, which the training thread is busy with).
      std::memcpy(copy.data_ptr(), live_data.data_ptr(), live_data.nbytes());
    } else {
      copy.copy_(live_data.reshape({-1}));
    }
    range.data = std::move(copy);
  }
#if TESSERA_WITH_CUDA
  if (device_copies) c10::cuda::getCurrentCUDAStream().synchronize();
#endif
  return snapshot;
}

TrainingStateSnapshot SnapshotTrainingState(ShardedEngine& engine, TrainingStateSnapshot* reuse) {
  return CopyTrainingState(CaptureTrainingState(engine), reuse);
}

absl::StatusOr<WrittenShard> WriteTrainingStateSnapshot(
    const std::string& path, const TrainingStateSnapshot& snapshot, int rank,
    const std::map<std::string, std::string>& metadata) {
  std::vector<at::Tensor> host;  // the snapshot's own tensors: no copies
  return WriteShardFile(
      path, SlicesOf(snapshot.ranges, &snapshot.optimizer_step, snapshot.rng, rank, &host),
      metadata);
}

absl::Status ReadTrainingState(const ShardedCheckpointReader& reader, ShardedEngine& engine,
                               int rank) {
  // Every range is read with pread (ShardedCheckpointReader::Read is thread-safe), by several
  // threads at once: from the page cache a single thread copies at memory speed of one core, and
  // cold reads keep several requests in flight. Straight into the engine's memory when it is
  // contiguous float32 host memory; device tensors go through host buffers, copied on this
  // thread afterwards.
  const std::vector<TensorRange> ranges = engine.LoadRanges();
  std::vector<at::Tensor> host(ranges.size());
  for (size_t i = 0; i < ranges.size(); ++i) {
    const at::Tensor& data = ranges[i].data;
    const bool direct =
        data.is_cpu() && data.is_contiguous() && data.scalar_type() == at::kFloat;
    host[i] = direct ? data : at::empty({data.numel()}, at::kFloat);
  }
  std::vector<absl::Status> statuses(ranges.size());
  std::atomic<size_t> next{0};
  auto read_ranges = [&] {
    for (size_t i = next++; i < ranges.size(); i = next++) {
      const TensorRange& range = ranges[i];
      statuses[i] = reader.Read(range.name, range.global_shape, "F32", range.box_offset,
                                range.box_shape, range.offset, host[i].numel(),
                                host[i].data_ptr());
    }
  };
  const size_t threads = std::min<size_t>(
      {kReadThreads, std::max(1u, std::thread::hardware_concurrency()), ranges.size()});
  std::vector<std::thread> helpers;
  for (size_t t = 1; t < threads; ++t) helpers.emplace_back(read_ranges);
  read_ranges();
  for (std::thread& helper : helpers) helper.join();
  for (const absl::Status& status : statuses) RETURN_IF_ERROR(status);
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < ranges.size(); ++i) {
      if (!host[i].is_same(ranges[i].data)) {
        ranges[i].data.copy_(host[i].view(ranges[i].data.sizes()));
      }
    }
  }
  for (const std::string& name : reader.TensorNames()) {
    const bool model_state = absl::StartsWith(name, "model/") || absl::StartsWith(name, "exp_avg");
    if (model_state && !engine.Knows(name)) {
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoint tensor ", name,
                       " is not in this model: the checkpoint is from another model"));
    }
  }
  int64_t step = 0;
  RETURN_IF_ERROR(reader.Read(kStepName, {}, "I64", 0, 1, &step));
  engine.set_optimizer_step(step);
  const std::string rng = reader.Has(RngName(rank)) ? RngName(rank) : RngName(0);
  if (reader.Has(rng)) {
    ASSIGN_OR_RETURN(std::vector<int64_t> shape, reader.GlobalShape(rng));
    at::Tensor state = at::empty({shape.at(0)}, at::kByte);
    RETURN_IF_ERROR(reader.Read(rng, shape, "U8", 0, state.numel(), state.data_ptr()));
    at::Generator generator = at::detail::getDefaultCPUGenerator();
    generator.set_state(state);
  }
  return absl::OkStatus();
}

}  // namespace tessera::trainer

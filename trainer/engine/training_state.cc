#include "trainer/engine/training_state.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
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

StateCopy::StateCopy(const LiveTrainingState& live, TrainingStateSnapshot* reuse)
    : ready_(live.ready) {
  snapshot_.ranges = live.state.ranges;
  snapshot_.optimizer_step = live.state.optimizer_step;
  snapshot_.rng = live.state.rng;
  const bool reusable = reuse != nullptr && reuse->ranges.size() == snapshot_.ranges.size();
  sources_.reserve(snapshot_.ranges.size());
  for (size_t i = 0; i < snapshot_.ranges.size(); ++i) {
    TensorRange& range = snapshot_.ranges[i];
    sources_.push_back(range.data);
    const at::Tensor& source = sources_.back();
    on_device_ = on_device_ || source.is_cuda();
    if (reusable && reuse->ranges[i].data.numel() == source.numel() &&
        reuse->ranges[i].data.scalar_type() == source.scalar_type()) {
      range.data = std::move(reuse->ranges[i].data);
    } else {
      range.data = at::Tensor();  // allocated by the first thread that copies (Allocate)
    }
  }
}

bool StateCopy::Allocate() {
  try {
    std::call_once(allocated_, [this] {
      for (size_t i = 0; i < sources_.size(); ++i) {
        at::Tensor& copy = snapshot_.ranges[i].data;
        if (copy.defined()) continue;
        // Pinned host memory for a device tensor: the copy runs at full DMA speed. Pinning
        // takes time in proportion to the bytes: done here, on the save's thread for device
        // state.
        const at::Tensor& source = sources_[i];
        copy = at::empty(
            {source.numel()},
            at::TensorOptions().dtype(source.scalar_type()).pinned_memory(source.is_cuda()));
      }
    });
    return true;
  } catch (const std::exception& e) {
    // No copy without buffers: every range not yet claimed ends, with the error.
    {
      std::lock_guard lock(mutex_);
      error_ = absl::StrCat("allocating host buffers: ", c10::GetExceptionString(e));
    }
    const size_t n = sources_.size();
    const size_t first = next_.exchange(n);
    if (first < n) CountDone(n - first);
    return false;
  }
}

void StateCopy::CountDone(size_t ranges) {
  std::lock_guard lock(mutex_);
  done_ += ranges;
  if (done_ == sources_.size()) done_cv_.notify_all();
}

void StateCopy::CopyRange(size_t i) {
  const at::Tensor& source = sources_[i];
  at::Tensor& copy = snapshot_.ranges[i].data;
  if (source.numel() == 0) return;
  if (source.is_contiguous()) {
    // The ranges are views of flat buffers: one memcpy, on this thread only (copy_ would start
    // the intra-op pool's threads).
    std::memcpy(copy.data_ptr(), source.data_ptr(), source.nbytes());
  } else {
    copy.copy_(source.reshape({-1}));
  }
}

void StateCopy::Run() {
  torch::NoGradGuard no_grad;
  if (!Allocate()) return;
  const size_t n = sources_.size();
  if (!on_device_) {
    for (size_t i = next_++; i < n; i = next_++) {
      try {
        CopyRange(i);
      } catch (const std::exception& e) {
        std::lock_guard lock(mutex_);
        error_ = c10::GetExceptionString(e);
      }
      CountDone(1);
    }
    return;
  }
  // Device ranges: all of them, by this thread.
  const size_t first = next_.exchange(n);
  if (first >= n) return;
  try {
#if TESSERA_WITH_CUDA
    // On a stream of this thread's own, after the work that wrote them.
    auto* event = static_cast<at::cuda::CUDAEvent*>(ready_.get());
    const c10::DeviceIndex device = event != nullptr ? event->device_index()
                                                     : sources_[first].device().index();
    c10::cuda::CUDAStream stream =
        c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device);
    if (event != nullptr) event->block(stream);
    const c10::cuda::CUDAStreamGuard guard(stream);
    for (size_t i = first; i < n; ++i) {
      if (sources_[i].is_cuda()) {
        snapshot_.ranges[i].data.copy_(sources_[i].reshape({-1}), /*non_blocking=*/true);
      } else {
        CopyRange(i);
      }
    }
    stream.synchronize();
#else
    for (size_t i = first; i < n; ++i) CopyRange(i);
#endif
  } catch (const std::exception& e) {
    std::lock_guard lock(mutex_);
    error_ = c10::GetExceptionString(e);
  }
  CountDone(n - first);
}

void StateCopy::Finish() {
  if (!on_device_ && next_.load() < sources_.size() && Allocate()) {
    at::parallel_for(0, at::get_num_threads(), 1, [this](int64_t, int64_t) { Run(); });
  }
  WaitDone();
}

void StateCopy::WaitDone() {
  std::unique_lock lock(mutex_);
  done_cv_.wait(lock, [this] { return done_ == sources_.size(); });
}

bool StateCopy::done() {
  std::lock_guard lock(mutex_);
  return done_ == sources_.size();
}

absl::StatusOr<TrainingStateSnapshot> StateCopy::Take() {
  WaitDone();
  if (!error_.empty()) return absl::InternalError(absl::StrCat("copying the state: ", error_));
  // sources_ stays: a thread leaving Run or Finish may still read its size.
  return std::move(snapshot_);
}

TrainingStateSnapshot SnapshotTrainingState(ShardedEngine& engine, TrainingStateSnapshot* reuse) {
  StateCopy copy(CaptureTrainingState(engine), reuse);
  copy.Run();
  absl::StatusOr<TrainingStateSnapshot> snapshot = copy.Take();
  TORCH_CHECK(snapshot.ok(), snapshot.status().ToString());
  return *std::move(snapshot);
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

#include "trainer/engine/sharded_engine.h"

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#if TESSERA_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "trainer/parallel/peer_wait.h"

namespace tessera::trainer {
namespace {

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

// Tells the engine that parameter `entry` of `unit` has its gradient for this backward.
class GradientReadyHook final : public torch::autograd::PostAccumulateGradHook {
 public:
  GradientReadyHook(ShardedEngine* engine, int unit, int entry)
      : engine_(engine), unit_(unit), entry_(entry) {}
  void operator()(const torch::autograd::Variable& /*param*/) override {
    engine_->OnGradientReady(unit_, entry_);
  }

 private:
  ShardedEngine* engine_;
  int unit_;
  int entry_;
};

// The unit of a parameter by its name: 1 + i for "layers.<first_layer + i>.*", 0 otherwise.
int UnitOf(const std::string& name, int first_layer) {
  if (!absl::StartsWith(name, "layers.")) return 0;
  const size_t dot = name.find('.', 7);
  int layer = 0;
  TORCH_CHECK(dot != std::string::npos && absl::SimpleAtoi(name.substr(7, dot - 7), &layer),
              "parameter name ", name, " does not name its layer");
  return 1 + layer - first_layer;
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

ShardedEngine::ShardedEngine(CausalLM model, const ShardedEngineOptions& options)
    : model_(std::move(model)), options_(options) {
  TORCH_CHECK(options_.zero_stage >= 0 && options_.zero_stage <= 3, "zero_stage ",
              options_.zero_stage, " is not in 0..3");
  TORCH_CHECK(options_.dp_size >= 1 && options_.dp_rank >= 0 && options_.dp_rank < options_.dp_size,
              "dp rank ", options_.dp_rank, " of ", options_.dp_size);
  TORCH_CHECK(options_.dp_size == 1 || options_.dp_group, "dp ", options_.dp_size,
              " needs a process group");
  TORCH_CHECK(options_.tp.size == model_->partition().tp.size,
              "the engine's tensor parallelism differs from the model's");
  TORCH_CHECK(options_.pp_size == 1 || options_.pp_group, "pp ", options_.pp_size,
              " needs a process group");
  for (const std::string& name : model_->TrainableParameterNames()) names_.insert(name);
  BuildUnits();
  BuildRuns();
  if (stage() == 3) model_->SetLayerHooks(this);
  if (options_.cuda_graphs) {
    std::string why;
    bool cuda = false;
    for (const Unit& unit : units_) cuda = cuda || (unit.full.defined() && unit.full.is_cuda());
    if (!TESSERA_WITH_CUDA) {
      why = "this trainer was built without CUDA";
    } else if (!cuda) {
      why = "the model is not on a CUDA device";
    } else if (stage() > 1) {
      why = absl::StrCat("ZeRO stage ", stage(), " (graphs run ZeRO 0 and 1)");
    } else if (options_.dp_size > 1 || options_.pp_size > 1 || options_.tp.enabled()) {
      why = "more than one rank (graphs run a rank alone: dp, tp and pp 1)";
    } else if (model_->activation_checkpointing() != v1::ACTIVATION_CHECKPOINTING_NONE) {
      why = "activation checkpointing";
    }
    if (why.empty()) {
      graph_ = std::make_unique<CudaGraph>();
      graph_status_ = "warming up";
    } else {
      graph_status_ = "off: " + why;
    }
  }
}

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

ShardedEngine::~ShardedEngine() {
  if (stage() == 3) model_->SetLayerHooks(nullptr);
  for (Unit& unit : units_) {
    for (Entry& entry : unit.entries) {
      torch::autograd::impl::set_post_acc_grad_hooks(entry.param, nullptr);
    }
  }
}

void ShardedEngine::BuildUnits() {
  torch::NoGradGuard no_grad;
  units_.assign(1 + model_->num_local_layers(), Unit{});
  const ModelPartition& partition = model_->partition();
  const int tp = options_.tp.size;
  for (const auto& item : model_->named_parameters()) {
    const at::Tensor& param = item.value();
    // A frozen parameter (LoRA's base) stays as the model holds it: no gradient, no optimizer
    // state, not in checkpoints.
    if (!param.requires_grad()) continue;
    const ParamShard& shard = model_->ShardOf(item.key());
    Entry entry{.name = item.key(),
                .param = param,
                .shape = param.sizes().vec(),
                .numel = param.numel(),
                .decay = param.dim() >= 2,
                .pieces = ShardPieces(shard, options_.tp.rank, tp)};
    entry.replicated = tp > 1 && shard.kind == ParamShard::Kind::kReplicated;
    const bool tied_copy = item.key() == "embed.weight" && !partition.embedding;
    entry.saved = !tied_copy && (!entry.replicated || options_.tp.rank == 0);
    entry.norm_share = tied_copy ? 0.0 : (entry.replicated ? 1.0 / tp : 1.0);
    units_[UnitOf(item.key(), partition.first_layer)].entries.push_back(std::move(entry));
  }
  const int64_t dp = options_.dp_size;
  const bool deferred = model_->storage() == ParameterStorage::kDeferred;
  TORCH_CHECK(!deferred || stage() == 3,
              "a model without parameter storage (kDeferred) needs ZeRO-3, not stage ", stage());
  for (size_t u = 0; u < units_.size(); ++u) {
    Unit& unit = units_[u];
    std::stable_partition(unit.entries.begin(), unit.entries.end(),
                          [](const Entry& e) { return e.decay; });
    for (Entry& entry : unit.entries) {
      entry.offset = unit.numel;
      unit.numel += entry.numel;
      if (entry.decay) unit.decay_end = unit.numel;
    }
    unit.padded = CeilDiv(unit.numel, dp) * dp;
    unit.shard = unit.padded / dp;
    if (unit.entries.empty()) continue;  // the outer unit of a middle pipeline stage
    const at::TensorOptions f32 = deferred ? at::TensorOptions(at::kFloat).device(options_.device)
                                           : unit.entries.front().param.options().dtype(at::kFloat);
    // Deferred: memory that is freed below before anything reads it.
    unit.full = deferred ? at::empty({unit.padded}, f32) : at::zeros({unit.padded}, f32);
    for (Entry& entry : unit.entries) {
      at::Tensor view = unit.full.narrow(0, entry.offset, entry.numel).view(entry.shape);
      // The parameter keeps its identity (autograd meta, the module's references) and now
      // shares the unit's storage. set_data refuses to turn a meta tensor into a dense one; a
      // parameter no autograd graph has used yet (no gradient accumulator to reset) takes the
      // view's storage and device as set_data would.
      if (deferred) {
        TORCH_CHECK(entry.param.is_meta(), "parameter ", entry.name,
                    " of a kDeferred model has storage");
        entry.param.unsafeGetTensorImpl()->shallow_copy_from(view.getIntrusivePtr());
      } else {
        view.copy_(entry.param.detach());
        entry.param.set_data(view);
      }
    }
    if (stage() <= 1) {
      unit.full_grad = at::zeros({unit.padded}, f32);
      for (Entry& entry : unit.entries) {
        entry.param.mutable_grad() =
            unit.full_grad.narrow(0, entry.offset, entry.numel).view(entry.shape);
      }
      unit.shard_grad = unit.full_grad.narrow(0, OwnedBegin(unit), unit.shard);
    } else {
      unit.shard_grad = at::zeros({unit.shard}, f32);
    }
    if (stage() == 3) {
      unit.owned = deferred ? at::zeros({unit.shard}, f32)
                            : unit.full.narrow(0, OwnedBegin(unit), unit.shard).clone();
      unit.gather = GatherState::kGathered;
      Free(static_cast<int>(u));
    } else {
      unit.owned = unit.full.narrow(0, OwnedBegin(unit), unit.shard);
      unit.gather = GatherState::kGathered;
    }
    for (size_t e = 0; e < unit.entries.size(); ++e) {
      torch::autograd::impl::set_post_acc_grad_hooks(
          unit.entries[e].param,
          std::make_unique<GradientReadyHook>(this, static_cast<int>(u), static_cast<int>(e)));
    }
  }
}

void ShardedEngine::BuildRuns() {
  std::vector<AdamWGroup> groups(2);
  groups[0].weight_decay = options_.weight_decay;
  for (size_t u = 0; u < units_.size(); ++u) {
    Unit& unit = units_[u];
    // The range this rank steps: the whole unit under ZeRO 0, its shard otherwise.
    const int64_t begin = stage() == 0 ? 0 : std::min(unit.numel, OwnedBegin(unit));
    const int64_t end = stage() == 0 ? unit.numel : std::min(unit.numel, begin + unit.shard);
    for (const auto& [from, to, decay] :
         {std::tuple{begin, std::min(end, unit.decay_end), true},
          std::tuple{std::max(begin, unit.decay_end), end, false}}) {
      if (from >= to) continue;
      Run run;
      run.unit = static_cast<int>(u);
      run.begin = from;
      run.end = to;
      run.decay = decay;
      const int64_t owned_begin = stage() == 0 ? 0 : OwnedBegin(unit);
      run.param = (stage() == 3 ? unit.owned.narrow(0, from - owned_begin, to - from)
                                : unit.full.narrow(0, from, to - from))
                      .detach();
      run.param.mutable_grad() = stage() <= 1
                                     ? unit.full_grad.narrow(0, from, to - from)
                                     : unit.shard_grad.narrow(0, from - owned_begin, to - from);
      groups[decay ? 0 : 1].params.push_back(run.param);
      // Under ZeRO 0 every dp replica holds the whole gradient.
      const double replicas = stage() == 0 ? options_.dp_size : 1;
      for (const Entry& entry : unit.entries) {
        const int64_t a = std::max(from, entry.offset),
                      b = std::min(to, entry.offset + entry.numel);
        if (a >= b || entry.norm_share == 0) continue;
        norm_groups_[entry.norm_share / replicas].push_back(
            run.param.grad().narrow(0, a - from, b - a));
      }
      runs_.push_back(std::move(run));
    }
  }
  optimizer_ = std::make_unique<FusedAdamW>(std::move(groups), options_.adamw);
  // Moments exist from the start, so checkpoints and memory figures never depend on whether a
  // step ran yet.
  size_t counts[2] = {0, 0};
  for (Run& run : runs_) {
    run.state_index = counts[run.decay ? 0 : 1]++;
    optimizer_->StateFor(run.decay ? 0 : 1, run.state_index);
  }
}

absl::Status ShardedEngine::InitializeShards(const ParameterValues& values) {
  if (model_->storage() != ParameterStorage::kDeferred) {
    return absl::FailedPreconditionError(
        "InitializeShards fills the shards of a model built without parameter storage "
        "(kDeferred); this one was initialised when it was built");
  }
  torch::NoGradGuard no_grad;
  for (Unit& unit : units_) {
    const int64_t begin = OwnedBegin(unit), end = begin + unit.shard;
    for (const Entry& entry : unit.entries) {
      const int64_t from = std::max(begin, entry.offset),
                    to = std::min(end, entry.offset + entry.numel);
      if (from >= to) continue;
      absl::StatusOr<at::Tensor> value = values(entry.name);
      if (!value.ok()) return value.status();
      if (value->sizes().vec() != entry.shape) {
        return absl::InvalidArgumentError(absl::StrCat(
            "parameter ", entry.name, ": a value of shape [", absl::StrJoin(value->sizes(), ", "),
            "] for a parameter of shape [", absl::StrJoin(entry.shape, ", "), "]"));
      }
      unit.owned.narrow(0, from - begin, to - from)
          .copy_(value->reshape({-1}).narrow(0, from - entry.offset, to - from));
    }
  }
  return absl::OkStatus();
}

at::Tensor ShardedEngine::TakeBuffer(int64_t numel, const at::TensorOptions& options) {
  std::vector<at::Tensor>& spare = spare_buffers_[numel];
  if (spare.empty()) return at::empty({numel}, options);
  at::Tensor buffer = std::move(spare.back());
  spare.pop_back();
  return buffer;
}

void ShardedEngine::GiveBuffer(at::Tensor buffer) {
  if (!buffer.is_cpu()) return;  // CUDA's caching allocator already reuses blocks
  std::vector<at::Tensor>& spare = spare_buffers_[buffer.numel()];
  if (static_cast<int>(spare.size()) < kSpareBuffers) spare.push_back(std::move(buffer));
}

void ShardedEngine::AllocateFull(Unit& unit) {
  c10::StorageImpl* storage = unit.full.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(unit.padded) * unit.full.element_size();
  std::vector<at::DataPtr>& spare = spare_storage_[bytes];
  if (spare.empty()) {
    storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
  } else {
    storage->set_data_ptr_noswap(std::move(spare.back()));
    spare.pop_back();
  }
  storage->set_nbytes(bytes);
}

void ShardedEngine::StartGather(int u) {
  Unit& unit = units_[u];
  if (unit.gather != GatherState::kFreed || unit.entries.empty()) return;
  AllocateFull(unit);
  if (options_.dp_size == 1) {
    torch::NoGradGuard no_grad;
    unit.full.copy_(unit.owned);
    unit.gather = GatherState::kGathered;
    return;
  }
  unit.gather_work = GatherInto(unit, unit.owned);
  unit.gather = GatherState::kGathering;
}

c10::intrusive_ptr<c10d::Work> ShardedEngine::GatherInto(Unit& unit, const at::Tensor& shard) {
  if (!options_.sharded_collectives_as_all_reduce) {
    at::Tensor input = shard;
    return options_.dp_group->_allgather_base(unit.full, input);
  }
  // Every rank contributes its shard in place and zeros elsewhere; the sum is the gather.
  torch::NoGradGuard no_grad;
  const int64_t begin = OwnedBegin(unit);
  at::Tensor slot = unit.full.narrow(0, begin, unit.shard);
  if (!slot.is_same(shard) && slot.data_ptr() != shard.data_ptr()) slot.copy_(shard);
  unit.full.narrow(0, 0, begin).zero_();
  unit.full.narrow(0, begin + unit.shard, unit.padded - begin - unit.shard).zero_();
  std::vector<at::Tensor> tensors{unit.full};
  return options_.dp_group->allreduce(tensors);
}

void ShardedEngine::EnsureGathered(int u) {
  Unit& unit = units_[u];
  StartGather(u);
  if (unit.gather == GatherState::kGathering) {
    WaitForPeers(unit.gather_work);
    unit.gather_work.reset();
    unit.gather = GatherState::kGathered;
  }
}

void ShardedEngine::Free(int u) {
  Unit& unit = units_[u];
  if (unit.gather == GatherState::kFreed || unit.entries.empty()) return;
  if (unit.gather == GatherState::kGathering) WaitForPeers(unit.gather_work);
  unit.gather_work.reset();
  // Release the storage the parameters view, keeping the tensors (and whatever autograd saved
  // of them); the next gather puts fresh memory under the same storage.
  c10::StorageImpl* storage = unit.full.storage().unsafeGetStorageImpl();
  at::DataPtr memory = storage->set_data_ptr(at::DataPtr(nullptr, unit.full.device()));
  std::vector<at::DataPtr>& spare = spare_storage_[storage->nbytes()];
  if (unit.full.is_cpu() && static_cast<int>(spare.size()) < kSpareBuffers) {
    spare.push_back(std::move(memory));
  }
  storage->set_nbytes(0);
  unit.gather = GatherState::kFreed;
}

void ShardedEngine::BeforeLayer(int layer) {
  const int u = 1 + layer;
  EnsureGathered(u);
  if (u + 1 < static_cast<int>(units_.size())) StartGather(u + 1);
}

torch::Tensor ShardedEngine::AfterLayer(int layer, torch::Tensor output) {
  const int u = 1 + layer;
  if (output.requires_grad() && torch::GradMode::is_enabled()) {
    // Runs when backward reaches this layer: its parameters come back, the next one down is
    // prefetched.
    output.register_hook([this, u](const at::Tensor& grad) {
      EnsureGathered(u);
      if (u > 1) StartGather(u - 1);
      return grad;
    });
  }
  Free(u);
  return output;
}

at::Tensor ShardedEngine::GradientView(const Unit& unit, const Entry& entry) {
  return unit.full_grad.narrow(0, entry.offset, entry.numel).view(entry.shape);
}

void ShardedEngine::PrepareGradientsForAccumulation() {
  torch::NoGradGuard no_grad;
  for (Unit& unit : units_) {
    if (!unit.full_grad.defined()) continue;
    unit.full_grad.zero_();
    for (Entry& entry : unit.entries) entry.param.mutable_grad() = GradientView(unit, entry);
  }
  gradients_empty_ = false;
}

std::vector<double> ShardedEngine::GradientSignature() {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> norms;
  for (const Unit& unit : units_) {
    if (!unit.full_grad.defined()) continue;
    norms.push_back(unit.full_grad.abs().sum().to(at::kDouble));
    norms.push_back(unit.full_grad.norm().to(at::kDouble));
  }
  std::vector<double> values;
  if (norms.empty()) return values;
  const at::Tensor all = at::stack(norms).cpu();
  for (int64_t i = 0; i < all.numel(); ++i) values.push_back(all[i].item<double>());
  return values;
}

std::string ShardedEngine::CudaGraphStatus() const { return graph_status_; }

void ShardedEngine::BeginFirstBackward() {
  if (graph_ != nullptr) {
    // cuda_graphs: every backward accumulates into the flat gradients, as the graph does.
    if (gradients_empty_) PrepareGradientsForAccumulation();
    return;
  }
  if (stage() > 1 || !gradients_empty_) return;
  // Autograd accumulates into a defined .grad (grad += new) and takes the new gradient over
  // when .grad is undefined: without .grad, the first backward's gradients are copied into
  // the flat buffer once instead of being added to zeros written by the last step.
  for (Unit& unit : units_) {
    for (Entry& entry : unit.entries) {
      entry.param.mutable_grad().reset();
      entry.arrived = false;
    }
  }
  writing_first_gradients_ = true;
}

void ShardedEngine::EndFirstBackward() {
  if (!writing_first_gradients_) return;
  torch::NoGradGuard no_grad;
  for (Unit& unit : units_) {
    for (Entry& entry : unit.entries) {
      if (entry.arrived) continue;
      // No gradient this backward (or an exception cut it short): zeros, as before the step.
      at::Tensor view = GradientView(unit, entry);
      view.zero_();
      entry.param.mutable_grad() = view;
    }
  }
  writing_first_gradients_ = false;
  gradients_empty_ = false;
}

void ShardedEngine::OnGradientReady(int u, int e) {
  if (writing_first_gradients_) {
    Unit& unit = units_[u];
    Entry& entry = unit.entries[e];
    at::Tensor view = GradientView(unit, entry);
    {
      torch::NoGradGuard no_grad;
      view.copy_(entry.param.grad());
    }
    entry.param.mutable_grad() = view;
    entry.arrived = true;
  }
  if (stage() <= 1 && !last_micro_batch_) return;  // accumulate locally until the last one
  if (u == 0 && defer_outer_unit()) return;        // Step reduces it after the tied sum
  Unit& unit = units_[u];
  if (++unit.ready < static_cast<int>(unit.entries.size())) return;
  unit.ready = 0;
  SumReplicatedGradients(u);
  ReduceUnit(u);
  if (stage() == 3) Free(u);
}

void ShardedEngine::ReduceUnit(int u) {
  Unit& unit = units_[u];
  torch::NoGradGuard no_grad;
  at::Tensor input;
  if (stage() <= 1) {
    input = unit.full_grad;
  } else {
    std::vector<at::Tensor> pieces;
    pieces.reserve(unit.entries.size() + 1);
    for (Entry& entry : unit.entries) pieces.push_back(entry.param.grad().reshape({-1}));
    input = TakeBuffer(unit.padded, unit.shard_grad.options());
    at::Tensor values = input.narrow(0, 0, unit.numel);
    at::cat_out(values, pieces);
    if (unit.padded > unit.numel) input.narrow(0, unit.numel, unit.padded - unit.numel).zero_();
    for (Entry& entry : unit.entries) entry.param.mutable_grad().reset();
  }
  if (options_.dp_size == 1) {
    if (stage() >= 2) {
      unit.shard_grad.add_(input);
      GiveBuffer(std::move(input));
    }
    return;
  }
  while (static_cast<int>(pending_.size()) >= std::max(1, options_.max_in_flight)) FinishOldest();
  Pending pending;
  pending.unit = u;
  pending.input = input;
  if (stage() == 0 || options_.sharded_collectives_as_all_reduce) {
    std::vector<at::Tensor> tensors{input};
    pending.work = options_.dp_group->allreduce(tensors);
  } else {
    pending.output = TakeBuffer(unit.shard, input.options());
    pending.work = options_.dp_group->_reduce_scatter_base(pending.output, pending.input);
  }
  pending_.push_back(std::move(pending));
}

void ShardedEngine::FinishOldest() {
  Pending pending = std::move(pending_.front());
  pending_.pop_front();
  WaitForPeers(pending.work);
  torch::NoGradGuard no_grad;
  Unit& unit = units_[pending.unit];
  if (options_.sharded_collectives_as_all_reduce && stage() >= 2) {
    // The whole unit was all-reduced; this rank keeps its shard of it.
    unit.shard_grad.add_(pending.input.narrow(0, OwnedBegin(unit), unit.shard));
    GiveBuffer(std::move(pending.input));
    return;
  }
  if (!pending.output.defined()) return;
  if (stage() == 1) {
    unit.shard_grad.copy_(pending.output);
  } else {
    unit.shard_grad.add_(pending.output);
    GiveBuffer(std::move(pending.input));
  }
  GiveBuffer(std::move(pending.output));
}

void ShardedEngine::FinishAll() {
  while (!pending_.empty()) FinishOldest();
}

void ShardedEngine::SumReplicatedGradients(int u) {
  if (!options_.tp.enabled() || !options_.tp.sequence_parallel) return;
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (Entry& entry : units_[u].entries) {
    if (entry.replicated && entry.param.grad().defined()) grads.push_back(entry.param.grad());
  }
  if (grads.empty()) return;
  std::vector<at::Tensor> flat;
  for (const at::Tensor& grad : grads) flat.push_back(grad.reshape({-1}));
  at::Tensor sum = at::cat(flat);
  AllReduceSum(options_.tp.group, sum);
  int64_t offset = 0;
  for (at::Tensor& grad : grads) {
    grad.copy_(sum.narrow(0, offset, grad.numel()).view_as(grad));
    offset += grad.numel();
  }
}

void ShardedEngine::SumTiedEmbeddingGradients() {
  torch::NoGradGuard no_grad;
  at::Tensor grad;
  for (Entry& entry : units_[0].entries) {
    if (entry.name == "embed.weight") grad = entry.param.grad();
  }
  if (!grad.defined()) {
    // A middle stage: zeros of the embedding's shape.
    const v1::ModelDims& dims = model_->dims();
    grad = at::zeros({VocabRowsPerRank(dims.vocab_size(), options_.tp.size), dims.hidden_size()},
                     at::TensorOptions()
                         .dtype(at::kFloat)
                         .device(units_.back().full.defined() ? units_.back().full.device()
                                                              : at::Device(at::kCPU)));
    AllReduceSum(options_.pp_group, grad);
    return;
  }
  AllReduceSum(options_.pp_group, grad);
}

at::Tensor ShardedEngine::ForwardBackward(const at::Tensor& inputs, const at::Tensor& targets,
                                          double scale, bool last, const at::Tensor& positions) {
  last_micro_batch_ = last;
  if (graph_ != nullptr) {
    if (std::optional<at::Tensor> loss = GraphForwardBackward(inputs, targets, scale, positions)) {
      return *loss;
    }
  }
  return EagerForwardBackward(inputs, targets, scale, positions);
}

std::optional<at::Tensor> ShardedEngine::GraphForwardBackward(
    [[maybe_unused]] const at::Tensor& inputs, [[maybe_unused]] const at::Tensor& targets,
    [[maybe_unused]] double scale, const at::Tensor& positions) {
#if TESSERA_WITH_CUDA
  CudaGraph& g = *graph_;
  ++g.micro_batches;
  if (g.off || positions.defined()) return std::nullopt;
  if (g.live) {
    if (inputs.sizes() != g.inputs.sizes() || targets.sizes() != g.targets.sizes()) {
      return std::nullopt;  // another shape: eagerly
    }
    if (gradients_empty_) PrepareGradientsForAccumulation();
    torch::NoGradGuard no_grad;
    g.inputs.copy_(inputs, /*non_blocking=*/true);
    g.targets.copy_(targets, /*non_blocking=*/true);
    g.scale.fill_(scale);
    g.graph->replay();
    return g.loss.detach().clone();
  }
  // Warm up; then capture on the first micro-batch of a step, whose gradients start at zero.
  if (g.eager_micro_batches < CudaGraph::kWarmupMicroBatches || !gradients_empty_) {
    ++g.eager_micro_batches;
    return std::nullopt;
  }
  // The micro-batch eagerly, for the check; then zero gradients again for the capture's replay.
  PrepareGradientsForAccumulation();
  const double eager_loss = EagerForwardBackward(inputs, targets, scale, {}).item<double>();
  const std::vector<double> eager_grads = GradientSignature();
  PrepareGradientsForAccumulation();
  std::string why;
  {
    torch::NoGradGuard no_grad;
    g.inputs = inputs.clone();
    g.targets = targets.clone();
    g.scale = at::full({}, scale, inputs.options().dtype(at::kFloat));
  }
  const at::Device device = inputs.device();
  c10::cuda::device_synchronize();
  // Autocast must not cache casts made inside the capture (they would live in its pool).
  const bool autocast_cache = at::autocast::is_autocast_cache_enabled();
  at::autocast::set_autocast_cache_enabled(false);
  try {
    const c10::cuda::CUDAStreamGuard on_side_stream(
        c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index()));
    g.graph = std::make_unique<at::cuda::CUDAGraph>();
    // Thread-local: only this thread's calls are checked. A checkpoint's snapshot thread may be
    // waiting on its device-to-host copy meanwhile, and must not fail (or void the capture) for
    // it; the autograd engine's thread launches backward into the capturing stream either way.
    g.graph->capture_begin(/*pool=*/{0, 0}, cudaStreamCaptureModeThreadLocal);
    try {
      for (Unit& unit : units_) unit.ready = 0;
      {
        AutocastScope autocast(options_.bf16);
        g.loss = model_->Loss(g.inputs, g.targets);
      }
      (g.loss * g.scale).backward();
    } catch (...) {
      try {
        g.graph->capture_end();  // leaves capture mode; fails for an invalidated capture
      } catch (...) {
      }
      throw;
    }
    g.graph->capture_end();
  } catch (const std::exception& e) {
    why = absl::StrCat("the capture failed: ", e.what());
  }
  at::autocast::set_autocast_cache_enabled(autocast_cache);
  c10::cuda::device_synchronize();
  if (why.empty()) {
    g.graph->replay();
    const double graph_loss = g.loss.item<double>();
    const std::vector<double> graph_grads = GradientSignature();
    bool same = std::abs(graph_loss - eager_loss) <= 1e-5 * std::abs(eager_loss) + 1e-7 &&
                graph_grads.size() == eager_grads.size();
    for (size_t i = 0; same && i < eager_grads.size(); ++i) {
      same = std::abs(graph_grads[i] - eager_grads[i]) <= 1e-4 * std::abs(eager_grads[i]) + 1e-12;
    }
    if (same) {
      g.live = true;
      graph_status_ = absl::StrCat("replaying (captured at micro-batch ", g.micro_batches,
                                   "; its replay matched the eager run: loss ", graph_loss, " vs ",
                                   eager_loss, ")");
      return g.loss.detach().clone();
    }
    why = absl::StrCat("the replay differs from the eager run (loss ", graph_loss, " vs ",
                       eager_loss, ", or the gradient norms)");
  }
  // Off for good: this micro-batch again, eagerly.
  g.off = true;
  g.graph.reset();
  g.inputs = g.targets = g.scale = g.loss = at::Tensor();
  graph_status_ = "off: " + why;
  PrepareGradientsForAccumulation();
  return EagerForwardBackward(inputs, targets, scale, {});
#else
  return std::nullopt;
#endif
}

at::Tensor ShardedEngine::EagerForwardBackward(const at::Tensor& inputs, const at::Tensor& targets,
                                               double scale, const at::Tensor& positions) {
  for (Unit& unit : units_) unit.ready = 0;
  if (stage() == 3) EnsureGathered(0);
  at::Tensor loss;
  {
    AutocastScope autocast(options_.bf16);
    loss = model_->Loss(inputs, targets, positions);
  }
  BeginFirstBackward();
  FirstBackwardScope first(this);
  (loss * scale).backward();
  FinishAll();
  return loss.detach();
}

at::Tensor ShardedEngine::ForwardStage(const at::Tensor& input, const at::Tensor& targets,
                                       const at::Tensor& positions) {
  TORCH_CHECK(stage() <= 1, "pipeline stages run ZeRO 0 or 1");
  AutocastScope autocast(options_.bf16);
  return model_->StageForward(input, targets, positions);
}

void ShardedEngine::BackwardStage(const at::Tensor& output, const at::Tensor& grad, double scale,
                                  bool last) {
  last_micro_batch_ = last;
  for (Unit& unit : units_) unit.ready = 0;
  BeginFirstBackward();
  FirstBackwardScope first(this);
  if (grad.defined()) {
    output.backward(grad);
  } else {
    (output * scale).backward();
  }
}

double ShardedEngine::Step(double lr, double clip_norm, bool update) {
  FinishAll();
  if (defer_outer_unit()) {
    SumTiedEmbeddingGradients();
    if (!units_[0].entries.empty()) {
      SumReplicatedGradients(0);
      ReduceUnit(0);
      FinishAll();
    }
  }
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  grads.reserve(runs_.size());
  for (const Run& run : runs_) grads.push_back(run.param.grad());
  at::Device device = at::kCPU;
  for (const Unit& unit : units_) {
    if (unit.full.defined()) device = unit.full.device();
  }
  at::Tensor squares = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device));
  for (const auto& [share, views] : norm_groups_) {
    std::vector<at::Tensor> norms = at::_foreach_norm(views, 2);
    squares += at::stack(norms).to(at::kDouble).pow(2).sum() * share;
  }
  if (options_.world_group) {
    std::vector<at::Tensor> tensors{squares};
    WaitForPeers(options_.world_group->allreduce(tensors));
  } else if (options_.dp_size > 1) {
    std::vector<at::Tensor> tensors{squares};
    WaitForPeers(options_.dp_group->allreduce(tensors));
  }
  const double norm = std::sqrt(squares.item<double>());
  if (std::isfinite(clip_norm) && !grads.empty()) {
    const double coef = clip_norm / (norm + 1e-6);
    if (coef < 1) at::_foreach_mul_(grads, coef);
  }
  if (!update) {
    ZeroGradients();
    return norm;
  }
  optimizer_->Step(lr);
  if ((stage() == 1 || stage() == 2) && options_.dp_size > 1) {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    std::vector<at::Tensor> inputs;
    for (Unit& unit : units_) {
      if (unit.entries.empty()) continue;
      if (options_.sharded_collectives_as_all_reduce) {
        works.push_back(GatherInto(unit, unit.owned));
        continue;
      }
      // A copy of the shard: c10d's all-gather does not promise to accept an input that aliases
      // its output on every backend.
      inputs.push_back(TakeBuffer(unit.shard, unit.owned.options()));
      inputs.back().copy_(unit.owned);
      works.push_back(GatherInto(unit, inputs.back()));
    }
    for (auto& work : works) WaitForPeers(work);
    for (at::Tensor& input : inputs) GiveBuffer(std::move(input));
  }
  ZeroGradients();
  return norm;
}

void ShardedEngine::ZeroGradients() {
  if (stage() <= 1) {
    // The next backward writes every parameter's gradient (EndFirstBackward zeroes those it
    // missed); the padding past a unit's parameters is never written and stays zero.
    gradients_empty_ = true;
    return;
  }
  for (Unit& unit : units_) {
    if (!unit.entries.empty()) unit.shard_grad.zero_();
  }
}

at::Tensor ShardedEngine::EvalLoss(const at::Tensor& inputs, const at::Tensor& targets,
                                   const at::Tensor& positions) {
  torch::NoGradGuard no_grad;
  if (stage() == 3) EnsureGathered(0);
  at::Tensor loss;
  {
    AutocastScope autocast(options_.bf16);
    loss = model_->Loss(inputs, targets, positions);
  }
  if (stage() == 3) Free(0);
  return loss;
}

EngineMemory ShardedEngine::Memory() const {
  EngineMemory memory;
  for (const Unit& unit : units_) {
    memory.parameter_bytes += (stage() == 3 ? unit.shard : unit.padded) * 4;
    memory.gradient_bytes += (stage() <= 1 ? unit.padded : unit.shard) * 4;
    memory.padding_elements += unit.padded - unit.numel;
  }
  for (const auto& param : model_->parameters()) {
    if (!param.requires_grad()) memory.frozen_bytes += static_cast<int64_t>(param.nbytes());
  }
  for (const Run& run : runs_) {
    const FusedAdamW::State& state = optimizer_->StateFor(run.decay ? 0 : 1, run.state_index);
    memory.moment_bytes += static_cast<int64_t>(state.exp_avg.nbytes() + state.exp_avg_sq.nbytes());
    memory.step_counter_bytes += static_cast<int64_t>(state.step.nbytes());
  }
  return memory;
}

void ShardedEngine::AppendRanges(int u, const Entry& entry, int64_t from, int64_t to, bool values,
                                 bool moments, std::vector<TensorRange>* out) {
  if (from >= to) return;
  Unit& unit = units_[u];
  const std::vector<int64_t>& global_shape = model_->ShardOf(entry.name).global_shape;
  for (const ShardPiece& piece : entry.pieces) {
    // The piece's elements in unit coordinates, cut to [from, to).
    const int64_t a = std::max(from, entry.offset + piece.local_begin);
    const int64_t b = std::min(to, entry.offset + piece.local_begin + piece.numel);
    if (a >= b) continue;
    const int64_t offset = a - entry.offset - piece.local_begin;
    auto add = [&](const char* prefix, at::Tensor data) {
      out->push_back({.name = absl::StrCat(prefix, entry.name),
                      .global_shape = global_shape,
                      .offset = offset,
                      .data = std::move(data),
                      .box_offset = piece.box_offset,
                      .box_shape = piece.box_shape});
    };
    if (values) {
      add("model/", stage() == 3 ? unit.owned.narrow(0, a - OwnedBegin(unit), b - a)
                                 : unit.full.narrow(0, a, b - a));
    }
    if (!moments) continue;
    for (const Run& run : runs_) {
      if (run.unit != u || a < run.begin || b > run.end) continue;
      FusedAdamW::State& state = optimizer_->StateFor(run.decay ? 0 : 1, run.state_index);
      add("exp_avg/", state.exp_avg.narrow(0, a - run.begin, b - a));
      add("exp_avg_sq/", state.exp_avg_sq.narrow(0, a - run.begin, b - a));
    }
  }
}

std::vector<TensorRange> ShardedEngine::SaveRanges() {
  std::vector<TensorRange> out;
  for (size_t u = 0; u < units_.size(); ++u) {
    const Unit& unit = units_[u];
    const int64_t owned_begin = OwnedBegin(unit);
    for (const Entry& entry : unit.entries) {
      if (!entry.saved) continue;
      AppendRanges(static_cast<int>(u), entry, std::max(owned_begin, entry.offset),
                   std::min(owned_begin + unit.shard, entry.offset + entry.numel),
                   /*values=*/true, /*moments=*/true, &out);
    }
  }
  return out;
}

std::vector<TensorRange> ShardedEngine::LoadRanges() {
  std::vector<TensorRange> out;
  for (size_t u = 0; u < units_.size(); ++u) {
    const Unit& unit = units_[u];
    const int64_t owned_begin = std::min(unit.numel, OwnedBegin(unit));
    const int64_t owned_end = std::min(unit.numel, owned_begin + unit.shard);
    for (const Entry& entry : unit.entries) {
      const int64_t begin = entry.offset, end = entry.offset + entry.numel;
      const int64_t owned_from = std::max(owned_begin, begin), owned_to = std::min(owned_end, end);
      // Parameters: all of them below ZeRO-3. Moments: the range this rank steps.
      AppendRanges(static_cast<int>(u), entry, stage() == 3 ? owned_from : begin,
                   stage() == 3 ? owned_to : end, /*values=*/true, /*moments=*/false, &out);
      AppendRanges(static_cast<int>(u), entry, stage() == 0 ? begin : owned_from,
                   stage() == 0 ? end : owned_to, /*values=*/false, /*moments=*/true, &out);
    }
  }
  return out;
}

bool ShardedEngine::Knows(const std::string& name) const {
  for (const char* prefix : {"model/", "exp_avg/", "exp_avg_sq/"}) {
    if (absl::StartsWith(name, prefix) && names_.contains(name.substr(std::strlen(prefix)))) {
      return true;
    }
  }
  return false;
}

int64_t ShardedEngine::optimizer_step() const {
  if (runs_.empty()) return 0;
  const at::Tensor& step = optimizer_->StateFor(runs_[0].decay ? 0 : 1, runs_[0].state_index).step;
  return static_cast<int64_t>(step.item<double>());
}

void ShardedEngine::set_optimizer_step(int64_t step) {
  for (const Run& run : runs_) {
    optimizer_->StateFor(run.decay ? 0 : 1, run.state_index).step.fill_(static_cast<double>(step));
  }
}

}  // namespace tessera::trainer

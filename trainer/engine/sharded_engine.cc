// ShardedEngine's construction: the units' flat buffers and the parameters as views into them,
// the optimizer runs over the range this rank steps, the eligibility of CUDA graphs, the owned
// shards of a kDeferred model (InitializeShards), and the memory the layout holds (Memory).
#include "trainer/engine/sharded_engine.h"

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "trainer/engine/sharded_engine_internal.h"

namespace tessera::trainer {
namespace {

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

// The unit of a parameter by its name: 1 + the model's local index of the layer of
// "layers.<layer>.*" (chunk by chunk under interleaved pipeline stages), 0 otherwise.
int UnitOf(const std::string& name, const CausalLMImpl& model) {
  if (!absl::StartsWith(name, "layers.")) return 0;
  const size_t dot = name.find('.', 7);
  int layer = 0;
  TORCH_CHECK(dot != std::string::npos && absl::SimpleAtoi(name.substr(7, dot - 7), &layer),
              "parameter name ", name, " does not name its layer");
  const int local = model.LocalLayerIndex(layer);
  TORCH_CHECK(local >= 0, "parameter ", name, " of a layer this rank does not hold");
  return 1 + local;
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
  TORCH_CHECK(options_.ep.size == model_->partition().ep.size,
              "the engine's expert parallelism differs from the model's");
  // The trainer refuses these with INVALID_ARGUMENT (run_builder.cc's ValidateLayout).
  TORCH_CHECK(!options_.ep.enabled() || options_.zero_stage <= 1, "expert_parallel ",
              options_.ep.size, " runs ZeRO 0 and 1, not stage ", options_.zero_stage);
  TORCH_CHECK(options_.edp_size >= 1 && options_.edp_rank >= 0 &&
                  options_.edp_rank < options_.edp_size && (options_.edp_size == 1 || options_.edp_group),
              "edp rank ", options_.edp_rank, " of ", options_.edp_size);
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
  const int layers = model_->num_local_layers();
  const bool expert_units = options_.ep.enabled();
  units_.assign(1 + layers * (expert_units ? 2 : 1), Unit{});
  for (size_t u = 0; u < units_.size(); ++u) {
    const bool experts = u > static_cast<size_t>(layers);
    units_[u].group = experts ? options_.edp_group : options_.dp_group;
    units_[u].rank = experts ? options_.edp_rank : options_.dp_rank;
    units_[u].size = experts ? options_.edp_size : options_.dp_size;
  }
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
    int unit = UnitOf(item.key(), *model_);
    if (expert_units && IsExpertShardedParameter(item.key())) {
      // The experts' own unit (their LoRA adapters' too); their elements are a box of the
      // logical tensor.
      unit += layers;
      entry.pieces = {ExpertShardPiece(shard, options_.ep, options_.tp)};
    }
    units_[unit].entries.push_back(std::move(entry));
  }
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
    unit.padded = CeilDiv(unit.numel, unit.size) * unit.size;
    unit.shard = unit.padded / unit.size;
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
      const double replicas = stage() == 0 ? unit.size : 1;
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

}  // namespace tessera::trainer

#include "trainer/model/activation_checkpoint.h"

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>
#include <set>
#include <string>
#include <utility>

#include "trainer/torch_pch.h"

namespace tessera::trainer {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr char kStateKey[] = "checkpoint_state";

// The autocast settings of one device type.
struct AutocastSetting {
  at::DeviceType device_type;
  bool enabled;
  at::ScalarType dtype;

  static AutocastSetting Current(at::DeviceType device_type) {
    return {device_type, at::autocast::is_autocast_enabled(device_type),
            at::autocast::get_autocast_dtype(device_type)};
  }
  void Apply() const {
    at::autocast::set_autocast_enabled(device_type, enabled);
    at::autocast::set_autocast_dtype(device_type, dtype);
  }
};

// What a recompute needs from the forward call, and the recompute's graph between the hook that
// runs it early (CheckpointWithoutOutput) and the Function's backward. Shared by the Function's
// context and that hook; both run on the backward's thread, one after the other.
struct CheckpointState : torch::CustomClassHolder {
  CheckpointedFunction fn;
  std::vector<torch::Tensor> inputs;
  std::vector<uint32_t> input_versions;
  std::vector<AutocastSetting> autocast;
  bool autocast_cache_enabled = true;
  std::vector<std::pair<c10::Device, torch::Tensor>> rng_states;
  // Set by Recompute, released by the Function's backward.
  std::vector<torch::Tensor> detached_inputs;
  std::vector<torch::Tensor> recomputed_outputs;
  bool recomputed = false;
};

at::Generator DefaultGenerator(c10::Device device) {
  return at::globalContext().defaultGenerator(device);
}

torch::Tensor GetRngState(c10::Device device) {
  at::Generator generator = DefaultGenerator(device);
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void SetRngState(c10::Device device, const torch::Tensor& state) {
  at::Generator generator = DefaultGenerator(device);
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

// The CPU generator, and the default CUDA generator of each device an input lives on.
std::vector<c10::Device> RngDevices(const std::vector<torch::Tensor>& inputs) {
  std::vector<c10::Device> devices = {c10::Device(c10::kCPU)};
  std::set<c10::DeviceIndex> cuda;
  for (const torch::Tensor& input : inputs) {
    if (input.defined() && input.is_cuda()) cuda.insert(input.get_device());
  }
  for (c10::DeviceIndex index : cuda) devices.emplace_back(c10::kCUDA, index);
  return devices;
}

c10::intrusive_ptr<CheckpointState> CaptureForwardState(CheckpointedFunction fn,
                                                        const std::vector<torch::Tensor>& inputs) {
  auto state = c10::make_intrusive<CheckpointState>();
  state->fn = std::move(fn);
  state->inputs = inputs;
  for (const torch::Tensor& input : inputs) state->input_versions.push_back(input._version());
  state->autocast = {AutocastSetting::Current(at::kCPU), AutocastSetting::Current(at::kCUDA)};
  state->autocast_cache_enabled = at::autocast::is_autocast_cache_enabled();
  for (c10::Device device : RngDevices(inputs)) {
    state->rng_states.emplace_back(device, GetRngState(device));
  }
  return state;
}

// Puts the forward call's autocast and RNG states in place for its lifetime and restores the
// current ones after, as torch.autocast and torch.random.fork_rng do.
class ForwardStateGuard {
 public:
  explicit ForwardStateGuard(const CheckpointState& state) {
    for (const AutocastSetting& setting : state.autocast) {
      saved_autocast_.push_back(AutocastSetting::Current(setting.device_type));
      setting.Apply();
    }
    saved_cache_enabled_ = at::autocast::is_autocast_cache_enabled();
    at::autocast::set_autocast_cache_enabled(state.autocast_cache_enabled);
    at::autocast::increment_nesting();
    for (const auto& [device, rng] : state.rng_states) {
      saved_rng_.emplace_back(device, GetRngState(device));
      SetRngState(device, rng);
    }
  }
  ~ForwardStateGuard() {
    for (const auto& [device, rng] : saved_rng_) SetRngState(device, rng);
    // Casts cached during the recompute belong to it; torch.autocast drops them on leaving the
    // outermost region the same way.
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_cache_enabled(saved_cache_enabled_);
    for (const AutocastSetting& setting : saved_autocast_) setting.Apply();
  }
  ForwardStateGuard(const ForwardStateGuard&) = delete;
  ForwardStateGuard& operator=(const ForwardStateGuard&) = delete;

 private:
  std::vector<AutocastSetting> saved_autocast_;
  bool saved_cache_enabled_ = true;
  std::vector<std::pair<c10::Device, torch::Tensor>> saved_rng_;
};

void Recompute(CheckpointState& state) {
  state.detached_inputs.clear();
  for (size_t i = 0; i < state.inputs.size(); ++i) {
    const torch::Tensor& input = state.inputs[i];
    TORCH_CHECK(input._version() == state.input_versions[i], "checkpoint input ", i,
                " was modified in place between forward and backward");
    torch::Tensor detached = input.detach();
    detached.requires_grad_(input.requires_grad());
    state.detached_inputs.push_back(std::move(detached));
  }
  at::AutoGradMode grad_mode(true);
  ForwardStateGuard forward_state(state);
  state.recomputed_outputs = state.fn(state.detached_inputs);
  state.recomputed = true;
}

// The autograd node of a checkpointed region: forward(state, inputs) -> fn(inputs).
struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<CheckpointState> state,
                               at::TensorList inputs) {
    ctx->set_materialize_grads(false);
    variable_list outputs = state->fn(inputs.vec());
    ctx->saved_data[kStateKey] = c10::IValue::make_capsule(std::move(state));
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto state = c10::static_intrusive_pointer_cast<CheckpointState>(
        ctx->saved_data.at(kStateKey).toCapsule());
    if (!state->recomputed) Recompute(*state);
    TORCH_CHECK(state->recomputed_outputs.size() == grad_outputs.size(),
                "checkpointed function returned ", state->recomputed_outputs.size(),
                " outputs in the recompute, ", grad_outputs.size(), " in forward");
    variable_list roots, grads;
    for (size_t i = 0; i < grad_outputs.size(); ++i) {
      if (grad_outputs[i].defined() && state->recomputed_outputs[i].requires_grad()) {
        roots.push_back(state->recomputed_outputs[i]);
        grads.push_back(grad_outputs[i]);
      }
    }
    if (!roots.empty()) torch::autograd::backward(roots, grads);
    variable_list input_grads = {torch::Tensor()};  // the state argument
    for (const torch::Tensor& detached : state->detached_inputs) {
      input_grads.push_back(detached.requires_grad() ? detached.grad() : torch::Tensor());
    }
    // A later backward through a retained graph recomputes afresh.
    state->detached_inputs.clear();
    state->recomputed_outputs.clear();
    state->recomputed = false;
    return input_grads;
  }
};

bool NeedsCheckpoint(const std::vector<torch::Tensor>& inputs) {
  if (!torch::GradMode::is_enabled()) return false;
  for (const torch::Tensor& input : inputs) {
    if (input.defined() && input.requires_grad()) return true;
  }
  return false;
}

// One freed output of CheckpointWithoutOutput: its storage and how many bytes it held.
struct DiscardedOutput {
  torch::Tensor tensor;
  size_t nbytes;
};

void RestoreOutput(const DiscardedOutput& discarded, const torch::Tensor& recomputed) {
  c10::StorageImpl* storage = discarded.tensor.storage().unsafeGetStorageImpl();
  if (storage->nbytes() == discarded.nbytes) return;  // restored by an earlier backward
  TORCH_CHECK(recomputed.sizes() == discarded.tensor.sizes() &&
                  recomputed.scalar_type() == discarded.tensor.scalar_type(),
              "checkpointed function's output changed shape or dtype in the recompute: ",
              discarded.tensor.sizes(), " ", discarded.tensor.scalar_type(), " then ",
              recomputed.sizes(), " ", recomputed.scalar_type());
  storage->set_data_ptr_noswap(storage->allocator()->allocate(discarded.nbytes));
  storage->set_nbytes(discarded.nbytes);
  // Written through a fresh tensor on the same storage: the saved tensors' version counter stays
  // as it was, so autograd does not mistake the restore for an in-place modification.
  torch::NoGradGuard no_grad;
  torch::empty({0}, discarded.tensor.options())
      .set_(discarded.tensor.storage(), discarded.tensor.storage_offset(), discarded.tensor.sizes(),
            discarded.tensor.strides())
      .copy_(recomputed);
}

}  // namespace

std::vector<torch::Tensor> Checkpoint(CheckpointedFunction fn,
                                      const std::vector<torch::Tensor>& inputs) {
  if (!NeedsCheckpoint(inputs)) return fn(inputs);
  auto state = CaptureForwardState(std::move(fn), inputs);
  return CheckpointFunction::apply(std::move(state), at::TensorList(inputs));
}

torch::Tensor CheckpointWithoutOutput(CheckpointedFunction fn,
                                      const std::vector<torch::Tensor>& inputs,
                                      const CheckpointConsumer& consumer) {
  if (!NeedsCheckpoint(inputs)) return consumer(fn(inputs));
  auto state = CaptureForwardState(std::move(fn), inputs);
  std::vector<torch::Tensor> outputs = CheckpointFunction::apply(state, at::TensorList(inputs));
  torch::Tensor result = consumer(outputs);
  if (!result.requires_grad()) return result;  // no backward will need the outputs

  std::vector<DiscardedOutput> discarded;
  for (size_t i = 0; i < outputs.size(); ++i) {
    const torch::Tensor& output = outputs[i];
    for (const torch::Tensor& input : inputs) {
      TORCH_CHECK(!input.defined() || !output.storage().is_alias_of(input.storage()),
                  "checkpointed function's output ", i, " shares storage with an input");
    }
    TORCH_CHECK(!result.storage().is_alias_of(output.storage()),
                "checkpoint consumer returned a view of output ", i);
    c10::StorageImpl* storage = output.storage().unsafeGetStorageImpl();
    TORCH_CHECK(storage->allocator() != nullptr, "checkpointed function's output ", i,
                " has storage without an allocator");
    discarded.push_back({output, storage->nbytes()});
    storage->set_data_ptr_noswap(at::DataPtr(nullptr, output.device()));
    storage->set_nbytes(0);
  }
  // Runs before the backward of the node that produced `result`, which is consumer's last op; the
  // ops consumer saved the outputs for run at or after it.
  result.register_hook([state, discarded = std::move(discarded)](const torch::Tensor&) {
    if (!state->recomputed) Recompute(*state);
    for (size_t i = 0; i < discarded.size(); ++i) {
      RestoreOutput(discarded[i], state->recomputed_outputs[i].detach());
    }
  });
  return result;
}

}  // namespace tessera::trainer

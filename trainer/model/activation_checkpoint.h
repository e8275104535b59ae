// Activation checkpointing: run part of the forward pass without keeping its activations for
// backward, and recompute them when backward needs them. Checkpoint is PyTorch's reentrant
// checkpoint (torch.utils.checkpoint with use_reentrant=True) as a C++ autograd Function;
// CheckpointWithoutOutput also drops the recomputed part's outputs once their consumer has saved
// them (Megatron-LM's CheckpointWithoutOutput), so that an MLP's activation function can be
// recomputed without recomputing the projection that follows it. The recompute restores the
// autocast state (CPU and CUDA) and the RNG states (CPU, and CUDA for the inputs' devices) of the
// forward call, so on a deterministic device it reproduces the forward values bitwise and gradients
// equal those of the uncheckpointed computation. Gradients of tensors fn uses but does not take as
// inputs (parameters) accumulate into their .grad as usual, and their hooks fire, during the
// recompute's backward. Calls run on the calling thread; backward may run on an autograd device
// thread.
#pragma once

#include <torch/types.h>

#include <functional>
#include <vector>

namespace tessera::trainer {

// A deterministic function of its inputs and of tensors it captures (parameters), run once in
// forward and once more in backward.
using CheckpointedFunction =
    std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>& inputs)>;
// Takes a checkpointed function's outputs and returns the tensor the forward pass continues with.
using CheckpointConsumer = std::function<torch::Tensor(const std::vector<torch::Tensor>& outputs)>;

// Returns fn(inputs), keeping only `inputs` for backward: fn runs with grad mode off, and backward
// re-runs it on detached copies of the inputs with grad mode on and backpropagates through that.
// When grad mode is off or no input requires grad this is just fn(inputs). The inputs must not be
// modified in place before backward (c10::Error then).
std::vector<torch::Tensor> Checkpoint(CheckpointedFunction fn,
                                      const std::vector<torch::Tensor>& inputs);

// Returns consumer(fn(inputs)) keeping `inputs` and what consumer saves, but freeing the storage of
// fn's outputs once consumer returns: backward recomputes fn just before consumer's backward (a
// hook on the returned tensor) and writes the values back into that storage, then backpropagates
// through the recomputed fn. fn's outputs must not share storage with its inputs, and consumer must
// not keep them in any form other than what its autograd graph saves (c10::Error otherwise where
// detectable). When grad mode is off or no input requires grad this is consumer(fn(inputs)).
torch::Tensor CheckpointWithoutOutput(CheckpointedFunction fn,
                                      const std::vector<torch::Tensor>& inputs,
                                      const CheckpointConsumer& consumer);

}  // namespace tessera::trainer

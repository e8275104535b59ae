// The 1F1B pipeline schedule (PipeDream-Flush, Narayanan et al. 2021; Megatron-LM's
// non-interleaved schedule) of one pipeline stage. With m micro-batches and p stages, stage s
// runs min(p - s - 1, m) warm-up forwards, then alternates one forward and one backward, then
// drains the remaining backwards; so at most p - s micro-batches' activations are alive at once,
// and the idle fraction is (p - 1) / (m + p - 1). Activations go to the next stage and their
// gradients come back point to point over the pipeline group (c10d send/recv); where a stage both
// sends and receives, both are posted before either is waited for, as Megatron's batched p2p does,
// so no pair of stages waits on each other.
//
// The stage's computation is the caller's: `forward` turns a micro-batch (its index, and the
// previous stage's activations, undefined on the first stage) into the stage's output (the loss
// on the last stage), and `backward` runs autograd from an output given the next stage's gradient
// (undefined on the last stage). The schedule calls them in the order above on the calling thread.
#pragma once

#include <functional>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "trainer/torch_pch.h"

namespace tessera::trainer {

class PipelineSchedule {
 public:
  using Forward = std::function<at::Tensor(int micro_batch, const at::Tensor& input)>;
  // `last` marks the step's last backward.
  using Backward = std::function<void(int micro_batch, const at::Tensor& output,
                                      const at::Tensor& grad, bool last)>;

  // `group` holds the stages in order (group rank = stage), and `stage_ranks` their global
  // ranks (for error messages); `activation_shape` is one micro-batch's activations between
  // stages, sent as float32 on `device`. A failed send or receive (a peer that died) throws
  // std::runtime_error naming both stages and ranks and containing "pipeline peer".
  PipelineSchedule(c10::intrusive_ptr<c10d::ProcessGroup> group, int stage,
                   std::vector<int> stage_ranks, std::vector<int64_t> activation_shape,
                   at::Device device);

  bool first() const { return stage_ == 0; }
  bool last() const { return stage_ == stages_ - 1; }

  // One step's forwards and backwards of `micro_batches` micro-batches. Returns the sum of the
  // losses (detached) on the last stage, an undefined tensor elsewhere.
  at::Tensor Train(int micro_batches, const Forward& forward, const Backward& backward);

  // The forward of one micro-batch through every stage, without gradients. Returns the loss on
  // the last stage, an undefined tensor elsewhere.
  at::Tensor Evaluate(const Forward& forward);

 private:
  at::Tensor EmptyActivation() const;
  // Posts the send (when `send` is defined) and the receive (when `receive` is true), then waits
  // for both. Returns the received tensor.
  at::Tensor Exchange(const at::Tensor& send, int send_to, int send_tag, bool receive,
                      int receive_from, int receive_tag, bool requires_grad);

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  int stage_;
  int stages_;
  std::vector<int> stage_ranks_;
  std::vector<int64_t> activation_shape_;
  at::Device device_;
};

}  // namespace tessera::trainer

// The 1F1B pipeline schedule (PipeDream-Flush, Narayanan et al. 2021; Megatron-LM's
// non-interleaved schedule) of one pipeline stage. With m micro-batches and p stages, stage s
// runs min(p - s - 1, m) warm-up forwards, then alternates one forward and one backward, then
// drains the remaining backwards; so at most p - s micro-batches' activations are alive at once,
// and the idle fraction is (p - 1) / (m + p - 1). Activations go to the next stage and their
// gradients come back point to point over the pipeline group (c10d send/recv); where a stage both
// sends and receives, both are posted before either is waited for, as Megatron's batched p2p does,
// so no pair of stages waits on each other.
//
// Interleaved 1F1B (virtual pipeline stages, Narayanan et al. 2021; Megatron-Core's
// forward_backward_pipelining_with_interleaving): with v chunks per stage the model's layers form
// p * v chunks and stage s holds chunks s, s + p, s + 2p, ...; the activations of a chunk on the
// last stage go to the next chunk on stage 0, and their gradients come back the same way. The
// forwards and backwards run over (chunk, micro-batch) pairs in the order InterleavedPipelineOps
// gives, which cuts the idle fraction to (p - 1) / (v * m) of the ideal time at the price of v
// times the messages. There sends are posted without waiting (they complete by the end of the
// step) and a receive is waited for right before the computation that needs it: each stage sends
// in the order its peer receives, so no stage waits on one that waits on it (the schedule's test
// checks both by simulation).
//
// The stage's computation is the caller's: `forward` turns a micro-batch of one of the stage's
// chunks (its index, and the previous chunk's activations, undefined on the first chunk of the
// first stage) into the chunk's output (the loss on the last chunk of the last stage), and
// `backward` runs autograd from an output given the next chunk's gradient (undefined on the last
// one). The schedule calls them in the order above on the calling thread.
#pragma once

#include <functional>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "trainer/parallel/collective_timer.h"
#include "trainer/torch_pch.h"

namespace tessera::trainer {

// One operation of a stage's part of an interleaved step, in the order it runs. `chunk` is the
// stage's local chunk (0 .. v - 1), `peer` the stage sent to or received from (-1 for a
// computation). Sends post without waiting; a receive waits before the next operation.
struct PipelineOp {
  enum class Kind {
    kReceiveActivation,
    kForward,
    kSendActivation,
    kReceiveGradient,
    kBackward,
    kSendGradient
  };
  Kind kind;
  int chunk = 0;
  int micro_batch = 0;
  int peer = -1;
  bool operator==(const PipelineOp&) const = default;
  std::string ToString() const;
};

// The operations of `stage` in one step of `micro_batches` (planner::CheckSplitRules must
// accept them). The k-th forward runs chunk (k mod p*v) / p of micro-batch (k / (p*v)) * p +
// k mod p, the k-th backward the same with the chunks in reverse; stage s first runs
// (p - s - 1) + (v - 1) * p forwards (all of them when fewer), then alternates one forward and
// one backward, then drains the backwards. With v = 1 this is the plain 1F1B order.
std::vector<PipelineOp> InterleavedPipelineOps(int stages, int stage, int chunks,
                                               int micro_batches);

class PipelineSchedule {
 public:
  using Forward = std::function<at::Tensor(int chunk, int micro_batch, const at::Tensor& input)>;
  // `last` marks the chunk's last backward of the step.
  using Backward = std::function<void(int chunk, int micro_batch, const at::Tensor& output,
                                      const at::Tensor& grad, bool last)>;

  // `group` holds the stages in order (group rank = stage), and `stage_ranks` their global
  // ranks (for error messages); `activation_shape` is one micro-batch's activations between
  // stages, sent as float32 on `device`; `chunks` the stage's virtual stages (1: plain 1F1B). A
  // failed send or receive (a peer that died) throws std::runtime_error naming both stages and
  // ranks and containing "pipeline peer".
  PipelineSchedule(c10::intrusive_ptr<c10d::ProcessGroup> group, int stage,
                   std::vector<int> stage_ranks, std::vector<int64_t> activation_shape,
                   at::Device device, int chunks = 1);

  bool first() const { return stage_ == 0; }
  bool last() const { return stage_ == stages_ - 1; }
  int chunks() const { return chunks_; }
  // Whether the stage's `chunk` is the model's first (it embeds the tokens) or last (the loss).
  bool first(int chunk) const { return first() && chunk == 0; }
  bool last(int chunk) const { return last() && chunk == chunks_ - 1; }

  // One step's forwards and backwards of `micro_batches` micro-batches. Returns the sum of the
  // losses (detached) on the last stage, an undefined tensor elsewhere. With chunks > 1,
  // planner::CheckSplitRules must accept `micro_batches` (c10::Error otherwise).
  at::Tensor Train(int micro_batches, const Forward& forward, const Backward& backward);

  // The forward of one micro-batch through every stage, without gradients. Returns the loss on
  // the last stage, an undefined tensor elsewhere.
  at::Tensor Evaluate(const Forward& forward);

 private:
  // Train with chunks > 1: runs InterleavedPipelineOps.
  at::Tensor TrainInterleaved(int micro_batches, const Forward& forward, const Backward& backward);
  // Posts a send that the step waits for later (FinishSends); keeps the sent copy alive.
  void PostSend(const at::Tensor& tensor, int to, int tag);
  void FinishSends();
  at::Tensor Receive(int from, int tag, bool requires_grad);
  // The "pipeline peer lost" error of a failed exchange with `peers` (stage indices).
  [[noreturn]] void ThrowPeerLost(const std::vector<int>& peers, const std::exception& e) const;
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
  int chunks_;
  // A posted send, waited for by FinishSends.
  struct PostedSend {
    c10::intrusive_ptr<c10d::Work> work;
    int peer;
    CollectiveIssue issue;
  };
  std::vector<PostedSend> sends_;
  std::vector<at::Tensor> sent_;
};

}  // namespace tessera::trainer

#include "trainer/parallel/pipeline.h"

#include <algorithm>
#include <deque>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "trainer/parallel/peer_wait.h"

namespace tessera::trainer {
namespace {

// c10d tags, so that an activation is never matched with a gradient.
constexpr int kActivationTag = 1;
constexpr int kGradientTag = 2;

const char* KindName(PipelineOp::Kind kind) {
  switch (kind) {
    case PipelineOp::Kind::kReceiveActivation:
      return "receive-activation";
    case PipelineOp::Kind::kForward:
      return "forward";
    case PipelineOp::Kind::kSendActivation:
      return "send-activation";
    case PipelineOp::Kind::kReceiveGradient:
      return "receive-gradient";
    case PipelineOp::Kind::kBackward:
      return "backward";
    case PipelineOp::Kind::kSendGradient:
      return "send-gradient";
  }
  return "?";
}

}  // namespace

std::string PipelineOp::ToString() const {
  return peer < 0 ? absl::StrCat(KindName(kind), "(chunk ", chunk, ", mb ", micro_batch, ")")
                  : absl::StrCat(KindName(kind), "(chunk ", chunk, ", mb ", micro_batch, ", stage ",
                                 peer, ")");
}

std::vector<PipelineOp> InterleavedPipelineOps(int stages, int stage, int chunks,
                                               int micro_batches) {
  const int p = stages, v = chunks, group = stages * chunks;
  const int total = micro_batches * chunks;
  const int next = (stage + 1) % p, prev = (stage + p - 1) % p;
  std::vector<PipelineOp> ops;
  ops.reserve(6 * total);
  // The model's chunk index of the stage's local chunk c is c * p + stage: the first takes the
  // tokens, the last computes the loss, and the others talk to the neighbouring stages (across
  // the wrap from the last stage to stage 0 between chunks).
  auto model_chunk = [&](int chunk) { return chunk * p + stage; };
  auto micro_batch_of = [&](int k) { return (k / group) * p + k % p; };
  auto add_forward = [&](int k) {
    const int chunk = (k % group) / p, mb = micro_batch_of(k);
    using Kind = PipelineOp::Kind;
    if (model_chunk(chunk) > 0) ops.push_back({Kind::kReceiveActivation, chunk, mb, prev});
    ops.push_back({Kind::kForward, chunk, mb, -1});
    if (model_chunk(chunk) < group - 1) ops.push_back({Kind::kSendActivation, chunk, mb, next});
  };
  auto add_backward = [&](int k) {
    const int chunk = v - 1 - (k % group) / p, mb = micro_batch_of(k);
    using Kind = PipelineOp::Kind;
    if (model_chunk(chunk) < group - 1) ops.push_back({Kind::kReceiveGradient, chunk, mb, next});
    ops.push_back({Kind::kBackward, chunk, mb, -1});
    if (model_chunk(chunk) > 0) ops.push_back({Kind::kSendGradient, chunk, mb, prev});
  };
  // Stage s starts its first backward once the first micro-batch group has gone through the
  // chunks after its first: (v - 1) * p forwards of the earlier chunks plus the p - s - 1 the
  // plain 1F1B warm-up keeps in flight. Megatron doubles the second term because its sends and
  // receives pair up synchronously; posted sends need no such slack (the test's simulation gets
  // the ideal (p - 1) / (v m) bubble without it).
  const int warmup = std::min((p - stage - 1) + (v - 1) * p, total);
  for (int k = 0; k < warmup; ++k) add_forward(k);
  for (int k = 0; k < total - warmup; ++k) {
    add_forward(k + warmup);
    add_backward(k);
  }
  for (int k = total - warmup; k < total; ++k) add_backward(k);
  return ops;
}

PipelineSchedule::PipelineSchedule(c10::intrusive_ptr<c10d::ProcessGroup> group, int stage,
                                   std::vector<int> stage_ranks,
                                   std::vector<int64_t> activation_shape, at::Device device,
                                   int chunks)
    : group_(std::move(group)),
      stage_(stage),
      stages_(static_cast<int>(stage_ranks.size())),
      stage_ranks_(std::move(stage_ranks)),
      activation_shape_(std::move(activation_shape)),
      device_(device),
      chunks_(chunks) {
  TORCH_CHECK(stages_ >= 1 && stage_ >= 0 && stage_ < stages_, "pipeline stage ", stage_, " of ",
              stages_);
  TORCH_CHECK(chunks_ >= 1, "pipeline stage with ", chunks_, " chunks");
  TORCH_CHECK(stages_ == 1 || group_, "a pipeline of ", stages_, " stages needs a process group");
}

at::Tensor PipelineSchedule::EmptyActivation() const {
  return at::empty(activation_shape_, at::TensorOptions().dtype(at::kFloat).device(device_));
}

void PipelineSchedule::ThrowPeerLost(const std::vector<int>& stages,
                                     const std::exception& e) const {
  std::string peers;
  for (int peer : stages) {
    if (peer < 0 || peers.find(std::to_string(stage_ranks_[peer]) + ")") != std::string::npos) {
      continue;
    }
    peers += absl::StrCat(peers.empty() ? "" : " and ", "stage ", peer, " (rank ",
                          stage_ranks_[peer], ")");
  }
  throw std::runtime_error(absl::StrCat("pipeline peer lost: stage ", stage_, " (rank ",
                                        stage_ranks_[stage_],
                                        ") could not exchange activations or gradients with ",
                                        peers, ": ", c10::GetExceptionString(e)));
}

void PipelineSchedule::PostSend(const at::Tensor& tensor, int to, int tag) {
  std::vector<at::Tensor> outgoing{tensor.detach().to(at::kFloat).contiguous()};
  const CollectiveIssue issue =
      IssueCollective(CollectiveKind::kSendRecv, group_.get(), TensorBytes(outgoing),
                      outgoing[0].is_cuda(), CollectivePeers::kSome);
  sends_.push_back({group_->send(outgoing, to, tag), to, issue});
  sent_.push_back(outgoing[0]);
}

void PipelineSchedule::FinishSends() {
  std::vector<PostedSend> sends = std::move(sends_);
  sends_.clear();
  for (auto& [work, peer, issue] : sends) {
    try {
      WaitForPeers(work, issue);
    } catch (const std::exception& e) {
      sent_.clear();
      ThrowPeerLost({peer}, e);
    }
  }
  sent_.clear();
}

at::Tensor PipelineSchedule::Receive(int from, int tag, bool requires_grad) {
  std::vector<at::Tensor> incoming{EmptyActivation()};
  const CollectiveIssue issue =
      IssueCollective(CollectiveKind::kSendRecv, group_.get(), TensorBytes(incoming),
                      incoming[0].is_cuda(), CollectivePeers::kSome);
  auto work = group_->recv(incoming, from, tag);
  try {
    WaitForPeers(work, issue);
  } catch (const std::exception& e) {
    ThrowPeerLost({from}, e);
  }
  return incoming[0].requires_grad_(requires_grad);
}

at::Tensor PipelineSchedule::Exchange(const at::Tensor& send, int send_to, int send_tag,
                                      bool receive, int receive_from, int receive_tag,
                                      bool requires_grad) {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<at::Tensor> outgoing, incoming;
  if (send.defined()) outgoing.push_back(send.detach().to(at::kFloat).contiguous());
  if (receive) incoming.push_back(EmptyActivation());
  // The exchange as one send_recv: its bytes are this rank's send and receive.
  const CollectiveIssue issue = IssueCollective(CollectiveKind::kSendRecv, group_.get(),
                                                TensorBytes(outgoing) + TensorBytes(incoming),
                                                device_.is_cuda(), CollectivePeers::kSome);
  if (send.defined()) works.push_back(group_->send(outgoing, send_to, send_tag));
  if (receive) works.push_back(group_->recv(incoming, receive_from, receive_tag));
  try {
    for (auto& work : works) WaitForPeers(work);
    RecordCollective(issue);
  } catch (const std::exception& e) {
    ThrowPeerLost({send.defined() ? send_to : -1, receive ? receive_from : -1}, e);
  }
  if (!receive) return at::Tensor();
  return incoming[0].requires_grad_(requires_grad);
}

at::Tensor PipelineSchedule::Train(int micro_batches, const Forward& forward,
                                   const Backward& backward) {
  if (chunks_ > 1) return TrainInterleaved(micro_batches, forward, backward);
  const int m = micro_batches;
  const int warmup = std::min(stages_ - stage_ - 1, m);
  const int remaining = m - warmup;
  const int prev = stage_ - 1, next = stage_ + 1;
  std::deque<std::pair<at::Tensor, at::Tensor>> in_flight;  // (input, output) per micro-batch
  at::Tensor loss_sum;
  int forwards = 0, backwards = 0;

  auto receive_forward = [&]() {
    return first() ? at::Tensor()
                   : Exchange({}, 0, 0, true, prev, kActivationTag, /*requires_grad=*/true);
  };
  auto run_forward = [&](const at::Tensor& input) {
    at::Tensor output = forward(0, forwards++, input);
    if (last()) {
      at::Tensor loss = output.detach().to(at::kFloat);
      loss_sum = loss_sum.defined() ? loss_sum + loss : loss;
    }
    in_flight.emplace_back(input, output);
    return output;
  };
  // The oldest micro-batch's backward; returns the gradient for the previous stage.
  auto run_backward = [&](const at::Tensor& grad) {
    auto [input, output] = std::move(in_flight.front());
    in_flight.pop_front();
    backward(0, backwards, output, grad, backwards == m - 1);
    ++backwards;
    if (first()) return at::Tensor();
    return input.grad().defined() ? input.grad() : at::zeros_like(input);
  };
  auto send_forward_receive_backward = [&](const at::Tensor& output) {
    if (last()) return at::Tensor();
    return Exchange(output, next, kActivationTag, true, next, kGradientTag, false);
  };
  auto send_backward_receive_forward = [&](const at::Tensor& input_grad) {
    if (first()) return at::Tensor();
    return Exchange(input_grad, prev, kGradientTag, true, prev, kActivationTag, true);
  };
  auto send_backward = [&](const at::Tensor& input_grad) {
    if (!first()) Exchange(input_grad, prev, kGradientTag, false, 0, 0, false);
  };

  for (int i = 0; i < warmup; ++i) {
    at::Tensor output = run_forward(receive_forward());
    if (!last()) Exchange(output, next, kActivationTag, false, 0, 0, false);
  }
  at::Tensor input = remaining > 0 ? receive_forward() : at::Tensor();
  for (int i = 0; i < remaining; ++i) {
    at::Tensor output = run_forward(input);
    at::Tensor grad = send_forward_receive_backward(output);
    at::Tensor input_grad = run_backward(grad);
    if (i == remaining - 1) {
      send_backward(input_grad);
      input = at::Tensor();
    } else {
      input = send_backward_receive_forward(input_grad);
    }
  }
  for (int i = 0; i < warmup; ++i) {
    at::Tensor grad = last() ? at::Tensor() : Exchange({}, 0, 0, true, next, kGradientTag, false);
    send_backward(run_backward(grad));
  }
  return loss_sum;
}

at::Tensor PipelineSchedule::Evaluate(const Forward& forward) {
  if (chunks_ > 1) {
    // The micro-batch goes around the stages once per chunk; posted sends let stage 0 move on
    // to receive the wrapped activations of its next chunk.
    sends_.clear();
    at::Tensor loss;
    for (int chunk = 0; chunk < chunks_; ++chunk) {
      at::Tensor input = first(chunk) ? at::Tensor()
                                      : Receive((stage_ + stages_ - 1) % stages_, kActivationTag,
                                                /*requires_grad=*/false);
      at::Tensor output = forward(chunk, 0, input);
      if (last(chunk)) {
        loss = output;
      } else {
        PostSend(output, (stage_ + 1) % stages_, kActivationTag);
      }
    }
    FinishSends();
    return loss;
  }
  at::Tensor input =
      first() ? at::Tensor() : Exchange({}, 0, 0, true, stage_ - 1, kActivationTag, false);
  at::Tensor output = forward(0, 0, input);
  if (last()) return output;
  Exchange(output, stage_ + 1, kActivationTag, false, 0, 0, false);
  return at::Tensor();
}

at::Tensor PipelineSchedule::TrainInterleaved(int micro_batches, const Forward& forward,
                                              const Backward& backward) {
  // planner::CheckSplitRules refuses the rest at submission and in the trainer's ValidateSplits.
  TORCH_CHECK(chunks_ == 1 || (chunks_ > 1 && micro_batches >= 1 && micro_batches % stages_ == 0),
              "interleaved 1F1B takes the micro-batches of a step in groups of the ", stages_,
              " stages, got ", micro_batches, " over ", chunks_, " chunk(s)");
  sends_.clear();
  sent_.clear();
  // Per (chunk, micro-batch): the received input (with its gradient after the backward), the
  // output kept for the backward, and the gradient received for it.
  std::map<std::pair<int, int>, at::Tensor> inputs, outputs, grads;
  at::Tensor loss_sum;
  using Kind = PipelineOp::Kind;
  for (const PipelineOp& op : InterleavedPipelineOps(stages_, stage_, chunks_, micro_batches)) {
    const std::pair<int, int> key{op.chunk, op.micro_batch};
    switch (op.kind) {
      case Kind::kReceiveActivation:
        inputs[key] = Receive(op.peer, kActivationTag, /*requires_grad=*/true);
        break;
      case Kind::kForward: {
        at::Tensor output = forward(op.chunk, op.micro_batch, inputs[key]);
        if (last(op.chunk)) {
          at::Tensor loss = output.detach().to(at::kFloat);
          loss_sum = loss_sum.defined() ? loss_sum + loss : loss;
        }
        outputs[key] = std::move(output);
        break;
      }
      case Kind::kSendActivation:
        PostSend(outputs.at(key), op.peer, kActivationTag);
        break;
      case Kind::kReceiveGradient:
        grads[key] = Receive(op.peer, kGradientTag, /*requires_grad=*/false);
        break;
      case Kind::kBackward: {
        // Backward order takes a chunk's micro-batches in increasing order.
        backward(op.chunk, op.micro_batch, outputs.at(key), grads[key],
                 op.micro_batch == micro_batches - 1);
        outputs.erase(key);
        grads.erase(key);
        if (first(op.chunk)) inputs.erase(key);
        break;
      }
      case Kind::kSendGradient: {
        at::Tensor input = inputs.at(key);
        inputs.erase(key);
        PostSend(input.grad().defined() ? input.grad() : at::zeros_like(input), op.peer,
                 kGradientTag);
        break;
      }
    }
  }
  FinishSends();
  return loss_sum;
}

}  // namespace tessera::trainer

#include "trainer/parallel/pipeline.h"

#include <algorithm>
#include <deque>
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

}  // namespace

PipelineSchedule::PipelineSchedule(c10::intrusive_ptr<c10d::ProcessGroup> group, int stage,
                                   std::vector<int> stage_ranks,
                                   std::vector<int64_t> activation_shape, at::Device device)
    : group_(std::move(group)),
      stage_(stage),
      stages_(static_cast<int>(stage_ranks.size())),
      stage_ranks_(std::move(stage_ranks)),
      activation_shape_(std::move(activation_shape)),
      device_(device) {
  TORCH_CHECK(stages_ >= 1 && stage_ >= 0 && stage_ < stages_, "pipeline stage ", stage_, " of ",
              stages_);
  TORCH_CHECK(stages_ == 1 || group_, "a pipeline of ", stages_, " stages needs a process group");
}

at::Tensor PipelineSchedule::EmptyActivation() const {
  return at::empty(activation_shape_, at::TensorOptions().dtype(at::kFloat).device(device_));
}

at::Tensor PipelineSchedule::Exchange(const at::Tensor& send, int send_to, int send_tag,
                                      bool receive, int receive_from, int receive_tag,
                                      bool requires_grad) {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<at::Tensor> outgoing, incoming;
  if (send.defined()) {
    outgoing.push_back(send.detach().to(at::kFloat).contiguous());
    works.push_back(group_->send(outgoing, send_to, send_tag));
  }
  if (receive) {
    incoming.push_back(EmptyActivation());
    works.push_back(group_->recv(incoming, receive_from, receive_tag));
  }
  try {
    for (auto& work : works) WaitForPeers(work);
  } catch (const std::exception& e) {
    std::string peers;
    for (int peer : {send.defined() ? send_to : -1, receive ? receive_from : -1}) {
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
  if (!receive) return at::Tensor();
  return incoming[0].requires_grad_(requires_grad);
}

at::Tensor PipelineSchedule::Train(int micro_batches, const Forward& forward,
                                   const Backward& backward) {
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
    at::Tensor output = forward(forwards++, input);
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
    backward(backwards, output, grad, backwards == m - 1);
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
  at::Tensor input =
      first() ? at::Tensor() : Exchange({}, 0, 0, true, stage_ - 1, kActivationTag, false);
  at::Tensor output = forward(0, input);
  if (last()) return output;
  Exchange(output, stage_ + 1, kActivationTag, false, 0, 0, false);
  return at::Tensor();
}

}  // namespace tessera::trainer

// Checkpoint and CheckpointWithoutOutput against the same function run without checkpointing:
// outputs and gradients (of inputs and of captured parameters) equal bitwise, random draws and
// autocast replay as in forward, the recompute runs once, and discarded outputs really are freed.

#include "trainer/model/activation_checkpoint.h"

#include <ATen/autocast_mode.h>

#include <vector>

#include "gtest/gtest.h"
#include "trainer/torch_pch.h"

namespace tessera::trainer {
namespace {

using Tensor = torch::Tensor;
using Tensors = std::vector<Tensor>;

// Uses both inputs, a captured parameter, an op that saves its output (exp) and a random draw.
struct TestFunction {
  Tensor weight;
  int* calls;

  Tensors operator()(const Tensors& in) const {
    ++*calls;
    Tensor mixed = torch::matmul(in[0], weight) * torch::tanh(in[1]);
    Tensor noise = torch::rand_like(mixed);
    return {torch::exp(mixed * noise), torch::sigmoid(mixed)};
  }
};

struct Gradients {
  Tensor loss, x, y, weight;
};

// Builds leaves from `seed`, runs `run` on them and backpropagates a loss of its outputs.
Gradients RunAndBackward(uint64_t seed, const std::function<Tensors(TestFunction, Tensors)>& run,
                         int* calls) {
  torch::manual_seed(seed);
  Tensor weight = torch::randn({6, 5}).requires_grad_();
  Tensor x = torch::randn({4, 6}).requires_grad_();
  Tensor y = torch::randn({4, 5}).requires_grad_();
  // Non-leaf inputs, as inside a model.
  Tensors outputs = run(TestFunction{weight, calls}, {x * 2, y + 1});
  Tensor loss = (outputs[0] * outputs[0]).sum() + outputs[1].sum();
  loss.backward();
  return {loss.detach(), x.grad(), y.grad(), weight.grad()};
}

void ExpectEqual(const Gradients& actual, const Gradients& expected) {
  EXPECT_TRUE(torch::equal(actual.loss, expected.loss));
  EXPECT_TRUE(torch::equal(actual.x, expected.x));
  EXPECT_TRUE(torch::equal(actual.y, expected.y));
  EXPECT_TRUE(torch::equal(actual.weight, expected.weight));
}

TEST(ActivationCheckpointTest, CheckpointMatchesPlainRunBitwise) {
  int plain_calls = 0, checkpoint_calls = 0;
  Gradients expected = RunAndBackward(
      3, [](TestFunction fn, Tensors in) { return fn(in); }, &plain_calls);
  const Tensor next_draw = torch::rand({8});
  Gradients actual = RunAndBackward(
      3, [](TestFunction fn, Tensors in) { return Checkpoint(fn, in); }, &checkpoint_calls);
  ExpectEqual(actual, expected);
  EXPECT_EQ(plain_calls, 1);
  EXPECT_EQ(checkpoint_calls, 2);
  // The recompute replays the forward's draws without moving the global generator.
  EXPECT_TRUE(torch::equal(torch::rand({8}), next_draw));
}

TEST(ActivationCheckpointTest, CheckpointWithoutOutputMatchesPlainRunBitwise) {
  int plain_calls = 0, checkpoint_calls = 0;
  // The consumer saves its input (mul by itself), as a projection after an activation does.
  auto consume = [](const Tensors& out) { return out[0] * out[0] + out[1]; };
  auto plain = [&](TestFunction fn, Tensors in) -> Tensors { return {consume(fn(in))}; };
  Tensors freed;
  auto checkpointed = [&](TestFunction fn, Tensors in) -> Tensors {
    Tensor result = CheckpointWithoutOutput(fn, in, [&](const Tensors& out) {
      freed = out;
      return consume(out);
    });
    for (const Tensor& out : freed) EXPECT_EQ(out.storage().nbytes(), 0u);
    return {result, torch::zeros_like(result)};
  };
  auto as_pair = [](Tensors single) -> Tensors {
    return {single[0], torch::zeros_like(single[0])};
  };
  Gradients expected = RunAndBackward(
      5, [&](TestFunction fn, Tensors in) { return as_pair(plain(fn, in)); }, &plain_calls);
  Gradients actual = RunAndBackward(5, checkpointed, &checkpoint_calls);
  ExpectEqual(actual, expected);
  EXPECT_EQ(plain_calls, 1);
  EXPECT_EQ(checkpoint_calls, 2) << "the hook's recompute should serve the backward too";
  ASSERT_EQ(freed.size(), 2u);
  EXPECT_EQ(freed[0].storage().nbytes(), 4u * 5 * sizeof(float)) << "not restored";
}

TEST(ActivationCheckpointTest, CheckpointWithoutOutputRejectsOutputAliasingInput) {
  Tensor x = torch::randn({3}).requires_grad_();
  Tensor doubled = x * 2;
  EXPECT_THROW(CheckpointWithoutOutput([](const Tensors& in) { return Tensors{in[0].view({3})}; },
                                       {doubled}, [](const Tensors& out) { return out[0] * 3; }),
               c10::Error);
}

TEST(ActivationCheckpointTest, RecomputeRestoresForwardAutocast) {
  // CPU autocast stands in for CUDA's: the same capture and restore covers both device types.
  torch::manual_seed(1);
  Tensor weight = torch::randn({8, 8}).requires_grad_();
  Tensor x = torch::randn({4, 8}).requires_grad_();
  std::vector<at::ScalarType> seen;
  auto fn = [&](const Tensors& in) -> Tensors {
    Tensor product = torch::matmul(in[0], weight);
    seen.push_back(product.scalar_type());
    return {product.to(torch::kFloat32).square()};
  };
  at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
  at::autocast::set_autocast_enabled(at::kCPU, true);
  Tensor checkpointed = Checkpoint(fn, {x * 1})[0].sum();
  Tensor plain = fn({x * 1})[0].sum();
  at::autocast::set_autocast_enabled(at::kCPU, false);
  at::autocast::clear_cache();

  checkpointed.backward();
  ASSERT_EQ(seen, (std::vector<at::ScalarType>{at::kBFloat16, at::kBFloat16, at::kBFloat16}));
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU)) << "recompute leaked autocast";
  Tensor checkpointed_x = x.grad().clone(), checkpointed_w = weight.grad().clone();
  x.mutable_grad().reset();
  weight.mutable_grad().reset();
  plain.backward();
  EXPECT_TRUE(torch::equal(checkpointed_x, x.grad()));
  EXPECT_TRUE(torch::equal(checkpointed_w, weight.grad()));
}

TEST(ActivationCheckpointTest, WithoutGradItOnlyCallsTheFunction) {
  Tensor x = torch::randn({3}).requires_grad_();
  int calls = 0;
  auto fn = [&](const Tensors& in) -> Tensors {
    ++calls;
    return {in[0] * 2};
  };
  {
    torch::NoGradGuard no_grad;
    Tensor out = Checkpoint(fn, {x})[0];
    EXPECT_FALSE(out.requires_grad());
  }
  // No input requires grad: nothing to recompute for.
  Tensor out = Checkpoint(fn, {x.detach()})[0];
  EXPECT_FALSE(out.requires_grad());
  EXPECT_EQ(calls, 2);
}

TEST(ActivationCheckpointTest, InPlaceChangeOfAnInputIsAnError) {
  Tensor x = torch::randn({3}).requires_grad_();
  Tensor input = x * 1;
  Tensor out = Checkpoint([](const Tensors& in) { return Tensors{in[0].square()}; }, {input})[0];
  {
    torch::NoGradGuard no_grad;
    input.add_(1);
  }
  EXPECT_THROW(out.sum().backward(), c10::Error);
}

}  // namespace
}  // namespace tessera::trainer

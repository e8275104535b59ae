// The loss under a loss mask (targets of kIgnoreTarget), against references computed another
// way: CausalLM::Loss and its gradients against log-softmax of forward() picked at the counted
// targets only; the prompt targets' values do not matter and the response targets' do; an
// all-masked batch gives loss 0 and zero gradients, never NaN, and a step of such batches leaves
// parameters and moments as they were (ShardedEngine::Step without update); and the vocab-parallel
// cross-entropy on two Gloo ranks (threads sharing a HashStore) against the single-rank one.

#include <cmath>
#include <cstdlib>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/model_config.h"
#include "trainer/data/data_loader.h"
#include "trainer/engine/sharded_engine.h"
#include "trainer/model/model.h"
#include "trainer/model/model_dims_fixture.h"
#include "trainer/parallel/distributed.h"
#include "trainer/parallel/tensor_parallel.h"
#include "trainer/torch_pch.h"

namespace tessera::trainer {
namespace {

using ::tessera::testing::IsOk;
using Tensor = torch::Tensor;

using testing::PresetDims;

struct LossAndGrads {
  double loss = 0;
  std::vector<Tensor> grads;
};

LossAndGrads LossOf(CausalLM& model, const Tensor& inputs, const Tensor& targets) {
  model->zero_grad();
  Tensor loss = model->Loss(inputs, targets);
  loss.backward();
  LossAndGrads out{loss.item<double>(), {}};
  for (const Tensor& p : model->parameters()) {
    out.grads.push_back(p.grad().defined() ? p.grad().clone() : torch::zeros_like(p));
  }
  return out;
}

// Largest |a - b| / max(|b|, tiny) over the gradient tensors (L2 per tensor).
double GradDifference(const LossAndGrads& a, const LossAndGrads& b) {
  double worst = 0;
  for (size_t i = 0; i < a.grads.size(); ++i) {
    const double norm = b.grads[i].norm().item<double>();
    worst = std::max(worst, (a.grads[i] - b.grads[i]).norm().item<double>() / std::max(norm, 1e-12));
  }
  return worst;
}

class LossMaskTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dims_ = PresetDims(GetParam());
    torch::manual_seed(11);
    model_ = CausalLM(dims_, 0.02);
    inputs_ = torch::randint(dims_.vocab_size(), {3, 16}, torch::kLong);
    targets_ = torch::randint(dims_.vocab_size(), {3, 16}, torch::kLong);
    // Rows with different numbers of counted targets: a prompt of 4, 11 and 15 tokens.
    mask_ = torch::ones({3, 16}, torch::kBool);
    mask_.index_put_({0, torch::indexing::Slice(0, 4)}, false);
    mask_.index_put_({1, torch::indexing::Slice(0, 11)}, false);
    mask_.index_put_({2, torch::indexing::Slice(0, 15)}, false);
  }

  Tensor Masked(const Tensor& targets) const {
    return torch::where(mask_, targets, torch::full_like(targets, kIgnoreTarget));
  }

  v1::ModelDims dims_;
  CausalLM model_{nullptr};
  Tensor inputs_, targets_, mask_;
};

TEST_P(LossMaskTest, LossAndGradientsAreTheMeanOverCountedTargets) {
  const LossAndGrads masked = LossOf(model_, inputs_, Masked(targets_));
  // Reference: log-softmax of the whole model's logits, picked at the counted targets only.
  model_->zero_grad();
  Tensor log_probs = torch::log_softmax(model_->forward(inputs_).to(torch::kFloat32), -1);
  Tensor picked = log_probs.gather(-1, targets_.unsqueeze(-1)).squeeze(-1);
  Tensor reference = -(picked * mask_).sum() / mask_.sum();
  reference.backward();
  LossAndGrads expected{reference.item<double>(), {}};
  for (const Tensor& p : model_->parameters()) expected.grads.push_back(p.grad().clone());
  EXPECT_NEAR(masked.loss, expected.loss, 1e-5 * expected.loss);
  EXPECT_LE(GradDifference(masked, expected), 1e-4);
  // The mask matters: the unmasked loss is another number.
  EXPECT_GT(std::abs(LossOf(model_, inputs_, targets_).loss - masked.loss), 1e-4);
}

TEST_P(LossMaskTest, PromptTargetsDoNotMatterResponseTargetsDo) {
  const LossAndGrads base = LossOf(model_, inputs_, Masked(targets_));
  // Other values at every prompt position (inputs unchanged).
  Tensor prompt_perturbed =
      torch::where(mask_, targets_, (targets_ + 1 + torch::randint(5, targets_.sizes(), torch::kLong)) %
                                        dims_.vocab_size());
  ASSERT_TRUE((prompt_perturbed != targets_).logical_and(mask_.logical_not()).any().item<bool>());
  const LossAndGrads same = LossOf(model_, inputs_, Masked(prompt_perturbed));
  EXPECT_EQ(same.loss, base.loss);
  EXPECT_EQ(GradDifference(same, base), 0.0);
  // One response target of row 2 (its only counted one) changed.
  Tensor response_perturbed = targets_.clone();
  response_perturbed.index_put_({2, 15}, (targets_.index({2, 15}) + 1) % dims_.vocab_size());
  const LossAndGrads changed = LossOf(model_, inputs_, Masked(response_perturbed));
  EXPECT_NE(changed.loss, base.loss);
  EXPECT_GT(GradDifference(changed, base), 1e-6);
}

TEST_P(LossMaskTest, AllMaskedBatchHasZeroLossAndZeroGradients) {
  const LossAndGrads none =
      LossOf(model_, inputs_, torch::full_like(targets_, kIgnoreTarget));
  EXPECT_EQ(none.loss, 0.0);
  for (const Tensor& g : none.grads) {
    ASSERT_TRUE(torch::isfinite(g).all().item<bool>());
    EXPECT_EQ(g.abs().max().item<double>(), 0.0);
  }
}

// A step whose global batch has no counted target changes nothing when the engine is told not to
// update, as the trainer tells it: after a real step (moments not zero), AdamW on the zero
// gradients of an all-masked batch would still move every weight by momentum and decay.
TEST_P(LossMaskTest, AllMaskedStepLeavesParametersAndMomentsAsTheyWere) {
  ShardedEngineOptions options;
  options.weight_decay = 0.1;
  ShardedEngine engine(model_, options);
  engine.ForwardBackward(inputs_, Masked(targets_), 1.0, /*last=*/true);
  engine.Step(1e-2, 1.0);
  auto state = [&engine] {
    std::vector<Tensor> values;
    for (const TensorRange& range : engine.SaveRanges()) values.push_back(range.data.clone());
    return values;
  };
  const std::vector<Tensor> before = state();
  const int64_t step_before = engine.optimizer_step();
  const Tensor none = torch::full_like(targets_, kIgnoreTarget);
  // LossWeight is 0 for every micro-batch of such a step.
  EXPECT_EQ(engine.ForwardBackward(inputs_, none, 0.0, /*last=*/true).item<double>(), 0.0);
  EXPECT_EQ(engine.Step(1e-2, 1.0, /*update=*/false), 0.0);
  const std::vector<Tensor> skipped = state();
  ASSERT_EQ(skipped.size(), before.size());
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(torch::equal(skipped[i], before[i])) << i;
  EXPECT_EQ(engine.optimizer_step(), step_before);
  // Stepping anyway (what the trainer did before) moves the weights.
  engine.ForwardBackward(inputs_, none, 0.0, /*last=*/true);
  engine.Step(1e-2, 1.0);
  const std::vector<Tensor> stepped = state();
  bool moved = false;
  for (size_t i = 0; i < before.size(); ++i) moved |= !torch::equal(stepped[i], before[i]);
  EXPECT_TRUE(moved);
}

// Micro-batches weighed by LossWeight() sum to the loss of the whole batch at once: what
// gradient accumulation and data parallelism rely on.
TEST_P(LossMaskTest, WeightedMicroBatchesEqualTheWholeBatch) {
  const Tensor targets = Masked(targets_);
  const LossAndGrads whole = LossOf(model_, inputs_, targets);
  const int64_t step_tokens = mask_.sum().item<int64_t>();
  double loss = 0;
  std::vector<Tensor> grads;
  for (int64_t row = 0; row < 3; ++row) {
    MicroBatch mb;
    mb.loss_tokens = mask_[row].sum().item<int64_t>();
    mb.step_loss_tokens = step_tokens;
    const LossAndGrads part = LossOf(model_, inputs_.slice(0, row, row + 1),
                                  targets.slice(0, row, row + 1));
    loss += part.loss * LossWeight(mb);
    for (size_t i = 0; i < part.grads.size(); ++i) {
      if (row == 0) grads.push_back(torch::zeros_like(part.grads[i]));
      grads[i] += part.grads[i] * LossWeight(mb);
    }
  }
  EXPECT_NEAR(loss, whole.loss, 1e-5 * whole.loss);
  EXPECT_LE(GradDifference(LossAndGrads{loss, grads}, whole), 1e-4);
  EXPECT_EQ(LossWeight(MicroBatch{}), 0.0);
}

INSTANTIATE_TEST_SUITE_P(Models, LossMaskTest, ::testing::Values("tiny-gpt2", "tiny-llama"));

// VocabParallelCrossEntropy on tp = 2 (threads) against the single-rank masked mean, with some
// targets masked, and with all of them masked.
TEST(VocabParallelLossMaskTest, MatchesTheSingleRankMaskedMeanAndNeverNaN) {
  setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/1);  // see mesh_test.cc
  constexpr int64_t kRows = 10, kVocab = 37;
  torch::manual_seed(3);
  const Tensor logits = torch::randn({kRows, kVocab});
  Tensor targets = torch::randint(kVocab, {kRows}, torch::kLong);
  for (int64_t i : {0, 3, 4, 8}) targets[i] = kIgnoreTarget;
  const Tensor counted = targets != kIgnoreTarget;
  // Reference on one rank.
  Tensor full = logits.clone().requires_grad_(true);
  Tensor reference = -(torch::log_softmax(full, -1).gather(-1, targets.clamp_min(0).unsqueeze(-1))
                           .squeeze(-1) * counted)
                          .sum() /
                     counted.sum();
  reference.backward();

  auto store = c10::make_intrusive<c10d::HashStore>();
  const int64_t local = VocabRowsPerRank(kVocab, 2);
  std::vector<double> losses(2), all_masked_losses(2);
  std::vector<Tensor> grads(2);
  std::vector<bool> finite(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      auto group = NewProcessGroup(store, rank, 2, v1::DEVICE_TYPE_CPU, "127.0.0.1",
                                   ProcessGroupOptions{});
      ASSERT_THAT(group, IsOk());
      TensorParallel tp;
      tp.group = *group;
      tp.rank = rank;
      tp.size = 2;
      const int64_t begin = rank * local;
      const int64_t valid = std::clamp<int64_t>(kVocab - begin, 0, local);
      Tensor mine = torch::zeros({kRows, local});
      mine.narrow(1, 0, valid).copy_(logits.narrow(1, begin, valid));
      mine.requires_grad_(true);
      Tensor loss = VocabParallelCrossEntropy(mine, targets, begin, valid, tp);
      loss.backward();
      losses[rank] = loss.item<double>();
      grads[rank] = mine.grad().narrow(1, 0, valid).clone();

      Tensor none = mine.detach().clone().requires_grad_(true);
      Tensor masked_loss =
          VocabParallelCrossEntropy(none, torch::full({kRows}, kIgnoreTarget), begin, valid, tp);
      masked_loss.backward();
      all_masked_losses[rank] = masked_loss.item<double>();
      finite[rank] = torch::isfinite(none.grad()).all().item<bool>() &&
                     none.grad().abs().max().item<double>() == 0.0;
    });
  }
  for (auto& t : threads) t.join();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NEAR(losses[rank], reference.item<double>(), 1e-5) << rank;
    EXPECT_EQ(all_masked_losses[rank], 0.0) << rank;
    EXPECT_TRUE(finite[rank]) << rank;
  }
  const Tensor joined = torch::cat({grads[0], grads[1]}, 1);
  EXPECT_LE((joined - full.grad()).abs().max().item<double>(), 1e-6);
}

}  // namespace
}  // namespace tessera::trainer

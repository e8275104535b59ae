// FusedAdamW against LibTorch's reference AdamW (torch::optim::AdamW, a
// per-parameter loop) over several steps, and across save/load.

#include "trainer/engine/adamw.h"

#include "gtest/gtest.h"

namespace tessera::trainer {
namespace {

std::vector<at::Tensor> MakeParams(int64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({5, 3}).requires_grad_(true), torch::randn({7}).requires_grad_(true),
          torch::randn({2, 2, 2}).requires_grad_(true)};
}

// Deterministic gradients that change from step to step.
void SetGrads(std::vector<at::Tensor>& params, int step) {
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].mutable_grad() =
        torch::sin(torch::arange(params[i].numel(), torch::kFloat32) * (step + 1) + i)
            .reshape(params[i].sizes());
  }
}

TEST(FusedAdamWTest, MatchesTheReferenceAdamWWithTwoGroups) {
  auto fused_params = MakeParams(3);
  auto reference_params = MakeParams(3);
  const double lr = 1e-2, decay = 0.1;
  FusedAdamW fused({{.params = {fused_params[0], fused_params[2]}, .weight_decay = decay},
                    {.params = {fused_params[1]}, .weight_decay = 0.0}},
                   {.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8});
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(
      std::vector<at::Tensor>{reference_params[0], reference_params[2]},
      std::make_unique<torch::optim::AdamWOptions>(
          torch::optim::AdamWOptions(lr).betas({0.9, 0.95}).eps(1e-8).weight_decay(decay)));
  groups.emplace_back(
      std::vector<at::Tensor>{reference_params[1]},
      std::make_unique<torch::optim::AdamWOptions>(
          torch::optim::AdamWOptions(lr).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.0)));
  torch::optim::AdamW reference(std::move(groups), torch::optim::AdamWOptions(lr));

  for (int step = 0; step < 6; ++step) {
    SetGrads(fused_params, step);
    SetGrads(reference_params, step);
    fused.Step(lr);
    reference.step();
  }
  for (size_t i = 0; i < fused_params.size(); ++i) {
    EXPECT_TRUE(torch::allclose(fused_params[i], reference_params[i], 1e-6, 1e-6))
        << "param " << i << "\n"
        << fused_params[i] - reference_params[i];
    // Decay or not, the parameters moved.
    EXPECT_FALSE(torch::equal(fused_params[i], MakeParams(3)[i])) << "param " << i;
  }
}

TEST(FusedAdamWTest, ParametersWithoutGradientsStayPut) {
  auto params = MakeParams(5);
  at::Tensor before = params[1].detach().clone();
  FusedAdamW adamw({{.params = params, .weight_decay = 0.1}}, {});
  SetGrads(params, 0);
  params[1].mutable_grad().reset();
  adamw.Step(1e-2);
  EXPECT_TRUE(torch::equal(params[1], before));
}

TEST(FusedAdamWTest, SaveAndLoadContinueIdentically) {
  auto straight = MakeParams(9);
  auto resumed = MakeParams(9);
  FusedAdamW a({{.params = straight, .weight_decay = 0.05}}, {});
  FusedAdamW b({{.params = resumed, .weight_decay = 0.05}}, {});
  for (int step = 0; step < 3; ++step) {
    SetGrads(straight, step);
    SetGrads(resumed, step);
    a.Step(3e-3);
    b.Step(3e-3);
  }
  torch::serialize::OutputArchive out;
  b.Save(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  // A fresh optimizer over the same parameters, loaded from the archive.
  FusedAdamW c({{.params = resumed, .weight_decay = 0.05}}, {});
  torch::serialize::InputArchive in;
  std::istringstream input(bytes.str());
  in.load_from(input);
  c.Load(in);
  for (int step = 3; step < 6; ++step) {
    SetGrads(straight, step);
    SetGrads(resumed, step);
    a.Step(3e-3);
    c.Step(3e-3);
  }
  for (size_t i = 0; i < straight.size(); ++i) {
    EXPECT_TRUE(torch::equal(straight[i], resumed[i])) << "param " << i;
  }
}

}  // namespace
}  // namespace tessera::trainer

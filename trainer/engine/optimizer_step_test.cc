// One real LibTorch optimizer step, checked against AdamW's update computed
// by hand, and the self-check's small training run.

#include <cmath>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "trainer/kernels/device.h"
#include "trainer/runtime/self_check.h"
#include "trainer/torch_pch.h"

namespace tessera::trainer {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::StatusIs;
using ::testing::HasSubstr;

TEST(OptimizerStepTest, AdamWFirstStepMatchesTheClosedForm) {
  // Loss = sum(w * x): its gradient is x, known exactly.
  const double lr = 0.1, weight_decay = 0.01, eps = 1e-8;
  torch::Tensor w = torch::tensor({0.5, -1.0, 2.0}, torch::kFloat64).requires_grad_(true);
  torch::Tensor x = torch::tensor({3.0, -0.25, 0.0}, torch::kFloat64);
  torch::Tensor w0 = w.detach().clone();

  torch::optim::AdamW optimizer(
      {w}, torch::optim::AdamWOptions(lr).weight_decay(weight_decay).eps(eps).betas({0.9, 0.95}));
  optimizer.zero_grad();
  (w * x).sum().backward();
  optimizer.step();

  // First step: bias-corrected m = g and v = g^2, so the update is
  // lr * g / (|g| + eps), after decoupled decay w *= (1 - lr * wd).
  for (int i = 0; i < 3; ++i) {
    double g = x[i].item<double>();
    double expected = w0[i].item<double>() * (1 - lr * weight_decay) - lr * g / (std::abs(g) + eps);
    EXPECT_NEAR(w[i].item<double>(), expected, 1e-12) << "element " << i;
  }
  // A zero gradient moves the weight by decay alone.
  EXPECT_NEAR(w[2].item<double>(), 2.0 * (1 - lr * weight_decay), 1e-12);
}

TEST(OptimizerStepTest, SelfCheckTrainsOnTheCpu) {
  auto result = RunSelfCheck({.gpu_index = -1, .steps = 30});
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ(result->device.type, "cpu");
  EXPECT_EQ(result->device.backend, "gloo");
  EXPECT_EQ(result->steps, 30);
  EXPECT_LT(result->last_loss, result->first_loss * 0.8);
  EXPECT_THAT(ToJson(*result), HasSubstr(R"("device":"cpu")"));
}

TEST(OptimizerStepTest, SelfCheckRejectsTooFewSteps) {
  EXPECT_THAT(RunSelfCheck({.steps = 1}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("steps")));
}

TEST(DeviceTest, MissingGpuIsAClearError) {
  auto device = DescribeDevice(CudaDeviceCount());
  EXPECT_FALSE(device.ok());
  EXPECT_THAT(device.status().message(), HasSubstr("gpu_index"));
  EXPECT_EQ(DefaultDevice(0).type, CudaDeviceCount() > 0 ? "cuda" : "cpu");
}

TEST(DeviceTest, RunsOnTheGpuWhenThereIsOne) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible";
  auto result = RunSelfCheck({.gpu_index = 0, .steps = 30});
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ(result->device.backend, "nccl");
  EXPECT_LT(result->last_loss, result->first_loss);
}

}  // namespace
}  // namespace tessera::trainer

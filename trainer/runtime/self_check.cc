#include "trainer/runtime/self_check.h"

#include <chrono>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "trainer/torch_pch.h"

namespace tessera::trainer {

absl::StatusOr<SelfCheckResult> RunSelfCheck(const SelfCheckOptions& options) {
  if (options.steps < 2) return absl::InvalidArgumentError("steps: must be >= 2");
  SelfCheckResult result;
  ASSIGN_OR_RETURN(result.device, DescribeDevice(options.gpu_index));
  try {
    torch::manual_seed(options.seed);
    torch::Device device = options.gpu_index < 0 ? torch::Device(torch::kCPU)
                                                 : torch::Device(torch::kCUDA, options.gpu_index);
    torch::nn::Sequential model(torch::nn::Linear(1, 64), torch::nn::GELU(),
                                torch::nn::Linear(64, 1));
    model->to(device);
    torch::optim::AdamW optimizer(model->parameters(),
                                  torch::optim::AdamWOptions(1e-2).weight_decay(0.0));
    torch::Tensor x =
        torch::linspace(-3, 3, 256, torch::TensorOptions().device(device)).unsqueeze(1);
    torch::Tensor y = torch::sin(x);

    auto start = std::chrono::steady_clock::now();
    for (int step = 0; step < options.steps; ++step) {
      optimizer.zero_grad();
      torch::Tensor loss = torch::mse_loss(model->forward(x), y);
      loss.backward();
      optimizer.step();
      double value = loss.item<double>();
      if (step == 0) result.first_loss = value;
      result.last_loss = value;
    }
    result.seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    result.steps = options.steps;
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("LibTorch: ", e.what_without_backtrace()));
  }
  if (!(result.last_loss < result.first_loss)) {
    return absl::FailedPreconditionError(
        absl::StrFormat("loss did not fall: %.6f -> %.6f over %d steps", result.first_loss,
                        result.last_loss, result.steps));
  }
  return result;
}

std::string ToJson(const SelfCheckResult& result) {
  return absl::StrFormat(R"({"device":"%s","device_index":%d,"device_name":"%s","backend":"%s",)"
                         R"("steps":%d,"first_loss":%.6f,"last_loss":%.6f,"seconds":%.4f})",
                         result.device.type, result.device.index, result.device.name,
                         result.device.backend, result.steps, result.first_loss, result.last_loss,
                         result.seconds);
}

}  // namespace tessera::trainer

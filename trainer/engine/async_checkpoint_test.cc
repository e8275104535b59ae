// AsyncCheckpointer: the save copies the state while the next step's forward and backward run,
// and the optimizer step waits for that copy (or finishes it), so the checkpoint holds the state
// of its own step.

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <optional>
#include <thread>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "planner/model_config.h"
#include "tessera/v1/trainer.pb.h"
#include "tests/util/temp_dir.h"
#include "tests/util/wait.h"
#include "trainer/engine/checkpointing.h"
#include "trainer/engine/sharded_engine.h"
#include "trainer/kernels/device.h"
#include "trainer/model/model.h"
#include "trainer/torch_pch.h"

namespace tessera::trainer {
namespace {

using ::tessera::testing::IsOk;

struct Rank {
  CausalLM model{nullptr};
  std::unique_ptr<ShardedEngine> engine;
};

Rank BuildRank(const torch::Device& device) {
  v1::ModelSpec spec;
  spec.set_preset("tiny-gpt2");
  absl::StatusOr<v1::ModelSummary> summary = planner::ResolveModel(spec, 16);
  EXPECT_TRUE(summary.ok()) << summary.status();
  torch::manual_seed(7);
  Rank rank;
  rank.model = CausalLM(summary->dims(), 0.02);
  rank.model->to(device);
  rank.engine = std::make_unique<ShardedEngine>(rank.model, ShardedEngineOptions{});
  return rank;
}

// Copies of every saved range, on the CPU.
std::vector<at::Tensor> Values(ShardedEngine& engine) {
  std::vector<at::Tensor> values;
  for (const TensorRange& range : engine.SaveRanges()) values.push_back(range.data.cpu().clone());
  return values;
}

// Forward, backward and the optimizer step of one batch; `before_update` runs between backward
// and the optimizer step, where the trainer waits for a save's copy.
void TrainOneStep(Rank& rank, const torch::Device& device,
                  const std::function<void()>& before_update = nullptr) {
  torch::manual_seed(11);
  at::Tensor inputs = torch::randint(0, 64, {2, 16}, torch::kInt64).to(device);
  at::Tensor targets = torch::randint(0, 64, {2, 16}, torch::kInt64).to(device);
  rank.engine->ForwardBackward(inputs, targets, 1.0, /*last=*/true);
  if (before_update) before_update();
  rank.engine->Step(1e-2, 1.0);
}

void SaveWhileTraining(const torch::Device& device) {
  tessera::testing::ScopedTempDir temp("async-ckpt");
  const std::string dir = temp.path() + "/checkpoints";
  v1::TrainerTask task;
  task.set_job_id("job-async");
  task.set_checkpoint_directory(dir);
  Rank rank = BuildRank(device);
  TrainOneStep(rank, device);  // moments that are not zero
  const std::vector<at::Tensor> at_save = Values(*rank.engine);

  CheckpointContext context;
  context.task = &task;
  context.engine = rank.engine.get();
  // The save's thread starts copying only 100 ms after the training thread has begun to wait for
  // the copy, so the wait is certain to be needed however long forward and backward take: on the
  // CPU the training thread copies the state itself, on CUDA it waits for the save's stream.
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<bool> awaiting{false};
  context.before_copy = [released] { released.wait(); };
  std::thread releaser([&] {
    ::tessera::testing::WaitUntil([&] { return awaiting.load(); }, absl::Seconds(60),
                                  absl::Milliseconds(1));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    release.set_value();
  });
  AsyncCheckpointer checkpointer(context);
  CheckpointState state;
  state.step = 1;
  ASSERT_THAT(checkpointer.Start(state, false, nullptr), IsOk());
  double waited = 0;
  TrainOneStep(rank, device, [&] {
    awaiting = true;
    waited = checkpointer.AwaitSnapshot();
  });
  releaser.join();
  if (device.is_cuda()) {
    EXPECT_GE(waited, 0.09);
  } else {
    EXPECT_GT(waited, 0.0);
  }
  ASSERT_THAT(checkpointer.Wait(), IsOk());
  // Nothing in flight: no wait.
  EXPECT_EQ(checkpointer.AwaitSnapshot(), 0);

  const std::vector<at::Tensor> after = Values(*rank.engine);
  bool changed = false;
  for (size_t i = 0; i < after.size(); ++i) changed |= !torch::equal(after[i], at_save[i]);
  EXPECT_TRUE(changed) << "the step after the save changed nothing: the test proves nothing";

  // A fresh rank resumed from the checkpoint holds the state of step 1 exactly.
  Rank resumed = BuildRank(device);
  CheckpointContext resume_context;
  resume_context.task = &task;
  resume_context.engine = resumed.engine.get();
  absl::StatusOr<std::optional<Resumed>> loaded = ResumeLatest(resume_context);
  ASSERT_THAT(loaded, IsOk());
  ASSERT_TRUE(loaded->has_value());
  EXPECT_EQ((*loaded)->manifest.step(), 1);
  const std::vector<at::Tensor> restored = Values(*resumed.engine);
  ASSERT_EQ(restored.size(), at_save.size());
  for (size_t i = 0; i < restored.size(); ++i) {
    EXPECT_TRUE(torch::equal(restored[i], at_save[i])) << "range " << i;
  }
}

TEST(AsyncCheckpointerTest, TheOptimizerStepWaitsForTheCopyOnTheCpu) {
  SaveWhileTraining(torch::kCPU);
}

TEST(AsyncCheckpointerTest, TheOptimizerStepWaitsForTheCopyOnTheGpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible";
  SaveWhileTraining(torch::Device(torch::kCUDA, 0));
}

}  // namespace
}  // namespace tessera::trainer

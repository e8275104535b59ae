// The run builder's steps (run_builder.h) on the CPU with tiny models and token shards the test
// writes: one rank without a process group, and threads as ranks over in-process Gloo for the
// parallelisms' steps. Each step is checked for what it must get right on its own: the layout and
// split checks name the field at fault, the defaults are the documented ones, the data step deals
// micro-batches of the spec's shape, the built model holds the resolved summary's parameters, LoRA
// freezes the base, and each rank gets its pipeline stage and tensor split.
#include "trainer/runtime/run_builder.h"

#include <cstdint>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/model_config.h"
#include "planner/training_settings.h"
#include "tests/util/temp_dir.h"
#include "trainer/data/token_shard.h"
#include "trainer/engine/data_parallelism.h"
#include "trainer/model/build_model.h"
#include "trainer/model/model_dims_fixture.h"
#include "trainer/parallel/mesh_threads.h"
#include "trainer/parallel/pipeline_parallelism.h"
#include "trainer/parallel/tensor_parallelism.h"

namespace tessera::trainer {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::IsOkAndHolds;
using ::tessera::testing::StatusIs;
using ::testing::HasSubstr;

constexpr int kSeqLen = 16;
constexpr uint32_t kVocab = 257;

// Every report, in the order sent (the checkpointer's thread may send too).
class CollectingReporter final : public Reporter {
 public:
  absl::Status Send(const v1::TrainerReport& report) override {
    std::lock_guard<std::mutex> lock(mu_);
    reports_.push_back(report);
    return absl::OkStatus();
  }
  std::vector<v1::TrainerReport> reports() {
    std::lock_guard<std::mutex> lock(mu_);
    return reports_;
  }

 private:
  std::mutex mu_;
  std::vector<v1::TrainerReport> reports_;
};

// A shard of `samples` samples of kSeqLen + 1 pseudo-random tokens below `vocab`.
std::string WriteShard(const std::string& dir, int samples, uint32_t vocab = kVocab) {
  std::vector<uint32_t> tokens(static_cast<size_t>(samples) * (kSeqLen + 1));
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = (i * 7919 + 13) % vocab;
  const std::string path = dir + "/train-00000.bin";
  EXPECT_THAT(WriteTokenShard(path, tokens, vocab), IsOk());
  return path;
}

// One rank of tiny-gpt2 on the CPU, 2 steps of 8 samples in micro-batches of 2, its plan
// resolved as the coordinator resolves a submission's.
v1::TrainerTask TinyTask(const std::string& shard) {
  v1::TrainerTask task;
  task.set_job_id("run-builder-test");
  task.mutable_assignment()->set_world_size(1);
  task.mutable_assignment()->set_device_type(v1::DEVICE_TYPE_CPU);
  v1::JobSpec* spec = task.mutable_spec();
  spec->mutable_model()->set_preset("tiny-gpt2");
  spec->mutable_data()->add_train_shards(shard);
  spec->mutable_data()->set_seq_len(kSeqLen);
  spec->mutable_batch()->set_global_batch_size(8);
  spec->mutable_batch()->set_micro_batch_size(2);
  spec->mutable_optimizer()->mutable_schedule()->set_peak_learning_rate(1e-3);
  spec->set_max_steps(2);
  spec->set_seed(7);
  v1::LayoutPlan* plan = task.mutable_plan();
  auto model = planner::ResolveModel(spec->model(), spec->data().seq_len());
  EXPECT_THAT(model, IsOk());
  if (model.ok()) *plan->mutable_model() = *model;
  *plan->mutable_settings() = planner::ResolveTrainingSettings(*spec);
  plan->set_precision(v1::PRECISION_FP32);
  return task;
}

TEST(RunBuilderTest, ValidateLayoutNamesTheFieldAtFault) {
  v1::TrainerTask task = TinyTask("unused");
  EXPECT_THAT(ValidateLayout(task), IsOk());
  v1::Layout* layout = task.mutable_plan()->mutable_layout();
  layout->set_zero_stage(4);
  EXPECT_THAT(ValidateLayout(task), StatusIs(absl::StatusCode::kInvalidArgument,
                                             HasSubstr("parallelism.layout.zero_stage: 4")));
  layout->set_zero_stage(0);
  layout->set_tensor_parallel(3);
  EXPECT_THAT(ValidateLayout(task),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tensor_parallel 3")));
  layout->set_tensor_parallel(1);
  layout->set_sequence_parallel(true);
  EXPECT_THAT(ValidateLayout(task),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("parallelism.layout.sequence_parallel: needs tensor_parallel")));
  layout->set_sequence_parallel(false);
  task.mutable_assignment()->set_world_size(2);
  layout->set_tensor_parallel(2);
  layout->set_zero_stage(3);
  EXPECT_THAT(ValidateLayout(task), StatusIs(absl::StatusCode::kUnimplemented,
                                             HasSubstr("parallelism.layout.zero_stage: 3")));
  layout->set_zero_stage(1);
  auto shape = ValidateLayout(task);
  ASSERT_THAT(shape, IsOk());
  EXPECT_EQ(shape->tp, 2);
  EXPECT_EQ(shape->dp, 1);
}

TEST(RunBuilderTest, ValidateSplitsNamesEachParallelismsField) {
  // 4 attention heads, 2 key/value heads, ffn 96, 2 layers.
  const v1::ModelDims dims = testing::TinyQwenDims(/*ffn_hidden_size=*/96);
  v1::TrainerTask task = TinyTask("unused");
  EXPECT_THAT(ValidateSplits(dims, {.pp = 2, .dp = 1, .tp = 2}, task), IsOk());
  EXPECT_THAT(ValidateSplits(dims, {.tp = 4}, task),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("parallelism.layout.tensor_parallel: 4 does not divide")));
  EXPECT_THAT(ValidateSplits(testing::TinyQwenDims(/*ffn_hidden_size=*/99), {.tp = 2}, task),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tensor_parallel: 2 does not divide the model's ffn_hidden_size 99")));
  EXPECT_THAT(ValidateSplits(dims, {.pp = 3}, task),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("parallelism.layout.pipeline_parallel: 3 does not divide the "
                                 "model's num_layers 2")));
  task.mutable_plan()->mutable_layout()->set_sequence_parallel(true);
  task.mutable_spec()->mutable_data()->set_seq_len(15);
  EXPECT_THAT(ValidateSplits(dims, {.tp = 2}, task),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("parallelism.layout.sequence_parallel: data.seq_len 15")));
}

// The trainer resolves nothing of a spec: a task whose plan lacks the model, the settings or the
// precision (the coordinator's CompletePlan fills them even for plans stored by older
// coordinators) is refused, naming the plan.
TEST(RunBuilderTest, ATaskWithoutAResolvedPlanIsRefused) {
  v1::TrainerTask task = TinyTask("unused");
  task.mutable_plan()->clear_model();
  EXPECT_THAT(ResolveModelSummary(task),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("plan.model")));
  task = TinyTask("unused");
  task.mutable_plan()->clear_settings();
  EXPECT_THAT(ResolveRunSettings(task, /*cuda=*/false),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("plan.settings")));
  task = TinyTask("unused");
  task.mutable_plan()->set_precision(v1::PRECISION_UNSPECIFIED);
  EXPECT_THAT(ResolveRunSettings(task, /*cuda=*/false),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("precision")));
  task.mutable_plan()->set_precision(v1::PRECISION_BF16);
  EXPECT_THAT(ResolveRunSettings(task, /*cuda=*/false),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("precision: BF16")));
}

// A task from the coordinator carries what the spec resolved to at submission (LayoutPlan.model,
// .settings, .precision); the trainer takes it rather than resolving the spec again.
TEST(RunBuilderTest, TheTaskTakesWhatTheCoordinatorResolved) {
  v1::TrainerTask task = TinyTask("unused");
  v1::LayoutPlan& plan = *task.mutable_plan();
  EXPECT_EQ(plan.model().preset(), "tiny-gpt2");
  plan.mutable_model()->set_num_parameters(42);  // marks the plan's copy
  plan.mutable_settings()->set_seed(99);
  plan.mutable_settings()->set_adam_beta2(0.5);
  plan.set_precision(v1::PRECISION_FP32);
  auto model = ResolveModelSummary(task);
  ASSERT_THAT(model, IsOk());
  EXPECT_EQ(model->num_parameters(), 42);
  auto settings = ResolveRunSettings(task, /*cuda=*/true);
  ASSERT_THAT(settings, IsOk());
  EXPECT_EQ(settings->seed, 99u);
  EXPECT_EQ(settings->adamw.beta2, 0.5);
  EXPECT_FALSE(settings->bf16);  // the plan's FP32, though a CUDA device would default to bf16
}

TEST(RunBuilderTest, DataStepDealsMicroBatchesOfTheSpecsShape) {
  ::tessera::testing::ScopedTempDir dir("run-builder");
  v1::TrainerTask task = TinyTask(WriteShard(dir.path(), /*samples=*/40));
  const v1::JobSpec& spec = task.spec();
  auto dataset = OpenTrainingData(spec.data());
  ASSERT_THAT(dataset, IsOk());
  EXPECT_EQ(dataset->num_samples(), 40);
  EXPECT_THAT(CheckVocabulary(*dataset, testing::PresetDims("tiny-gpt2")), IsOk());
  v1::ModelDims small = testing::PresetDims("tiny-gpt2");
  small.set_vocab_size(100);
  EXPECT_THAT(CheckVocabulary(*dataset, small),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("data.train_shards: tokenizer vocabulary 257")));

  CollectingReporter sink;
  const RunReporter reporter(task, sink, nullptr);
  EXPECT_THAT(ResolveMaxSteps(spec, 40, reporter), IsOkAndHolds(2));
  v1::JobSpec epochs = spec;
  epochs.set_epochs(1.5);  // 60 samples at 8 per step
  auto steps = ResolveMaxSteps(epochs, 40, reporter);
  ASSERT_THAT(steps, IsOk());
  EXPECT_EQ(*steps, 8);
  EXPECT_THAT(ResolveMaxSteps(epochs, 0, reporter),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("epochs:")));

  auto validation = OpenValidationData(spec.data());
  ASSERT_THAT(validation, IsOk());
  EXPECT_FALSE(validation->has_value());

  TrainingRun run;
  run.dataset.emplace(*std::move(dataset));
  run.settings.seed = 7;
  v1::DataPosition start;
  auto loader = MakeLoader(spec, run, start);
  ASSERT_THAT(loader, IsOk());
  EXPECT_EQ(loader->accumulation_steps(), 4);
  const std::vector<MicroBatch> batches = loader->NextStep();
  ASSERT_EQ(batches.size(), 4u);
  for (const MicroBatch& mb : batches) {
    EXPECT_EQ(mb.batch_size, 2);
    EXPECT_EQ(mb.seq_len, kSeqLen);
    EXPECT_EQ(mb.inputs.size(), 2u * kSeqLen);
    EXPECT_EQ(mb.targets.size(), 2u * kSeqLen);
  }
}

int64_t CountElements(const std::vector<torch::Tensor>& tensors) {
  int64_t count = 0;
  for (const auto& tensor : tensors) count += tensor.numel();
  return count;
}

TEST(RunBuilderTest, BuildsARunWhoseModelMatchesTheResolvedSummary) {
  for (int zero_stage : {0, 3}) {
    SCOPED_TRACE(zero_stage);
    ::tessera::testing::ScopedTempDir dir("run-builder");
    v1::TrainerTask task = TinyTask(WriteShard(dir.path(), /*samples=*/40));
    task.mutable_plan()->mutable_layout()->set_zero_stage(zero_stage);
    CollectingReporter sink;
    const RunReporter reporter(task, sink, nullptr);
    TrainingRun run;
    v1::FailureKind kind = v1::FAILURE_KIND_UNSPECIFIED;
    ASSERT_THAT(BuildTrainingRun(task, TrainOptions{}, reporter, run, &kind), IsOk());

    const v1::ModelDims& dims = run.summary.dims();
    EXPECT_EQ(run.summary.num_parameters(), 132928);
    EXPECT_EQ(CountElements(run.model->parameters()), run.summary.num_parameters());
    EXPECT_EQ(run.model->storage(),
              zero_stage == 3 ? ParameterStorage::kDeferred : ParameterStorage::kInitialized);
    EXPECT_EQ(run.model->num_local_layers(), dims.num_layers());
    const torch::Tensor* embed = run.model->named_parameters().find("embed.weight");
    ASSERT_NE(embed, nullptr);
    EXPECT_EQ(embed->sizes().vec(), (std::vector<int64_t>{dims.vocab_size(), dims.hidden_size()}));
    // One rank holds the whole state: 4 bytes a parameter, no dp padding.
    EXPECT_EQ(run.engine->Memory().parameter_bytes, 4 * run.summary.num_parameters());
    EXPECT_FALSE(run.group.has_value());
    EXPECT_FALSE(run.pipeline.has_value());
    EXPECT_EQ(run.max_steps, 2);
    EXPECT_EQ(run.start_step, 0);
    EXPECT_TRUE(run.resumed_from.empty());
    EXPECT_EQ(run.loader->accumulation_steps(), 4);
    EXPECT_EQ(run.settings.seed, 7u);

    const std::vector<v1::TrainerReport> reports = sink.reports();
    ASSERT_EQ(reports.size(), 1u);
    ASSERT_TRUE(reports[0].has_started());
    EXPECT_EQ(reports[0].started().num_parameters(), 132928);
    EXPECT_EQ(reports[0].started().backend(), "gloo");
    EXPECT_EQ(reports[0].job_id(), "run-builder-test");
  }
}

TEST(RunBuilderTest, LoraFreezesTheBaseAndTrainsOnlyTheAdapters) {
  v1::LoraSpec lora_spec;
  lora_spec.set_rank(4);
  const v1::ModelDims dims = testing::PresetDims("tiny-gpt2");
  ModelBuildOptions options;
  options.dims = dims;
  options.init_std = 0.02;
  options.seed = 7;
  auto lora = planner::ResolveLora(lora_spec, dims);
  ASSERT_THAT(lora, IsOk());
  options.lora = *lora;
  auto built = BuildModel(options);
  ASSERT_THAT(built, IsOk());
  ASSERT_TRUE(built->lora.has_value());
  int64_t trainable = 0, frozen = 0;
  for (const auto& item : built->model->named_parameters()) {
    const torch::Tensor& param = item.value();
    EXPECT_EQ(param.requires_grad(), IsLoraParameter(item.key())) << item.key();
    (param.requires_grad() ? trainable : frozen) += param.numel();
  }
  EXPECT_EQ(trainable, built->lora->parameters_per_layer * dims.num_layers());
  EXPECT_EQ(frozen, 132928);
}

TEST(RunBuilderTest, AFailedStepIsReportedWithItsKind) {
  ::tessera::testing::ScopedTempDir dir("run-builder");
  struct Case {
    std::string name;
    v1::TrainerTask task;
    v1::FailureKind kind;
    std::string message;
  };
  std::vector<Case> cases;
  cases.push_back({"missing shard", TinyTask(dir.path() + "/missing.bin"),
                   v1::FAILURE_KIND_DATA_ERROR, "missing.bin"});
  cases.push_back({"tp 3 of 1 rank", TinyTask(WriteShard(dir.path(), 40)),
                   v1::FAILURE_KIND_INVALID_SPEC, "tensor_parallel 3"});
  cases.back().task.mutable_plan()->mutable_layout()->set_tensor_parallel(3);
  cases.push_back({"no steps", TinyTask(WriteShard(dir.path(), 40)), v1::FAILURE_KIND_INVALID_SPEC,
                   "max_steps"});
  cases.back().task.mutable_spec()->set_max_steps(0);
  for (Case& c : cases) {
    SCOPED_TRACE(c.name);
    CollectingReporter sink;
    auto result = RunTraining(c.task, sink, TrainOptions{});
    ASSERT_FALSE(result.ok());
    EXPECT_THAT(std::string(result.status().message()), HasSubstr(c.message));
    const std::vector<v1::TrainerReport> reports = sink.reports();
    ASSERT_EQ(reports.size(), 1u);
    ASSERT_TRUE(reports[0].has_failure());
    EXPECT_EQ(reports[0].failure().kind(), c.kind);
    EXPECT_THAT(reports[0].failure().message(), HasSubstr(c.message));
  }
}

TEST(RunTrainingTest, TrainsTheBuiltRunAndReportsEveryStep) {
  ::tessera::testing::ScopedTempDir dir("run-builder");
  v1::TrainerTask task = TinyTask(WriteShard(dir.path(), /*samples=*/40));
  CollectingReporter sink;
  auto result = RunTraining(task, sink, TrainOptions{});
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ(result->start_step, 0);
  EXPECT_EQ(result->final_step, 2);
  const std::vector<v1::TrainerReport> reports = sink.reports();
  // Started; per step this rank's RankStepMetrics, then (rank 0) the job's StepMetrics; finished.
  ASSERT_EQ(reports.size(), 6u);
  EXPECT_TRUE(reports[0].has_started());
  for (int step = 1; step <= 2; ++step) {
    const v1::TrainerReport& rank_step = reports[2 * step - 1];
    ASSERT_TRUE(rank_step.has_rank_step());
    EXPECT_EQ(rank_step.rank_step().step(), step);
    EXPECT_GT(rank_step.rank_step().breakdown().forward_seconds(), 0);
    const v1::TrainerReport& metrics = reports[2 * step];
    ASSERT_TRUE(metrics.has_metrics());
    EXPECT_EQ(metrics.metrics().step(), step);
    EXPECT_GT(metrics.metrics().loss(), 0);
  }
  ASSERT_TRUE(reports[5].has_finished());
  EXPECT_EQ(reports[5].finished().final_loss(), result->final_loss);
  EXPECT_EQ(reports[5].finished().final_loss(), reports[4].metrics().loss());
}

// Threads as the ranks of a pp 2 x tp 2 mesh on in-process Gloo: each rank's tensor split and
// pipeline stage follow its mesh coordinates, and the pipeline's schedule is built for it.
TEST(RunBuilderTest, ParallelismsGiveEachRankItsSplitAndStage) {
  const MeshShape shape{.pp = 2, .dp = 1, .tp = 2};
  testing::RunMeshThreads(shape, [&](int rank, const JoinedGroup&, const DeviceMesh& mesh) {
    const TensorParallel tp = TensorParallelOf(mesh, /*sequence_parallel=*/true);
    EXPECT_EQ(tp.size, 2);
    EXPECT_EQ(tp.rank, rank % 2);
    EXPECT_TRUE(tp.sequence_parallel);
    EXPECT_TRUE(tp.group);
    const PipelineStage stage = PipelineStageOf(mesh, /*num_layers=*/6);
    EXPECT_EQ(stage.stage, rank / 2);
    EXPECT_EQ(stage.stages, 2);
    EXPECT_EQ(stage.first_layer, 3 * (rank / 2));
    EXPECT_EQ(stage.num_layers, 3);
    auto schedule = MakePipelineSchedule(mesh, {2, 8, 4}, torch::kCPU);
    ASSERT_TRUE(schedule.has_value());
    EXPECT_EQ(schedule->first(), rank / 2 == 0);
    EXPECT_EQ(schedule->last(), rank / 2 == 1);
  });
}

TEST(RunBuilderTest, OneRankHasNoSplitStageOrSchedule) {
  const DeviceMesh mesh;
  const TensorParallel tp = TensorParallelOf(mesh, /*sequence_parallel=*/true);
  EXPECT_FALSE(tp.enabled());
  EXPECT_FALSE(tp.sequence_parallel);
  const PipelineStage stage = PipelineStageOf(mesh, /*num_layers=*/4);
  EXPECT_TRUE(stage.first() && stage.last());
  EXPECT_EQ(stage.num_layers, 4);
  EXPECT_FALSE(MakePipelineSchedule(mesh, {2, 8, 4}, torch::kCPU).has_value());
}

}  // namespace
}  // namespace tessera::trainer

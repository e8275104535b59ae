// ValidateJobSpec and PlanJob: one table of broken specs, each derived from a valid minimal spec by
// one mutation, checked for the code and the field named in the message; the first problem in
// field order wins; and the provisional plans for explicit and automatic layouts.

#include "coordinator/admission/job_validation.h"

#include <cmath>
#include <functional>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "coordinator/admission/layout_planning.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::coordinator {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::StatusIs;
using ::testing::HasSubstr;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// tiny-gpt2 (2 layers, 4 heads, max_seq_len 256) on 2 CPU slots, global batch 8 of micro 2,
// automatic layout: the smallest spec that can run.
v1::JobSpec MinimalSpec() {
  v1::JobSpec spec;
  spec.set_name("tiny-job");
  spec.mutable_model()->set_preset("tiny-gpt2");
  spec.mutable_data()->add_train_shards("/data/train-*.bin");
  spec.mutable_data()->set_seq_len(64);
  spec.mutable_batch()->set_global_batch_size(8);
  spec.mutable_batch()->set_micro_batch_size(2);
  spec.mutable_parallelism()->mutable_auto_layout();
  spec.mutable_optimizer()->mutable_schedule()->set_peak_learning_rate(1e-3);
  spec.set_max_steps(10);
  spec.mutable_resources()->set_cpu_slots(2);
  return spec;
}

void SetLayout(v1::JobSpec& spec, int dp, int tp, int pp) {
  v1::Layout* layout = spec.mutable_parallelism()->mutable_layout();
  layout->set_data_parallel(dp);
  layout->set_tensor_parallel(tp);
  layout->set_pipeline_parallel(pp);
}

// A 2-layer Llama mixture of `experts` experts, top-2, small enough for CPU slots.
void SetTinyMoe(v1::JobSpec& spec, int experts) {
  v1::ModelDims* dims = spec.mutable_model()->mutable_dims();
  dims->set_architecture(v1::ARCHITECTURE_LLAMA);
  dims->set_num_layers(2);
  dims->set_hidden_size(64);
  dims->set_num_attention_heads(4);
  dims->set_vocab_size(257);
  dims->set_max_seq_len(256);
  dims->set_num_experts(experts);
  dims->set_num_experts_per_token(2);
}

struct BadSpecCase {
  std::string name;  // gtest parameter name: [A-Za-z0-9_]
  std::function<void(v1::JobSpec&)> mutate;
  absl::StatusCode code;
  std::string message;  // substring of the expected message
};

std::ostream& operator<<(std::ostream& os, const BadSpecCase& c) { return os << c.name; }

std::vector<BadSpecCase> BadSpecCases() {
  using S = v1::JobSpec;
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  return {
      // name
      {"NameEmpty", [](S& s) { s.set_name(""); }, kInvalid, "name: must be 1-63 characters, got 0"},
      {"NameTooLong", [](S& s) { s.set_name(std::string(64, 'a')); }, kInvalid,
       "name: must be 1-63 characters, got 64"},
      {"NameStartsWithDigit", [](S& s) { s.set_name("1job"); }, kInvalid,
       "name: '1job' must start with a letter"},
      {"NameUpperCase", [](S& s) { s.set_name("Job"); }, kInvalid,
       "name: 'Job' must start with a letter"},
      {"NameUnderscore", [](S& s) { s.set_name("my_job"); }, kInvalid,
       "name: 'my_job' may hold only a-z, 0-9 and '-'"},
      // model (planner::ResolveModel's messages, passed through)
      {"ModelUnset", [](S& s) { s.clear_model(); }, kInvalid, "model: set one of preset or dims"},
      {"ModelUnknownPreset", [](S& s) { s.mutable_model()->set_preset("gpt5"); }, kInvalid,
       "model.preset: unknown preset 'gpt5'"},
      {"ModelDimsZeroHidden",
       [](S& s) {
         v1::ModelDims* dims = s.mutable_model()->mutable_dims();
         dims->set_architecture(v1::ARCHITECTURE_GPT2);
         dims->set_num_layers(2);
         dims->set_num_attention_heads(4);
         dims->set_vocab_size(257);
         dims->set_max_seq_len(256);
       },
       kInvalid, "model.dims.hidden_size: must be > 0"},
      {"ModelInitStdNaN", [](S& s) { s.mutable_model()->set_init_std(kNaN); }, kInvalid,
       "model.init_std: must be a finite number"},
      // data
      {"DataNoTrainShards", [](S& s) { s.mutable_data()->clear_train_shards(); }, kInvalid,
       "data.train_shards: at least one path or glob is required"},
      {"DataEmptyTrainShard", [](S& s) { s.mutable_data()->add_train_shards(""); }, kInvalid,
       "data.train_shards[1]: must be a non-empty path or glob"},
      {"DataEmptyValidationShard", [](S& s) { s.mutable_data()->add_validation_shards(""); },
       kInvalid, "data.validation_shards[0]: must be a non-empty path or glob"},
      {"DataEvalWithoutValidationShards",
       [](S& s) { s.mutable_data()->set_eval_interval_steps(100); }, kInvalid,
       "data.validation_shards: at least one path or glob is required when "
       "data.eval_interval_steps is 100"},
      {"DataSeqLenZero", [](S& s) { s.mutable_data()->set_seq_len(0); }, kInvalid,
       "data.seq_len: must be > 0, got 0"},
      {"DataSeqLenBeyondModel", [](S& s) { s.mutable_data()->set_seq_len(512); }, kInvalid,
       "data.seq_len: 512 exceeds model max_seq_len 256"},
      {"DataNegativeEvalInterval", [](S& s) { s.mutable_data()->set_eval_interval_steps(-1); },
       kInvalid, "data.eval_interval_steps: must be >= 0, got -1"},
      {"DataNegativeEvalBatches", [](S& s) { s.mutable_data()->set_eval_batches(-1); }, kInvalid,
       "data.eval_batches: must be >= 0, got -1"},
      // batch
      {"BatchGlobalZero", [](S& s) { s.mutable_batch()->set_global_batch_size(0); }, kInvalid,
       "batch.global_batch_size: must be > 0, got 0"},
      {"BatchMicroZero", [](S& s) { s.mutable_batch()->set_micro_batch_size(0); }, kInvalid,
       "batch.micro_batch_size: must be > 0, got 0"},
      {"BatchNotDivisibleAuto", [](S& s) { s.mutable_batch()->set_global_batch_size(10); },
       kInvalid,
       "batch.global_batch_size: 10 is not divisible by micro_batch_size 2 x data_parallel 2 "
       "(= 4)"},
      {"BatchNotDivisibleExplicit",
       [](S& s) {
         s.mutable_resources()->set_gpus(8);
         SetLayout(s, 8, 1, 1);
         s.mutable_batch()->set_global_batch_size(100);
         s.mutable_batch()->set_micro_batch_size(4);
       },
       kInvalid,
       "batch.global_batch_size: 100 is not divisible by micro_batch_size 4 x data_parallel 8 "
       "(= 32)"},
      {"BatchAccumulationOverflowsInt32",
       [](S& s) {
         s.mutable_batch()->set_global_batch_size(int64_t{1} << 40);
         s.mutable_batch()->set_micro_batch_size(1);
       },
       kInvalid, "gradient accumulation steps, more than 2147483647"},
      // parallelism.layout
      {"LayoutZeroDataParallel", [](S& s) { SetLayout(s, 0, 1, 1); }, kInvalid,
       "parallelism.layout.data_parallel: must be >= 1 in an explicit layout (0 does not mean a "
       "default"},
      {"LayoutZeroTensorParallel", [](S& s) { SetLayout(s, 2, 0, 1); }, kInvalid,
       "parallelism.layout.tensor_parallel: must be >= 1 in an explicit layout"},
      {"LayoutZeroPipelineParallel", [](S& s) { SetLayout(s, 2, 1, 0); }, kInvalid,
       "parallelism.layout.pipeline_parallel: must be >= 1 in an explicit layout"},
      {"LayoutZeroStageFour",
       [](S& s) {
         SetLayout(s, 2, 1, 1);
         s.mutable_parallelism()->mutable_layout()->set_zero_stage(4);
       },
       kInvalid, "parallelism.layout.zero_stage: must be in 0..3, got 4"},
      {"LayoutWorldMismatchGpus",
       [](S& s) {
         s.mutable_resources()->set_gpus(8);
         SetLayout(s, 2, 2, 1);
       },
       kInvalid,
       "parallelism.layout: data_parallel 2 x tensor_parallel 2 x pipeline_parallel 1 = 4 != "
       "resources.gpus 8"},
      {"LayoutWorldMismatchCpuSlots", [](S& s) { SetLayout(s, 1, 1, 1); }, kInvalid,
       "parallelism.layout: data_parallel 1 x tensor_parallel 1 x pipeline_parallel 1 = 1 != "
       "resources.cpu_slots 2"},
      {"LayoutTensorParallelVsHeads",
       [](S& s) {
         s.mutable_resources()->set_cpu_slots(3);
         SetLayout(s, 1, 3, 1);
       },
       kInvalid,
       "parallelism.layout.tensor_parallel: 3 does not divide the model's num_attention_heads 4"},
      {"LayoutTensorParallelVsKvHeads",
       [](S& s) {
         s.mutable_model()->set_preset("tiny-llama");  // 4 heads, 2 kv heads
         s.mutable_resources()->set_cpu_slots(4);
         SetLayout(s, 1, 4, 1);
       },
       kInvalid,
       "parallelism.layout.tensor_parallel: 4 does not divide the model's num_kv_heads 2"},
      {"LayoutTensorParallelVsFfn",
       [](S& s) {
         v1::ModelDims* dims = s.mutable_model()->mutable_dims();
         dims->set_architecture(v1::ARCHITECTURE_GPT2);
         dims->set_num_layers(2);
         dims->set_hidden_size(64);
         dims->set_num_attention_heads(4);
         dims->set_ffn_hidden_size(250);  // column-parallel MLP: split over tp 2, not 4
         dims->set_vocab_size(257);
         dims->set_max_seq_len(256);
         s.mutable_resources()->set_cpu_slots(4);
         SetLayout(s, 1, 4, 1);
       },
       kInvalid,
       "parallelism.layout.tensor_parallel: 4 does not divide the model's ffn_hidden_size 250"},
      {"MoeTopKAboveExperts",
       [](S& s) {
         v1::ModelDims* dims = s.mutable_model()->mutable_dims();
         dims->set_architecture(v1::ARCHITECTURE_LLAMA);
         dims->set_num_layers(2);
         dims->set_hidden_size(64);
         dims->set_num_attention_heads(4);
         dims->set_vocab_size(257);
         dims->set_max_seq_len(256);
         dims->set_num_experts(4);
         dims->set_num_experts_per_token(5);
       },
       kInvalid, "model.dims.num_experts_per_token: must be in [1, num_experts 4], got 5"},
      {"MoeWithTensorParallel",
       [](S& s) {
         v1::ModelDims* dims = s.mutable_model()->mutable_dims();
         dims->set_architecture(v1::ARCHITECTURE_LLAMA);
         dims->set_num_layers(2);
         dims->set_hidden_size(64);
         dims->set_num_attention_heads(4);
         dims->set_vocab_size(257);
         dims->set_max_seq_len(256);
         dims->set_num_experts(4);
         dims->set_num_experts_per_token(2);
         dims->set_moe_intermediate_size(33);
         SetLayout(s, 1, 2, 1);
       },
       kInvalid,
       "parallelism.layout.tensor_parallel: 2 does not divide the model's moe_intermediate_size "
       "33"},
      {"LayoutPipelineParallelVsLayers",
       [](S& s) {
         s.mutable_resources()->set_cpu_slots(3);
         SetLayout(s, 1, 1, 3);
       },
       kInvalid,
       "parallelism.layout.pipeline_parallel: 3 does not divide the model's num_layers 2"},
      // Context, expert and interleaved pipeline parallelism (planner::CheckSplitRules).
      {"LayoutNegativeContextParallel",
       [](S& s) {
         SetLayout(s, 2, 1, 1);
         s.mutable_parallelism()->mutable_layout()->set_context_parallel(-1);
       },
       kInvalid, "parallelism.layout.context_parallel: must be >= 0 (0 means 1), got -1"},
      {"LayoutNegativeExpertParallel",
       [](S& s) {
         SetLayout(s, 2, 1, 1);
         s.mutable_parallelism()->mutable_layout()->set_expert_parallel(-2);
       },
       kInvalid, "parallelism.layout.expert_parallel: must be >= 0 (0 means 1), got -2"},
      {"LayoutNegativeVirtualStages",
       [](S& s) {
         SetLayout(s, 2, 1, 1);
         s.mutable_parallelism()->mutable_layout()->set_pipeline_virtual_stages(-1);
       },
       kInvalid, "parallelism.layout.pipeline_virtual_stages: must be >= 0 (0 means 1), got -1"},
      {"LayoutWorldCountsContextParallel",
       [](S& s) {
         // dp 2 x cp 2 is 4 ranks, not the 2 slots asked for.
         SetLayout(s, 2, 1, 1);
         s.mutable_parallelism()->mutable_layout()->set_context_parallel(2);
       },
       kInvalid,
       "parallelism.layout: data_parallel 2 x tensor_parallel 1 x pipeline_parallel 1 x "
       "context_parallel 2 = 4 != resources.cpu_slots 2"},
      {"LayoutContextParallelVsSeqLen",
       [](S& s) {
         // seq_len 60 splits into 4 chunks (cp 2) but not 8 (cp 4).
         s.mutable_data()->set_seq_len(60);
         s.mutable_batch()->set_global_batch_size(2);
         s.mutable_batch()->set_micro_batch_size(1);
         s.mutable_resources()->set_cpu_slots(4);
         SetLayout(s, 1, 1, 1);
         s.mutable_parallelism()->mutable_layout()->set_context_parallel(4);
       },
       kInvalid,
       "parallelism.layout.context_parallel: 4: 2 x context_parallel (8) does not divide "
       "data.seq_len 60"},
      // The trainer does not run context parallelism on a mixture of experts: refused here, at
      // the door, not by the trainer once the job is placed.
      {"LayoutContextParallelOnMixtureOfExperts",
       [](S& s) {
         SetTinyMoe(s, /*experts=*/4);
         s.mutable_resources()->set_cpu_slots(2);
         SetLayout(s, 1, 1, 1);
         s.mutable_parallelism()->mutable_layout()->set_context_parallel(2);
       },
       kInvalid,
       "parallelism.layout.context_parallel: 2 with a mixture-of-experts model (4 experts) is not "
       "supported"},
      // Sequence parallelism splits each sequence over tp, with or without context parallelism.
      {"LayoutSequenceParallelVsSeqLen",
       [](S& s) {
         s.mutable_model()->set_preset("tiny-llama");  // 4 heads, 2 kv heads
         s.mutable_data()->set_seq_len(63);
         SetLayout(s, 1, 2, 1);
         s.mutable_parallelism()->mutable_layout()->set_sequence_parallel(true);
       },
       kInvalid,
       "parallelism.layout.sequence_parallel: data.seq_len 63 is not divisible by "
       "tensor_parallel 2"},
      {"LayoutExpertParallelOnDenseModel",
       [](S& s) {
         SetLayout(s, 2, 1, 1);
         s.mutable_parallelism()->mutable_layout()->set_expert_parallel(2);
       },
       kInvalid,
       "parallelism.layout.expert_parallel: 2 with a dense model (num_experts 0): expert "
       "parallelism splits a mixture of experts; use 1"},
      {"LayoutExpertParallelVsExperts",
       [](S& s) {
         SetTinyMoe(s, /*experts=*/6);
         s.mutable_resources()->set_cpu_slots(4);
         SetLayout(s, 4, 1, 1);
         s.mutable_parallelism()->mutable_layout()->set_expert_parallel(4);
       },
       kInvalid, "parallelism.layout.expert_parallel: 4 does not divide the model's num_experts 6"},
      {"LayoutExpertParallelVsDataParallel",
       [](S& s) {
         SetTinyMoe(s, /*experts=*/8);
         s.mutable_resources()->set_cpu_slots(2);
         SetLayout(s, 2, 1, 1);
         s.mutable_parallelism()->mutable_layout()->set_expert_parallel(4);
       },
       kInvalid,
       "parallelism.layout.expert_parallel: 4 does not divide data_parallel 2 (experts are "
       "split inside the data-parallel group)"},
      {"LayoutVirtualStagesWithoutPipeline",
       [](S& s) {
         SetLayout(s, 2, 1, 1);
         s.mutable_parallelism()->mutable_layout()->set_pipeline_virtual_stages(2);
       },
       kInvalid,
       "parallelism.layout.pipeline_virtual_stages: 2 needs pipeline_parallel > 1, got "
       "pipeline_parallel 1"},
      {"LayoutVirtualStagesVsLayersPerStage",
       [](S& s) {
         // tiny-gpt2's 2 layers over 2 stages leave one layer per stage: nothing to interleave.
         SetLayout(s, 1, 1, 2);
         s.mutable_parallelism()->mutable_layout()->set_pipeline_virtual_stages(2);
       },
       kInvalid,
       "parallelism.layout.pipeline_virtual_stages: 2 does not divide the 1 layers of each "
       "pipeline stage (num_layers 2 / pipeline_parallel 2)"},
      {"LayoutVirtualStagesVsMicroBatches",
       [](S& s) {
         // 4 layers over pp 2 in v 2 chunks, but a global batch of 8 in micro-batches of 8 is
         // one micro-batch per step, not a multiple of pp 2.
         SetTinyMoe(s, /*experts=*/4);
         s.mutable_model()->mutable_dims()->clear_num_experts();
         s.mutable_model()->mutable_dims()->clear_num_experts_per_token();
         s.mutable_model()->mutable_dims()->set_num_layers(4);
         s.mutable_batch()->set_micro_batch_size(8);
         SetLayout(s, 1, 1, 2);
         s.mutable_parallelism()->mutable_layout()->set_pipeline_virtual_stages(2);
       },
       kInvalid,
       "parallelism.layout.pipeline_virtual_stages: 2 needs the micro-batches per step (1 = "
       "global batch / (micro-batch x data_parallel)) to be a multiple of pipeline_parallel 2"},
      {"LayoutSequenceParallelWithoutTensorParallel",
       [](S& s) {
         SetLayout(s, 2, 1, 1);
         s.mutable_parallelism()->mutable_layout()->set_sequence_parallel(true);
       },
       kInvalid, "parallelism.layout.sequence_parallel: needs tensor_parallel > 1"},
      // parallelism.auto_layout
      {"AutoNegativeMaxTensorParallel",
       [](S& s) { s.mutable_parallelism()->mutable_auto_layout()->set_max_tensor_parallel(-1); },
       kInvalid, "parallelism.auto_layout.max_tensor_parallel: must be >= 0, got -1"},
      {"AutoNegativeMaxPipelineParallel",
       [](S& s) { s.mutable_parallelism()->mutable_auto_layout()->set_max_pipeline_parallel(-2); },
       kInvalid, "parallelism.auto_layout.max_pipeline_parallel: must be >= 0, got -2"},
      {"AutoMaxZeroStageFour",
       [](S& s) { s.mutable_parallelism()->mutable_auto_layout()->set_max_zero_stage(4); },
       kInvalid, "parallelism.auto_layout.max_zero_stage: must be in 0..3, got 4"},
      {"AutoHeadroomAboveOne",
       [](S& s) {
         s.mutable_parallelism()->mutable_auto_layout()->set_memory_headroom_fraction(1.5);
       },
       kInvalid, "parallelism.auto_layout.memory_headroom_fraction: must be in [0, 1]"},
      {"AutoHeadroomNaN",
       [](S& s) {
         s.mutable_parallelism()->mutable_auto_layout()->set_memory_headroom_fraction(kNaN);
       },
       kInvalid, "parallelism.auto_layout.memory_headroom_fraction: must be a finite number"},
      {"AutoLayoutNegativeMaxContextParallel",
       [](S& s) { s.mutable_parallelism()->mutable_auto_layout()->set_max_context_parallel(-1); },
       kInvalid, "parallelism.auto_layout.max_context_parallel: must be >= 0, got -1"},
      {"AutoLayoutNegativeMaxExpertParallel",
       [](S& s) { s.mutable_parallelism()->mutable_auto_layout()->set_max_expert_parallel(-1); },
       kInvalid, "parallelism.auto_layout.max_expert_parallel: must be >= 0, got -1"},
      {"AutoLayoutNegativeMaxVirtualStages",
       [](S& s) {
         s.mutable_parallelism()->mutable_auto_layout()->set_max_pipeline_virtual_stages(-4);
       },
       kInvalid, "parallelism.auto_layout.max_pipeline_virtual_stages: must be >= 0, got -4"},
      // optimizer
      {"ScheduleNoPeak", [](S& s) { s.mutable_optimizer()->clear_schedule(); }, kInvalid,
       "optimizer.schedule.peak_learning_rate: must be > 0"},
      {"ScheduleMinLrRatioNaN",
       [](S& s) { s.mutable_optimizer()->mutable_schedule()->set_min_lr_ratio(kNaN); }, kInvalid,
       "optimizer.schedule.min_lr_ratio: must be a finite number"},
      {"ScheduleMinLrRatioAboveOne",
       [](S& s) { s.mutable_optimizer()->mutable_schedule()->set_min_lr_ratio(2); }, kInvalid,
       "optimizer.schedule.min_lr_ratio: must be in [0, 1], got 2"},
      {"WeightDecayNegative", [](S& s) { s.mutable_optimizer()->set_weight_decay(-0.1); }, kInvalid,
       "optimizer.weight_decay: must be >= 0, got -0.1"},
      {"WeightDecayInfinite", [](S& s) { s.mutable_optimizer()->set_weight_decay(kInf); }, kInvalid,
       "optimizer.weight_decay: must be a finite number, got inf"},
      {"Beta1One", [](S& s) { s.mutable_optimizer()->set_beta1(1.0); }, kInvalid,
       "optimizer.beta1: must be in [0, 1), got 1"},
      {"Beta2NaN", [](S& s) { s.mutable_optimizer()->set_beta2(kNaN); }, kInvalid,
       "optimizer.beta2: must be a finite number"},
      {"EpsilonNegative", [](S& s) { s.mutable_optimizer()->set_epsilon(-1e-8); }, kInvalid,
       "optimizer.epsilon: must be >= 0"},
      {"GradClipNormInfinite", [](S& s) { s.mutable_optimizer()->set_grad_clip_norm(-kInf); },
       kInvalid, "optimizer.grad_clip_norm: must be a finite number, got -inf"},
      // precision
      {"Bf16OnCpuSlots", [](S& s) { s.set_precision(v1::PRECISION_BF16); }, kInvalid,
       "precision: PRECISION_BF16 is CUDA only and needs resources.gpus > 0, got gpus 0"},
      {"PrecisionUnknownValue", [](S& s) { s.set_precision(static_cast<v1::Precision>(7)); },
       kInvalid, "precision: unknown value 7"},
      // max_steps, checkpoint
      {"MaxStepsZero", [](S& s) { s.set_max_steps(0); }, kInvalid, "max_steps: must be > 0, got 0"},
      {"CheckpointNegativeInterval", [](S& s) { s.mutable_checkpoint()->set_interval_steps(-5); },
       kInvalid, "checkpoint.interval_steps: must be >= 0, got -5"},
      {"CheckpointNegativeKeepLast", [](S& s) { s.mutable_checkpoint()->set_keep_last(-1); },
       kInvalid, "checkpoint.keep_last: must be >= 0, got -1"},
      // resources
      {"ResourcesNegativeGpus", [](S& s) { s.mutable_resources()->set_gpus(-1); }, kInvalid,
       "resources.gpus: must be >= 0, got -1"},
      {"ResourcesNegativeCpuSlots", [](S& s) { s.mutable_resources()->set_cpu_slots(-2); },
       kInvalid, "resources.cpu_slots: must be >= 0, got -2"},
      {"ResourcesNothingRequested", [](S& s) { s.mutable_resources()->clear_cpu_slots(); },
       kInvalid, "resources: request gpus or cpu_slots"},
      // priority, max_restarts, labels
      {"PriorityTooHigh", [](S& s) { s.set_priority(1001); }, kInvalid,
       "priority: must be in [-1000, 1000], got 1001"},
      {"PriorityTooLow", [](S& s) { s.set_priority(-1001); }, kInvalid,
       "priority: must be in [-1000, 1000], got -1001"},
      {"MaxRestartsNegative", [](S& s) { s.set_max_restarts(-1); }, kInvalid,
       "max_restarts: must be >= 0, got -1"},
      {"LabelEmptyKey", [](S& s) { (*s.mutable_labels())[""] = "x"; }, kInvalid,
       "labels: key '' must be 1-63 characters, got 0"},
      {"LabelKeyTooLong", [](S& s) { (*s.mutable_labels())[std::string(64, 'k')] = "x"; }, kInvalid,
       "must be 1-63 characters, got 64"},
      {"LabelKeyBadCharacter", [](S& s) { (*s.mutable_labels())["team/ml"] = "x"; }, kInvalid,
       "labels: key 'team/ml' may hold only a-z, A-Z, 0-9, '.', '_' and '-'"},
      {"LabelEmptyValue", [](S& s) { (*s.mutable_labels())["team"] = ""; }, kInvalid,
       "labels[team]: value must be 1-63 characters, got 0"},
      // Size bounds: one submission cannot make the coordinator hold unbounded text.
      {"TooManyLabels",
       [](S& s) {
         for (int i = 0; i < 65; ++i) (*s.mutable_labels())[absl::StrCat("k", i)] = "v";
       },
       kInvalid, "labels: at most 64, got 65"},
      {"TooManyShardPatterns",
       [](S& s) {
         for (int i = 0; i < 4096; ++i) s.mutable_data()->add_train_shards("/d/x.bin");
       },
       kInvalid, "data.train_shards: at most 4096 paths or globs"},
      {"ShardPathTooLong",
       [](S& s) { s.mutable_data()->add_validation_shards(std::string(4097, 'p')); }, kInvalid,
       "data.validation_shards[0]: longer than 4096 characters"},
      {"SpecTooLarge",
       [](S& s) {
         for (int i = 0; i < 100; ++i) s.mutable_data()->add_train_shards(std::string(4000, 'p'));
       },
       kInvalid, "spec: 4"},
      // The first problem in field order is the one reported.
      {"FirstProblemNameBeforeBatch",
       [](S& s) {
         s.set_name("");
         s.mutable_batch()->set_global_batch_size(0);
       },
       kInvalid, "name:"},
      {"FirstProblemBatchBeforeResources",
       [](S& s) {
         s.mutable_resources()->clear_cpu_slots();
         s.mutable_batch()->set_micro_batch_size(0);
       },
       kInvalid, "batch.micro_batch_size:"},
      {"FirstProblemModelBeforeSeqLen",
       [](S& s) {
         s.mutable_model()->set_preset("gpt5");
         s.mutable_data()->set_seq_len(0);
       },
       kInvalid, "model.preset:"},
      {"FirstProblemTrainShardsBeforeSeqLen",
       [](S& s) {
         s.mutable_data()->clear_train_shards();
         s.mutable_data()->set_seq_len(-1);
       },
       kInvalid, "data.train_shards:"},
      {"FirstProblemPeakBeforeMinLrRatioNaN",
       [](S& s) {
         s.mutable_optimizer()->mutable_schedule()->set_peak_learning_rate(0);
         s.mutable_optimizer()->mutable_schedule()->set_min_lr_ratio(kNaN);
       },
       kInvalid, "optimizer.schedule.peak_learning_rate:"},
      {"FirstProblemOptimizerBeforeMaxSteps",
       [](S& s) {
         s.set_max_steps(0);
         s.mutable_optimizer()->set_beta1(2);
       },
       kInvalid, "optimizer.beta1:"},
      // placement (whether the cluster has the level is the coordinator's check)
      {"PlacementBoth",
       [](S& s) {
         s.mutable_placement()->set_required("rack");
         s.mutable_placement()->set_preferred("block");
       },
       kInvalid, "placement: set required or preferred, not both"},
      {"PlacementBadLevelName", [](S& s) { s.mutable_placement()->set_preferred("Rack 1"); },
       kInvalid, "placement.preferred: 'Rack 1' is not a topology level name"},
      {"FirstProblemLayoutBeforeResourcesWhenWorldUnknown",
       [](S& s) {
         s.mutable_resources()->clear_cpu_slots();
         SetLayout(s, 1, 3, 1);
       },
       kInvalid, "parallelism.layout.tensor_parallel: 3 does not divide"},
  };
}

class JobValidationBadSpecTest : public ::testing::TestWithParam<BadSpecCase> {};

TEST_P(JobValidationBadSpecTest, RefusedWithFieldAndRuleInMessage) {
  const BadSpecCase& c = GetParam();
  v1::JobSpec spec = MinimalSpec();
  c.mutate(spec);
  const absl::Status status = ValidateJobSpec(spec);
  EXPECT_THAT(status, StatusIs(c.code, HasSubstr(c.message)));
  // PlanJob admits exactly what ValidateJobSpec admits.
  EXPECT_EQ(PlanJob(spec).status(), status);
}

INSTANTIATE_TEST_SUITE_P(Table, JobValidationBadSpecTest, ::testing::ValuesIn(BadSpecCases()),
                         [](const ::testing::TestParamInfo<BadSpecCase>& info) {
                           return info.param.name;
                         });

TEST(JobValidationTest, MinimalSpecIsValid) { EXPECT_THAT(ValidateJobSpec(MinimalSpec()), IsOk()); }

TEST(JobValidationTest, FullExplicitGpuSpecIsValid) {
  v1::JobSpec spec = MinimalSpec();
  spec.mutable_model()->set_preset("tiny-llama");
  spec.mutable_data()->add_validation_shards("/data/val.bin");
  spec.mutable_data()->set_eval_interval_steps(50);
  spec.mutable_data()->set_eval_batches(4);
  spec.mutable_resources()->set_gpus(8);
  SetLayout(spec, 2, 2, 2);
  spec.mutable_parallelism()->mutable_layout()->set_zero_stage(3);
  spec.mutable_parallelism()->mutable_layout()->set_sequence_parallel(true);
  spec.mutable_batch()->set_global_batch_size(64);
  spec.set_precision(v1::PRECISION_BF16);
  spec.mutable_optimizer()->set_beta1(0.9);
  spec.mutable_optimizer()->set_beta2(0.999);
  spec.mutable_optimizer()->set_grad_clip_norm(1.0);
  spec.mutable_optimizer()->mutable_schedule()->set_min_lr_ratio(0.1);
  spec.set_priority(-1000);
  (*spec.mutable_labels())["team.ml_infra-2"] = "any value: spaces/slashes ok";
  EXPECT_THAT(ValidateJobSpec(spec), IsOk());
}

TEST(JobValidationTest, ContextAndExpertParallelLayoutsAreValid) {
  // A mixture of experts at dp 2: its 4 experts split over ep 2 of the 2 data-parallel ranks.
  v1::JobSpec spec = MinimalSpec();
  SetTinyMoe(spec, /*experts=*/4);
  spec.mutable_resources()->set_cpu_slots(2);
  SetLayout(spec, 2, 1, 1);
  spec.mutable_parallelism()->mutable_layout()->set_expert_parallel(2);
  ASSERT_THAT(ValidateJobSpec(spec), IsOk());
  absl::StatusOr<v1::LayoutPlan> plan = PlanJob(spec);
  ASSERT_THAT(plan.status(), IsOk());
  EXPECT_EQ(plan->world_size(), 2);
  EXPECT_EQ(plan->layout().expert_parallel(), 2);
  EXPECT_THAT(plan->explanation(), HasSubstr("expert_parallel 2"));
  // The dense model at dp 2 x cp 2 = 4 slots (a mixture of experts under cp is refused:
  // LayoutContextParallelOnMixtureOfExperts above).
  spec.mutable_model()->mutable_dims()->clear_num_experts();
  spec.mutable_model()->mutable_dims()->clear_num_experts_per_token();
  spec.mutable_resources()->set_cpu_slots(4);
  v1::Layout* layout = spec.mutable_parallelism()->mutable_layout();
  layout->set_expert_parallel(0);
  layout->set_context_parallel(2);
  ASSERT_THAT(ValidateJobSpec(spec), IsOk());
  plan = PlanJob(spec);
  ASSERT_THAT(plan.status(), IsOk());
  EXPECT_EQ(plan->world_size(), 4);
  EXPECT_EQ(plan->layout().context_parallel(), 2);
  // Accumulation is over the data-parallel ranks only: 8 / (2 x 2).
  EXPECT_EQ(plan->gradient_accumulation_steps(), 2);
  EXPECT_THAT(plan->explanation(), HasSubstr("pipeline_parallel 1 x context_parallel 2"));
}

TEST(JobValidationTest, InterleavedPipelineWithContextParallelIsValid) {
  // pp 2 x cp 2 = 4 slots; each stage's 2 layers run as v 2 chunks of one.
  v1::JobSpec spec = MinimalSpec();
  SetTinyMoe(spec, /*experts=*/4);
  spec.mutable_model()->mutable_dims()->clear_num_experts();
  spec.mutable_model()->mutable_dims()->clear_num_experts_per_token();
  spec.mutable_model()->mutable_dims()->set_num_layers(4);
  spec.mutable_resources()->set_cpu_slots(4);
  SetLayout(spec, 1, 1, 2);
  v1::Layout* layout = spec.mutable_parallelism()->mutable_layout();
  layout->set_context_parallel(2);
  layout->set_pipeline_virtual_stages(2);
  ASSERT_THAT(ValidateJobSpec(spec), IsOk());
  const absl::StatusOr<v1::LayoutPlan> plan = PlanJob(spec);
  ASSERT_THAT(plan.status(), IsOk());
  EXPECT_EQ(plan->world_size(), 4);
  EXPECT_EQ(plan->layout().pipeline_virtual_stages(), 2);
  EXPECT_THAT(plan->explanation(), HasSubstr("pipeline_virtual_stages 2"));
  // Three layers per stage cannot be cut into two chunks.
  spec.mutable_model()->mutable_dims()->set_num_layers(6);
  EXPECT_THAT(ValidateJobSpec(spec),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("parallelism.layout.pipeline_virtual_stages: 2 does not divide "
                                 "the 3 layers of each pipeline stage")));
}

TEST(JobValidationTest, TrainerRunsModelParallelismWithZeroAtMostOne) {
  v1::JobSpec spec = MinimalSpec();
  // An automatic layout is chosen among what the trainer runs at scheduling time.
  EXPECT_THAT(ValidateTrainerRuns(spec), IsOk());
  spec.mutable_resources()->set_gpus(8);
  SetLayout(spec, 8, 1, 1);
  spec.mutable_batch()->set_global_batch_size(16);
  for (int zero = 0; zero <= kMaxZeroStage; ++zero) {
    spec.mutable_parallelism()->mutable_layout()->set_zero_stage(zero);
    spec.mutable_parallelism()->mutable_layout()->set_activation_checkpointing_mode(
        v1::ACTIVATION_CHECKPOINTING_FULL);
    EXPECT_THAT(ValidateJobSpec(spec), IsOk()) << zero;
    EXPECT_THAT(ValidateTrainerRuns(spec), IsOk()) << zero;
  }
  // ZeRO over a single data-parallel rank is valid (it shards over that rank).
  SetLayout(spec, 1, 1, 1);
  spec.mutable_resources()->set_gpus(1);
  EXPECT_THAT(ValidateJobSpec(spec), IsOk());
  EXPECT_THAT(ValidateTrainerRuns(spec), IsOk());
  // Tensor (with or without sequence parallelism) and pipeline parallelism run with ZeRO 0 or 1,
  // under any recomputation mode.
  spec.mutable_resources()->set_gpus(8);
  spec.mutable_model()->set_preset("tiny-llama");  // 4 heads, 2 kv heads, 2 layers
  struct Shape {
    int dp, tp, pp;
    bool sp;
  };
  const Shape shapes[] = {{4, 2, 1, false}, {4, 2, 1, true}, {4, 1, 2, false}, {2, 2, 2, true}};
  for (const Shape& shape : shapes) {
    SetLayout(spec, shape.dp, shape.tp, shape.pp);
    v1::Layout* layout = spec.mutable_parallelism()->mutable_layout();
    layout->set_sequence_parallel(shape.sp);
    for (auto ac : {v1::ACTIVATION_CHECKPOINTING_NONE, v1::ACTIVATION_CHECKPOINTING_SELECTIVE,
                    v1::ACTIVATION_CHECKPOINTING_FULL}) {
      layout->set_activation_checkpointing_mode(ac);
      for (int zero = 0; zero <= 1; ++zero) {
        layout->set_zero_stage(zero);
        EXPECT_THAT(ValidateJobSpec(spec), IsOk()) << layout->ShortDebugString();
        EXPECT_THAT(ValidateTrainerRuns(spec), IsOk()) << layout->ShortDebugString();
      }
      // ZeRO 2 and 3 are well formed next to them, but the trainer does not run them.
      for (int zero = 2; zero <= kMaxZeroStage; ++zero) {
        layout->set_zero_stage(zero);
        EXPECT_THAT(ValidateJobSpec(spec), IsOk()) << layout->ShortDebugString();
        EXPECT_THAT(
            ValidateTrainerRuns(spec),
            StatusIs(absl::StatusCode::kUnimplemented,
                     HasSubstr(absl::StrCat("parallelism.layout.zero_stage: ", zero, " with "))))
            << layout->ShortDebugString();
      }
    }
  }
  SetLayout(spec, 4, 2, 1);
  spec.mutable_parallelism()->mutable_layout()->set_sequence_parallel(false);
  spec.mutable_parallelism()->mutable_layout()->set_zero_stage(2);
  EXPECT_THAT(ValidateTrainerRuns(spec),
              StatusIs(absl::StatusCode::kUnimplemented,
                       HasSubstr("parallelism.layout.zero_stage: 2 with tensor_parallel 2: this "
                                 "trainer does not run ZeRO 2 together with tensor or pipeline "
                                 "parallelism")));
  EXPECT_THAT(ValidateTrainerRuns(spec),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("set zero_stage to 1")));
  SetLayout(spec, 4, 1, 2);
  spec.mutable_parallelism()->mutable_layout()->set_zero_stage(3);
  EXPECT_THAT(ValidateTrainerRuns(spec),
              StatusIs(absl::StatusCode::kUnimplemented,
                       HasSubstr("parallelism.layout.zero_stage: 3 with pipeline_parallel 2: ")));
  SetLayout(spec, 2, 2, 2);
  EXPECT_THAT(ValidateTrainerRuns(spec),
              StatusIs(absl::StatusCode::kUnimplemented,
                       HasSubstr("parallelism.layout.zero_stage: 3 with tensor_parallel 2 and "
                                 "pipeline_parallel 2: ")));
}

TEST(JobValidationTest, EpochsReplaceMaxSteps) {
  v1::JobSpec spec = MinimalSpec();
  spec.set_epochs(3);
  EXPECT_THAT(ValidateJobSpec(spec),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("epochs: set max_steps (")));
  spec.set_max_steps(0);
  EXPECT_THAT(ValidateJobSpec(spec), IsOk());
  // The schedule's step counts are the trainer's to check against the steps the epochs make.
  spec.mutable_optimizer()->mutable_schedule()->set_warmup_steps(1000000);
  EXPECT_THAT(ValidateJobSpec(spec), IsOk());
  spec.set_epochs(-1);
  EXPECT_THAT(ValidateJobSpec(spec), StatusIs(absl::StatusCode::kInvalidArgument,
                                              HasSubstr("epochs: must be > 0, got -1")));
  spec.set_epochs(0);
  EXPECT_THAT(ValidateJobSpec(spec), StatusIs(absl::StatusCode::kInvalidArgument,
                                              HasSubstr("max_steps: must be > 0")));
}

TEST(JobValidationTest, LoraIsCheckedAgainstTheModelAndRunsDataParallelOnly) {
  v1::JobSpec spec = MinimalSpec();
  spec.mutable_model()->set_preset("tiny-llama");
  spec.mutable_lora()->set_rank(8);
  spec.mutable_lora()->add_target_modules("q_proj");
  spec.mutable_lora()->add_target_modules("v_proj");
  EXPECT_THAT(ValidateJobSpec(spec), IsOk());
  ASSERT_THAT(PlanJob(spec), IsOk());
  EXPECT_EQ(PlanJob(spec)->lora_rank(), 8);
  spec.mutable_lora()->add_target_modules("c_fc");
  EXPECT_THAT(ValidateJobSpec(spec),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("lora.target_modules: 'c_fc' is not a linear layer")));
  spec.mutable_lora()->clear_target_modules();
  spec.mutable_lora()->set_rank(0);
  EXPECT_THAT(ValidateJobSpec(spec), StatusIs(absl::StatusCode::kInvalidArgument,
                                              HasSubstr("lora.rank: must be > 0, got 0")));
  spec.mutable_lora()->set_rank(4);
  spec.mutable_resources()->set_gpus(8);
  spec.mutable_batch()->set_global_batch_size(16);
  SetLayout(spec, 4, 2, 1);
  EXPECT_THAT(ValidateJobSpec(spec), IsOk());
  // Adapters split like their base layers under tensor parallelism; no pipeline stages.
  EXPECT_THAT(ValidateTrainerRuns(spec), IsOk());
  SetLayout(spec, 4, 1, 2);
  EXPECT_THAT(ValidateJobSpec(spec), IsOk());
  EXPECT_THAT(ValidateTrainerRuns(spec),
              StatusIs(absl::StatusCode::kUnimplemented,
                       HasSubstr("pipeline_parallel 2, zero_stage 0 with lora")));
  SetLayout(spec, 8, 1, 1);
  spec.mutable_parallelism()->mutable_layout()->set_zero_stage(1);
  EXPECT_THAT(ValidateTrainerRuns(spec), IsOk());
  spec.mutable_parallelism()->mutable_layout()->set_zero_stage(3);
  EXPECT_THAT(ValidateTrainerRuns(spec), StatusIs(absl::StatusCode::kUnimplemented,
                                                  HasSubstr("zero_stage 3 with lora")));
}

TEST(JobValidationTest, RotaryModelsTrainPastTheirMaxSeqLen) {
  v1::JobSpec spec = MinimalSpec();
  spec.mutable_model()->set_preset("tiny-llama");  // max_seq_len 256, rotary positions
  spec.mutable_data()->set_seq_len(1024);
  EXPECT_THAT(ValidateJobSpec(spec), IsOk());
  absl::StatusOr<v1::LayoutPlan> plan = PlanJob(spec);
  ASSERT_THAT(plan, IsOk());
  // The trainer builds its rotary tables from the plan's dims.
  EXPECT_EQ(plan->model().dims().max_seq_len(), 1024);
}

TEST(JobValidationTest, AutoLayoutLimitsAtTheirBoundsAreValid) {
  v1::JobSpec spec = MinimalSpec();
  v1::AutoLayoutSpec* auto_layout = spec.mutable_parallelism()->mutable_auto_layout();
  auto_layout->set_max_zero_stage(0);
  auto_layout->set_memory_headroom_fraction(1.0);
  EXPECT_THAT(ValidateJobSpec(spec), IsOk());
  auto_layout->set_max_zero_stage(3);
  auto_layout->set_memory_headroom_fraction(0.0);
  EXPECT_THAT(ValidateJobSpec(spec), IsOk());
}

TEST(JobValidationTest, UnsetParallelismIsAnAutomaticLayout) {
  v1::JobSpec spec = MinimalSpec();
  spec.clear_parallelism();
  EXPECT_THAT(ValidateJobSpec(spec), IsOk());
}

TEST(JobValidationPlanTest, AutoLayoutIsDataParallelOverEveryCpuSlot) {
  v1::JobSpec spec = MinimalSpec();
  spec.mutable_resources()->set_cpu_slots(4);
  spec.mutable_batch()->set_global_batch_size(24);
  spec.mutable_batch()->set_micro_batch_size(3);
  absl::StatusOr<v1::LayoutPlan> plan = PlanJob(spec);
  ASSERT_THAT(plan, IsOk());
  EXPECT_EQ(plan->world_size(), 4);
  EXPECT_EQ(plan->layout().data_parallel(), 4);
  EXPECT_EQ(plan->layout().tensor_parallel(), 1);
  EXPECT_EQ(plan->layout().pipeline_parallel(), 1);
  EXPECT_EQ(plan->layout().zero_stage(), 0);
  EXPECT_EQ(plan->micro_batch_size(), 3);
  EXPECT_EQ(plan->gradient_accumulation_steps(), 2);  // 24 / (3 x 4)
  EXPECT_TRUE(plan->fits());
  EXPECT_FALSE(plan->has_memory());
  EXPECT_FALSE(plan->has_step_time());
  EXPECT_THAT(plan->explanation(),
              HasSubstr("planner chooses the layout when the job is scheduled"));
  EXPECT_THAT(plan->explanation(), HasSubstr("4 CPU slots"));

  // tiny-gpt2 (d 64, 2 layers, vocab 257, 256 positions, tied), summed by hand:
  // embeddings 257*64 + 256*64 = 32832, per block 49984, final LayerNorm 128.
  const int64_t params = 257 * 64 + 256 * 64 + 2 * 49984 + 128;
  ASSERT_EQ(params, 132928);
  EXPECT_EQ(plan->model().preset(), "tiny-gpt2");
  EXPECT_EQ(plan->model().num_parameters(), 132928);
  // FLOPs per token at the job's seq_len 64, not at the seq_len 1 validation resolves with.
  EXPECT_DOUBLE_EQ(plan->model().flops_per_token(), 6.0 * params + 12.0 * 2 * 64 * 64);
}

// The spec is resolved once, at submission, and the plan records it: the trainer reads the
// model, the defaults and the precision from the plan rather than resolving the spec again.
TEST(JobValidationPlanTest, ThePlanRecordsWhatTheSpecResolvedTo) {
  v1::JobSpec spec = MinimalSpec();
  spec.mutable_optimizer()->set_beta2(0.99);
  absl::StatusOr<ResolvedJob> resolved = ResolveJob(spec);
  ASSERT_THAT(resolved, IsOk());
  EXPECT_EQ(resolved->model.preset(), "tiny-gpt2");
  EXPECT_EQ(resolved->world_size, spec.resources().cpu_slots());
  EXPECT_EQ(resolved->precision, v1::PRECISION_FP32);  // CPU slots, precision unset
  EXPECT_EQ(resolved->settings.seed(), 1234u);
  EXPECT_EQ(resolved->settings.adam_beta1(), 0.9);
  EXPECT_EQ(resolved->settings.adam_beta2(), 0.99);
  EXPECT_EQ(resolved->settings.eval_batches(), 20);

  const v1::LayoutPlan plan = PlanJob(spec, *resolved);
  EXPECT_EQ(plan.model().SerializeAsString(), resolved->model.SerializeAsString());
  EXPECT_EQ(plan.settings().SerializeAsString(), resolved->settings.SerializeAsString());
  EXPECT_EQ(plan.precision(), v1::PRECISION_FP32);
  EXPECT_EQ(plan.world_size(), resolved->world_size);
  EXPECT_FALSE(plan.has_lora());
  spec.mutable_lora()->set_rank(4);
  resolved = ResolveJob(spec);
  ASSERT_THAT(resolved, IsOk());
  ASSERT_TRUE(resolved->lora.has_value());
  EXPECT_EQ(PlanJob(spec, *resolved).lora().rank(), 4);
  EXPECT_EQ(PlanJob(spec, *resolved).lora().alpha(), 8);  // 2 x rank, resolved
  spec.clear_lora();

  // On GPUs an unset precision is bf16.
  spec.mutable_resources()->set_gpus(8);
  spec.mutable_batch()->set_global_batch_size(64);
  resolved = ResolveJob(spec);
  ASSERT_THAT(resolved, IsOk());
  EXPECT_EQ(resolved->precision, v1::PRECISION_BF16);
  EXPECT_EQ(resolved->world_size, 8);

  // A spec ResolveJob refuses is refused with ValidateJobSpec's error.
  spec.mutable_optimizer()->set_beta2(-1);
  EXPECT_EQ(ResolveJob(spec).status(), ValidateJobSpec(spec));
  EXPECT_FALSE(ValidateJobSpec(spec).ok());
}

// A plan stored by an older coordinator (no model, settings or precision) is completed as a
// submission resolves it now; what a plan has is kept.
TEST(JobValidationPlanTest, CompletePlanFillsWhatAnOlderPlanLacks) {
  v1::JobSpec spec = MinimalSpec();
  spec.mutable_optimizer()->set_beta2(0.99);
  absl::StatusOr<ResolvedJob> resolved = ResolveJob(spec);
  ASSERT_THAT(resolved, IsOk());
  const v1::LayoutPlan submitted = PlanJob(spec, *resolved);
  v1::LayoutPlan old = submitted;
  old.clear_model();
  old.clear_settings();
  old.set_precision(v1::PRECISION_UNSPECIFIED);
  const v1::LayoutPlan completed = CompletePlan(spec, old);
  EXPECT_EQ(completed.SerializeAsString(), submitted.SerializeAsString());

  v1::LayoutPlan kept = submitted;
  kept.mutable_settings()->set_seed(99);
  kept.set_precision(v1::PRECISION_BF16);
  kept.mutable_model()->set_num_parameters(42);
  EXPECT_EQ(CompletePlan(spec, kept).SerializeAsString(), kept.SerializeAsString());
}

TEST(JobValidationPlanTest, ExplicitLayoutIsTakenAsGiven) {
  v1::JobSpec spec = MinimalSpec();
  spec.mutable_resources()->set_gpus(8);
  SetLayout(spec, 2, 4, 1);
  spec.mutable_parallelism()->mutable_layout()->set_zero_stage(2);
  spec.mutable_parallelism()->mutable_layout()->set_activation_checkpointing(true);
  spec.mutable_batch()->set_global_batch_size(32);
  spec.mutable_batch()->set_micro_batch_size(2);
  absl::StatusOr<v1::LayoutPlan> plan = PlanJob(spec);
  ASSERT_THAT(plan, IsOk());
  EXPECT_EQ(plan->world_size(), 8);
  EXPECT_EQ(plan->layout().data_parallel(), 2);
  EXPECT_EQ(plan->layout().tensor_parallel(), 4);
  EXPECT_EQ(plan->layout().pipeline_parallel(), 1);
  EXPECT_EQ(plan->layout().zero_stage(), 2);
  EXPECT_TRUE(plan->layout().activation_checkpointing());
  EXPECT_EQ(plan->gradient_accumulation_steps(), 8);  // 32 / (2 x 2): tp ranks share a batch
  EXPECT_EQ(plan->model().num_parameters(), 132928);
  EXPECT_TRUE(plan->fits());
  EXPECT_THAT(plan->explanation(), HasSubstr("Explicit layout"));
  EXPECT_THAT(plan->explanation(), HasSubstr("8 GPUs"));
}

TEST(JobValidationPlanTest, GpusDecideTheWorldSizeOverCpuSlots) {
  v1::JobSpec spec = MinimalSpec();
  spec.mutable_resources()->set_gpus(4);
  spec.mutable_resources()->set_cpu_slots(2);  // ignored when gpus > 0
  spec.mutable_batch()->set_global_batch_size(16);
  absl::StatusOr<v1::LayoutPlan> plan = PlanJob(spec);
  ASSERT_THAT(plan, IsOk());
  EXPECT_EQ(plan->world_size(), 4);
  EXPECT_EQ(plan->layout().data_parallel(), 4);
  EXPECT_EQ(plan->gradient_accumulation_steps(), 2);  // 16 / (2 x 4)

  spec.mutable_resources()->set_gpus(0);
  plan = PlanJob(spec);
  ASSERT_THAT(plan, IsOk());
  EXPECT_EQ(plan->world_size(), 2);
  EXPECT_EQ(plan->layout().data_parallel(), 2);
  EXPECT_EQ(plan->gradient_accumulation_steps(), 4);  // 16 / (2 x 2)
}

TEST(JobValidationPlanTest, LayoutMustMatchGpusNotCpuSlotsWhenBothAreSet) {
  v1::JobSpec spec = MinimalSpec();
  spec.mutable_resources()->set_gpus(4);
  SetLayout(spec, 2, 1, 1);  // matches cpu_slots 2, not gpus 4
  EXPECT_THAT(PlanJob(spec),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("= 2 != resources.gpus 4")));
}

// The final export's fields are checked at submission (planner::CheckExportPolicy), naming them.
TEST(JobValidationTest, HuggingFaceExportIsRefusedForModelsWithoutAnHfForm) {
  v1::JobSpec spec = MinimalSpec();
  spec.mutable_checkpoint()->set_export_format(v1::EXPORT_FORMAT_HF);
  EXPECT_THAT(ValidateJobSpec(spec), IsOk());
  spec.mutable_model()->clear_preset();
  v1::ModelDims* dims = spec.mutable_model()->mutable_dims();
  dims->set_architecture(v1::ARCHITECTURE_LLAMA);
  dims->set_num_layers(2);
  dims->set_hidden_size(64);
  dims->set_num_attention_heads(4);
  dims->set_vocab_size(257);
  dims->set_max_seq_len(256);
  dims->set_num_experts(4);
  dims->set_num_experts_per_token(2);
  dims->set_qk_norm(true);
  dims->set_shared_expert_intermediate_size(32);
  EXPECT_THAT(ValidateJobSpec(spec),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("checkpoint.export_format: EXPORT_FORMAT_HF cannot write")));
  spec = MinimalSpec();
  spec.mutable_checkpoint()->set_export_merged(true);
  EXPECT_THAT(ValidateJobSpec(spec), StatusIs(absl::StatusCode::kInvalidArgument,
                                              HasSubstr("checkpoint.export_merged")));
}

// The loss-spike guard: each bad field is refused by name; a guard with every field at 0 (NaN/Inf
// only, the defaults otherwise) and one with hand-skipped batches are valid.
TEST(JobValidationTest, GuardFieldsAreCheckedByName) {
  struct Case {
    std::function<void(v1::GuardSpec&)> mutate;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](v1::GuardSpec& g) { g.set_loss_spike_factor(1.0); },
       "guard.loss_spike_factor: must be > 1 (or 0: off), got 1"},
      {[](v1::GuardSpec& g) { g.set_loss_spike_factor(-3); }, "guard.loss_spike_factor: must be"},
      {[](v1::GuardSpec& g) { g.set_loss_spike_factor(std::nan("")); },
       "guard.loss_spike_factor: must be a finite number"},
      {[](v1::GuardSpec& g) { g.set_grad_norm_spike_factor(0.5); },
       "guard.grad_norm_spike_factor: must be > 1"},
      {[](v1::GuardSpec& g) { g.set_window(1); }, "guard.window: must be >= 2 (or 0: 20), got 1"},
      {[](v1::GuardSpec& g) { g.set_window(-4); }, "guard.window: must be >= 2"},
      {[](v1::GuardSpec& g) { g.set_max_rollbacks(-1); }, "guard.max_rollbacks: must be >= 0"},
      {[](v1::GuardSpec& g) { g.set_skip_batches(-2); }, "guard.skip_batches: must be >= 0"},
      {[](v1::GuardSpec& g) { g.add_skipped()->set_batches(1); },
       "guard.skipped[0].step: must be > 0, got 0"},
  };
  for (const Case& c : cases) {
    v1::JobSpec spec = MinimalSpec();
    c.mutate(*spec.mutable_guard());
    EXPECT_THAT(ValidateJobSpec(spec),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message)))
        << c.message;
  }
  v1::JobSpec spec = MinimalSpec();
  spec.mutable_guard();
  EXPECT_THAT(ValidateJobSpec(spec), IsOk());
  v1::GuardSpec* guard = spec.mutable_guard();
  guard->set_loss_spike_factor(3);
  guard->set_window(2);
  guard->set_grad_norm_spike_factor(10);
  guard->set_max_rollbacks(0);
  guard->set_skip_batches(0);
  v1::SkippedBatches* skipped = guard->add_skipped();
  skipped->set_step(7);
  skipped->set_batches(2);
  EXPECT_THAT(ValidateJobSpec(spec), IsOk());
}

}  // namespace
}  // namespace tessera::coordinator

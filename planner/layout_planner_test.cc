// The layout planner against facts anyone can check: 16 bytes per parameter of mixed-precision
// AdamW state, MLPerf's GPT-3 175B layout fitting 80 GB H100s, the structural rules of a layout,
// the 1F1B bubble, and what ZeRO, recomputation, sequence parallelism and LoRA each save.
#include "planner/layout_planner.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/devices.h"
#include "planner/job_plan.h"
#include "planner/model_config.h"

namespace tessera::planner {
namespace {

using ::testing::HasSubstr;

constexpr double kGB = 1e9;

v1::ModelDims Preset(const std::string& name) {
  v1::ModelSpec spec;
  spec.set_preset(name);
  auto summary = ResolveModel(spec, 1);
  EXPECT_TRUE(summary.ok()) << summary.status();
  return summary->dims();
}

// Llama 2 7B's shape: 32 layers, width 4096, 32 heads, SwiGLU 11008, vocab 32000.
v1::ModelDims Llama7b() {
  v1::ModelSpec spec;
  v1::ModelDims* d = spec.mutable_dims();
  d->set_architecture(v1::ARCHITECTURE_LLAMA);
  d->set_num_layers(32);
  d->set_hidden_size(4096);
  d->set_num_attention_heads(32);
  d->set_ffn_hidden_size(11008);
  d->set_vocab_size(32000);
  d->set_max_seq_len(4096);
  auto summary = ResolveModel(spec, 1);
  EXPECT_TRUE(summary.ok()) << summary.status();
  return summary->dims();
}

ClusterShape Cluster(const std::string& device, int gpus, int per_node) {
  ClusterShape c;
  c.device = *DevicePreset(device);
  c.gpus = gpus;
  c.gpus_per_node = per_node;
  return c;
}

Workload Work(v1::ModelDims dims, int seq, int64_t batch,
              v1::Precision precision = v1::PRECISION_BF16) {
  Workload w;
  w.dims = std::move(dims);
  w.seq_len = seq;
  w.global_batch = batch;
  w.precision = precision;
  return w;
}

int64_t ModelState(const v1::MemoryEstimate& m) {
  return m.weights_bytes() + m.gradients_bytes() + m.optimizer_bytes();
}

TEST(LayoutPlannerTest, MixedPrecisionAdamWCosts16BytesPerParameter) {
  const Workload w = Work(Llama7b(), 4096, 1);
  const int64_t params = CountParameters(w.dims);
  ASSERT_NEAR(static_cast<double>(params), 6.74e9, 0.01e9);
  const ClusterShape one = Cluster("h100-sxm", 1, 8);
  const LayoutChoice single{1, 1, 1, 0, 1, false, v1::ACTIVATION_CHECKPOINTING_FULL};
  v1::LayoutCandidate c = EvaluateLayout(w, single, one);
  const v1::MemoryEstimate& m = c.plan().memory();
  // 4 (fp32 weights) + 4 (gradients) + 8 (AdamW m and v), plus a 4-byte step counter per run of
  // decay or no-decay parameters in a unit: each layer holds matrices and norms, the non-layer
  // unit the embedding and untied head, and the final norm.
  const int64_t runs = 32 * 2 + 2;
  EXPECT_EQ(m.weights_bytes(), 4 * params);
  EXPECT_EQ(m.gradients_bytes(), 4 * params);
  EXPECT_EQ(m.optimizer_bytes(), 8 * params + 4 * runs);
  EXPECT_NEAR(static_cast<double>(ModelState(m)) / params, 16.0, 1e-6);
  // The trainer's gradient buffers are allocated once and live next to the activations: the
  // peak is the sum of every term, even with a single micro-batch per step.
  EXPECT_EQ(m.total_bytes(), ModelState(m) + m.cast_weights_bytes() + m.activations_bytes() +
                                 m.logits_bytes() + m.communication_bytes() + m.overhead_bytes());
  // ~108 GB of model state for 6.7B parameters (112 GB for a round 7B): no 80 GB GPU holds it.
  EXPECT_GT(ModelState(m), 100 * kGB);
  EXPECT_FALSE(c.plan().fits());
  EXPECT_THAT(c.rejected_reason(), HasSubstr("does not fit: needs"));
  EXPECT_THAT(c.rejected_reason(), HasSubstr("over by"));
  // The same model on one 141 GB H200 fits with full recomputation.
  EXPECT_TRUE(EvaluateLayout(w, single, Cluster("h200", 1, 8)).plan().fits());
}

TEST(LayoutPlannerTest, Gpt3OnMlperfLayoutFits768H100s) {
  // MLPerf Training's GPT-3 175B: tp 8, pp 16, dp 6, sequence 2048, global batch 1536 (later
  // rounds), micro-batch 1, sequence parallel, selective recompute, distributed optimizer.
  const Workload w = Work(Preset("gpt3-175b"), 2048, 1536);
  const ClusterShape c = Cluster("h100-sxm", 768, 8);
  const LayoutChoice mlperf{6, 8, 16, 1, 1, true, v1::ACTIVATION_CHECKPOINTING_SELECTIVE};
  v1::LayoutCandidate candidate = EvaluateLayout(w, mlperf, c);
  ASSERT_EQ(candidate.rejected_reason(), "");
  const v1::LayoutPlan& plan = candidate.plan();
  EXPECT_TRUE(plan.fits());
  EXPECT_EQ(plan.gradient_accumulation_steps(), 256);
  ASSERT_EQ(plan.stage_memory_size(), 16);
  // 1F1B: the first stage keeps pp micro-batches in flight, the last one.
  EXPECT_EQ(plan.stage_memory(0).in_flight_micro_batches(), 16);
  EXPECT_EQ(plan.stage_memory(15).in_flight_micro_batches(), 1);
  EXPECT_GT(plan.stage_memory(0).activations_bytes(), plan.stage_memory(15).activations_bytes());
  EXPECT_GT(plan.stage_memory(15).logits_bytes(), 0);
  EXPECT_EQ(plan.stage_memory(0).logits_bytes(), 0);
  EXPECT_LT(plan.memory().total_bytes(), 80 * kGB);
  // ~175B / 128 model-parallel ranks = 1.4B parameters per device (the first stage also holds
  // the vocab-parallel embedding).
  EXPECT_NEAR(static_cast<double>(plan.stage_memory(1).parameters()), 175e9 / 128, 0.05e9);
  // Without recomputation, ZeRO or sequence parallelism the first stage needs more; at
  // micro-batch 2 it no longer fits.
  const LayoutChoice naive{6, 8, 16, 0, 1, false, v1::ACTIVATION_CHECKPOINTING_NONE};
  EXPECT_GT(EvaluateLayout(w, naive, c).plan().memory().total_bytes(),
            plan.memory().total_bytes() + 20 * kGB);
  const LayoutChoice naive2{6, 8, 16, 0, 2, false, v1::ACTIVATION_CHECKPOINTING_NONE};
  EXPECT_FALSE(EvaluateLayout(w, naive2, c).plan().fits());
  EXPECT_TRUE(EvaluateLayout(w, {6, 8, 16, 1, 2, true, v1::ACTIVATION_CHECKPOINTING_SELECTIVE}, c)
                  .plan()
                  .fits());
  // And 175B with pure data parallelism is nowhere near.
  const LayoutChoice dp_only{768, 1, 1, 0, 2, false, v1::ACTIVATION_CHECKPOINTING_FULL};
  EXPECT_THAT(EvaluateLayout(w, dp_only, c).rejected_reason(), HasSubstr("does not fit"));
  // A sensible MFU for this layout on H100s.
  EXPECT_GT(plan.step_time().mfu(), 0.2);
  EXPECT_LT(plan.step_time().mfu(), 0.7);
}

TEST(LayoutPlannerTest, StructuralRulesAreRejectedWithTheReason) {
  const Workload w = Work(Preset("llama3-8b"), 2048, 64);
  const ClusterShape c = Cluster("h100-sxm", 16, 8);
  auto reason = [&](LayoutChoice l) { return InvalidReason(w, l, c).value_or(""); };
  EXPECT_EQ(reason({16, 1, 1, 0, 1}), "");
  EXPECT_EQ(reason({1, 1, 16, 0, 1}), "");
  // llama3-8b has 32 layers: pp 3 does not divide them.
  const ClusterShape c12 = Cluster("h100-sxm", 12, 8);
  EXPECT_EQ(InvalidReason(w, {4, 1, 3, 0, 1}, c12).value_or(""),
            "parallelism.layout.pipeline_parallel: 3 does not divide the model's num_layers 32");
  EXPECT_EQ(InvalidReason(w, {4, 3, 1, 0, 1}, c12).value_or(""),
            "parallelism.layout.tensor_parallel: 3 does not divide the model's num_attention_heads 32");
  EXPECT_EQ(reason({1, 16, 1, 0, 1}), "parallelism.layout.tensor_parallel: 16 does not divide the model's num_kv_heads 8");
  const ClusterShape c32 = Cluster("h100-sxm", 32, 8);
  const Workload w32 = Work(Preset("qwen3-32b"), 2048, 64);  // 64 heads, 8 kv heads
  EXPECT_THAT(InvalidReason(w32, {2, 16, 1, 0, 1}, c32).value_or(""),
              HasSubstr("divide the model's num_kv_heads 8"));
  EXPECT_THAT(
      InvalidReason(Work(Preset("gpt3-175b"), 2048, 64), {1, 16, 2, 0, 1}, c32).value_or(""),
      HasSubstr("exceeds the 8 devices of a node"));
  // Column-parallel MLP: tp must divide the ffn width too.
  v1::ModelDims odd_ffn = Llama7b();
  odd_ffn.set_ffn_hidden_size(11004);
  EXPECT_EQ(InvalidReason(Work(odd_ffn, 2048, 64), {2, 8, 1, 0, 1}, c).value_or(""),
            "parallelism.layout.tensor_parallel: 8 does not divide the model's ffn_hidden_size 11004");
  EXPECT_EQ(InvalidReason(Work(odd_ffn, 2048, 64), {4, 4, 1, 0, 1}, c).value_or(""), "");
  EXPECT_EQ(reason({16, 1, 1, 0, 3}),
            "global batch 64 is not divisible by micro_batch 3 x data_parallel 16 (= 48)");
  EXPECT_EQ(reason({8, 2, 1, 0, 1, false}), "");
  EXPECT_EQ(reason({1, 2, 8, 0, 1, true}), "");
  // ZeRO over one data-parallel rank shards over that rank: valid (NeMo accepts it too).
  EXPECT_EQ(reason({1, 1, 16, 1, 1}), "");
  EXPECT_EQ(reason({1, 1, 16, 3, 1}), "");
  EXPECT_EQ(reason({16, 1, 1, 4, 1}), "zero_stage 4 is not in 0..3");
  EXPECT_EQ(reason({8, 1, 2, 0, 1, true}), "sequence_parallel needs tensor_parallel > 1");
  EXPECT_EQ(reason({8, 1, 1, 0, 1}), "dp 8 x tp 1 x pp 1 = 8 != 16 devices");
  EXPECT_EQ(InvalidReason(w, {1, 1, 1, 0, 1}, Cluster("cpu", 1, 1)).value_or(""),
            "bf16 needs a GPU; CPU trainers run fp32");
}

TEST(LayoutPlannerTest, PipelineBubbleIsPpMinusOneOverMPlusPpMinusOne) {
  Workload w = Work(Preset("gpt2-350m"), 1024, 32);
  const ClusterShape c = Cluster("h100-sxm", 4, 8);
  // pp 4, one data-parallel rank, micro-batch 8: m = 4 micro-batches.
  v1::StepTimeEstimate t = EstimateStepTime(w, {1, 1, 4, 0, 8}, c);
  const double busy = t.compute_seconds() + t.tensor_parallel_seconds();
  EXPECT_NEAR(t.pipeline_bubble_seconds() / (busy + t.pipeline_bubble_seconds()), 3.0 / 7, 1e-9);
  // More micro-batches shrink it: m = 32 -> 3/35.
  t = EstimateStepTime(w, {1, 1, 4, 0, 1}, c);
  EXPECT_NEAR(t.pipeline_bubble_seconds() /
                  (t.compute_seconds() + t.tensor_parallel_seconds() + t.pipeline_bubble_seconds()),
              3.0 / 35, 1e-9);
  EXPECT_EQ(EstimateStepTime(w, {4, 1, 1, 0, 8}, c).pipeline_bubble_seconds(), 0);
}

TEST(LayoutPlannerTest, StepTimeCountsModelFlopsAndCommunication) {
  const Workload w = Work(Preset("gpt2-124m"), 1024, 64);
  const ClusterShape c = Cluster("h100-sxm", 8, 8);
  const v1::StepTimeEstimate t = EstimateStepTime(w, {8, 1, 1, 0, 8}, c);
  const double params = static_cast<double>(CountParameters(w.dims));
  const double tokens = 64.0 * 1024;
  EXPECT_DOUBLE_EQ(t.model_flops(), (6 * params + 12.0 * 12 * 768 * 1024) * tokens);
  EXPECT_DOUBLE_EQ(t.tokens_per_second(), tokens / t.step_seconds());
  EXPECT_NEAR(t.mfu(), t.model_flops() / (t.step_seconds() * 8 * 989e12), 1e-12);
  EXPECT_GT(t.data_parallel_seconds(), 0);
  EXPECT_EQ(t.tensor_parallel_seconds(), 0);
  // Full recomputation costs one more forward: hardware FLOPs 4/3 of model FLOPs (nearly).
  const v1::StepTimeEstimate full =
      EstimateStepTime(w, {8, 1, 1, 0, 8, false, v1::ACTIVATION_CHECKPOINTING_FULL}, c);
  EXPECT_NEAR(full.hardware_flops() / full.model_flops(), 4.0 / 3, 1e-9);
  EXPECT_GT(full.step_seconds(), t.step_seconds());
  // Tensor parallelism adds per-layer collectives; across nodes, data parallelism gets slower.
  const v1::StepTimeEstimate tp = EstimateStepTime(w, {4, 2, 1, 0, 8}, c);
  EXPECT_GT(tp.tensor_parallel_seconds(), 0);
  ClusterShape two_nodes = Cluster("h100-sxm", 16, 8);
  const Workload w16 = Work(Preset("gpt2-124m"), 1024, 128);
  EXPECT_GT(EstimateStepTime(w16, {16, 1, 1, 0, 8}, two_nodes).data_parallel_seconds(),
            t.data_parallel_seconds());
}

TEST(LayoutPlannerTest, ZeroStagesShardStateOverDataParallel) {
  const Workload w = Work(Preset("llama3-8b"), 4096, 64);
  const ClusterShape c = Cluster("h100-sxm", 8, 8);
  auto memory = [&](int zero) {
    return EstimateMemory(w, {8, 1, 1, zero, 1, false, v1::ACTIVATION_CHECKPOINTING_FULL}, c)[0];
  };
  const v1::MemoryEstimate z0 = memory(0), z1 = memory(1), z2 = memory(2), z3 = memory(3);
  // Step counters: two runs (decay, no-decay) per unit, for the rank whose shard straddles both.
  const int64_t counters = 4 * (32 * 2 + 2);
  EXPECT_EQ(z1.optimizer_bytes() - counters, (z0.optimizer_bytes() - counters + 7) / 8);
  EXPECT_EQ(z1.gradients_bytes(), z0.gradients_bytes());
  EXPECT_EQ(z2.gradients_bytes(), (z0.gradients_bytes() + 7) / 8);
  EXPECT_EQ(z2.weights_bytes(), z0.weights_bytes());
  EXPECT_EQ(z3.weights_bytes(), (z0.weights_bytes() + 7) / 8);
  EXPECT_GT(z0.total_bytes(), z1.total_bytes());
  EXPECT_GT(z1.total_bytes(), z2.total_bytes());
  EXPECT_GT(z2.total_bytes(), z3.total_bytes());
  // ZeRO 0 and 1 all-reduce / reduce-scatter the flat gradient buffers in place: no copies.
  EXPECT_EQ(z0.communication_bytes(), 0);
  EXPECT_EQ(z1.communication_bytes(), 0);
  // ZeRO 2 keeps the gradient shard; full gradients exist for the units in flight: the
  // non-layer unit (embedding, untied head, final norm) through backward, and two layers.
  const int64_t rest = 2 * int64_t{128256} * 4096 + 4096;
  const int64_t layer = (CountParameters(w.dims) - rest) / 32;
  ASSERT_EQ(layer, 218112000);  // 4096 x (4096 + 2 x 1024 + 4096 + 3 x 14336) + 2 x 4096
  EXPECT_EQ(z2.communication_bytes(), 4 * (rest + 2 * layer));
  // ZeRO-3 also gathers the weights of the non-layer unit (all of forward and backward) and of
  // two layers (the one in use and the one prefetched).
  EXPECT_EQ(z3.communication_bytes(), 2 * 4 * (rest + 2 * layer));
}

TEST(LayoutPlannerTest, FlatBuffersArePaddedPerUnitToAMultipleOfDp) {
  // tiny-gpt2: two blocks of 49984 parameters and one unit of 257 x 64 + 256 x 64 + 128 = 32960
  // (tied embedding, positions, final norm). Over dp 3 each unit pads to a multiple of 3.
  const Workload w = Work(Preset("tiny-gpt2"), 64, 6, v1::PRECISION_FP32);
  const ClusterShape c = Cluster("cpu", 3, 3);
  auto memory = [&](int zero) { return EstimateMemory(w, {3, 1, 1, zero, 2}, c)[0]; };
  const int64_t padded = 2 * 49986 + 32961, shard = 2 * 16662 + 10987;
  // Step counters: a decay and a no-decay run in each of the three units.
  const int64_t counters = 4 * (2 * 2 + 2);
  EXPECT_EQ(memory(0).weights_bytes(), 4 * padded);
  EXPECT_EQ(memory(0).gradients_bytes(), 4 * padded);
  // ZeRO-0's AdamW steps the parameters themselves: moments for the real elements only.
  EXPECT_EQ(memory(0).optimizer_bytes(), 8 * (2 * 49984 + 32960) + counters);
  EXPECT_EQ(memory(1).optimizer_bytes(), 8 * shard + counters);
  EXPECT_EQ(memory(2).gradients_bytes(), 4 * shard);
  EXPECT_EQ(memory(3).weights_bytes(), 4 * shard);
  // One rank has nothing to pad or shard over: ZeRO at dp 1 costs what ZeRO-0 does.
  const ClusterShape one = Cluster("cpu", 1, 1);
  const Workload w1 = Work(Preset("tiny-gpt2"), 64, 2, v1::PRECISION_FP32);
  const v1::MemoryEstimate plain = EstimateMemory(w1, {1, 1, 1, 0, 2}, one)[0];
  EXPECT_EQ(plain.weights_bytes(), 4 * (2 * 49984 + 32960));
  for (int zero = 1; zero <= 3; ++zero) {
    const v1::MemoryEstimate sharded = EstimateMemory(w1, {1, 1, 1, zero, 2}, one)[0];
    EXPECT_EQ(sharded.total_bytes(), plain.total_bytes()) << zero;
    EXPECT_EQ(sharded.optimizer_bytes(), plain.optimizer_bytes()) << zero;
    EXPECT_EQ(EstimateStepTime(w1, {1, 1, 1, zero, 2}, one).step_seconds(),
              EstimateStepTime(w1, {1, 1, 1, 0, 2}, one).step_seconds());
  }
}

TEST(LayoutPlannerTest, VocabParallelTablesPadTheVocabularyToAMultipleOfTp) {
  // The trainer pads the vocabulary to a multiple of tp: each rank holds ceil(257 / 2) = 129
  // whole rows of the token embedding and of the LM head, and computes 129 logits per token.
  const ClusterShape c = Cluster("h100-sxm", 2, 8);
  const int64_t rows = 129, d = 64;
  // tiny-llama: 2 layers of d 64, 4 heads and 2 kv heads of 16, SwiGLU 256, untied head. A layer
  // holds 64 x 64 (q) + 2 x 64 x 32 (k, v) + 64 x 64 (o) + 3 x 64 x 256 matmul weights, split over
  // tp, and two replicated norms.
  const Workload llama = Work(Preset("tiny-llama"), 64, 2);
  const int64_t llama_layer = (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 256) / 2 + 2 * d;
  const v1::MemoryEstimate tp2 = EstimateMemory(llama, {1, 2, 1, 0, 1}, c)[0];
  EXPECT_EQ(tp2.parameters(), 2 * llama_layer + rows * d + d + rows * d);
  EXPECT_EQ(tp2.embedding_state_bytes(), 16 * 2 * rows * d);
  EXPECT_EQ(tp2.logits_bytes(), int64_t{64} * rows * (12 + 2));
  // At tp 1 nothing is padded.
  const v1::MemoryEstimate tp1 = EstimateMemory(llama, {2, 1, 1, 0, 1}, c)[0];
  EXPECT_EQ(tp1.parameters(), CountParameters(llama.dims));
  // At tp 1 the head's loss runs in chunks: all 64 tokens fit one chunk, on a GPU in bf16 the
  // fused kernel's (2 bytes per logit, the vocabulary padded to 320 rows), plus the head's
  // weight gradient (float32; each chunk's product is summed into it by the product itself).
  EXPECT_EQ(tp1.logits_bytes(), int64_t{64} * 320 * 2 + int64_t{320} * d * 4);
  // tiny-gpt2 (tied) over tp 2 x pp 2: the first stage holds the padded embedding and the learned
  // positions, the last the final norm and its own padded copy of the tied head. A layer: 3d x d
  // + d x d + 2 x d x 256 matmul weights and the qkv and fc biases split over tp, two norms and two
  // row-parallel biases replicated.
  const Workload gpt = Work(Preset("tiny-gpt2"), 64, 2);
  const ClusterShape c4 = Cluster("h100-sxm", 4, 8);
  const int64_t gpt_layer = (3 * d * d + d * d + 2 * d * 256 + 3 * d + 256) / 2 + 6 * d;
  const std::vector<v1::MemoryEstimate> stages = EstimateMemory(gpt, {1, 2, 2, 0, 1}, c4);
  ASSERT_EQ(stages.size(), 2u);
  EXPECT_EQ(stages[0].parameters(), gpt_layer + rows * d + 256 * d);
  EXPECT_EQ(stages[1].parameters(), gpt_layer + 2 * d + rows * d);
  EXPECT_EQ(stages[0].logits_bytes(), 0);
  EXPECT_EQ(stages[1].logits_bytes(), int64_t{64} * rows * (12 + 2));
}

// Without tp the logits are counted for one chunk of tokens however many tokens a micro-batch
// holds: llama3-8b at 8 x 2048 tokens would hold 16,384 x 128,256 logits (4 GiB in bf16) at
// once. On a GPU a chunk is GpuLossChunkRows tokens, about 1 GiB of bf16 logits; on a CPU
// LossChunkRows, 256 MiB of float32 logits.
TEST(LayoutPlannerTest, LogitsAreOneChunkOfTokensWithoutTensorParallelism) {
  const Workload big = Work(Preset("llama3-8b"), 2048, 8);
  const v1::MemoryEstimate one = EstimateMemory(big, {1, 1, 1, 0, 8}, Cluster("h100-sxm", 1, 8))[0];
  const int64_t vocab = big.dims.vocab_size();
  EXPECT_EQ(LossChunkRows(vocab), kLossChunkBytes / (4 * vocab));
  // On a GPU in bf16: one chunk's bf16 logits (the fused kernel writes their gradient in place)
  // and the head's weight gradient, float32, which each chunk's product adds into.
  const int64_t padded = LossPaddedVocab(vocab), hidden = big.dims.hidden_size();
  EXPECT_EQ(padded % kLossVocabAlignment, 0);
  const int64_t rows = GpuLossChunkRows(vocab, 2);
  EXPECT_EQ(rows, kGpuLossChunkBytes / (2 * padded));
  EXPECT_GT(rows, 4 * LossChunkRows(vocab));
  EXPECT_EQ(one.logits_bytes(), rows * padded * 2 + padded * hidden * 4);
  // A chunk, not the micro-batch's 16,384 tokens of logits.
  EXPECT_LT(rows, 2048 * 8);
  EXPECT_LE(rows * padded * 2, kGpuLossChunkBytes);
}

TEST(LayoutPlannerTest, RecomputationAndSequenceParallelismShrinkActivations) {
  const Workload w = Work(Preset("llama3-8b"), 8192, 64);
  const ClusterShape c = Cluster("h100-sxm", 8, 8);
  auto per_layer = [&](bool sp, v1::ActivationCheckpointing ac, int micro = 1) {
    return EstimateMemory(w, {1, 8, 1, 0, micro, sp, ac}, c)[0].activations_per_layer_bytes();
  };
  const int64_t none = per_layer(false, v1::ACTIVATION_CHECKPOINTING_NONE);
  const int64_t selective = per_layer(false, v1::ACTIVATION_CHECKPOINTING_SELECTIVE);
  const int64_t full = per_layer(false, v1::ACTIVATION_CHECKPOINTING_FULL);
  EXPECT_GT(none, selective);
  EXPECT_GT(selective, full);
  // Full recomputation keeps each layer's float32 input: s x b x h x 4 bytes.
  EXPECT_EQ(full, int64_t{8192} * 4096 * 4);
  // Sequence parallelism splits the norm regions (and the kept input) over tp.
  EXPECT_LT(per_layer(true, v1::ACTIVATION_CHECKPOINTING_NONE), none);
  EXPECT_EQ(per_layer(true, v1::ACTIVATION_CHECKPOINTING_FULL), full / 8);
  // Activations grow linearly with the micro-batch.
  EXPECT_NEAR(static_cast<double>(per_layer(false, v1::ACTIVATION_CHECKPOINTING_NONE, 4)),
              4.0 * static_cast<double>(none), 4.0 * 1024);
}

TEST(LayoutPlannerTest, FlashAttentionDropsTheQuadraticScores) {
  Workload w = Work(Preset("gpt2-124m"), 1024, 8);
  const ClusterShape c = Cluster("h100-sxm", 1, 8);
  const int64_t flash = EstimateMemory(w, {1, 1, 1, 0, 8}, c)[0].activations_per_layer_bytes();
  w.flash_attention = false;
  const int64_t eager = EstimateMemory(w, {1, 1, 1, 0, 8}, c)[0].activations_per_layer_bytes();
  // Softmax output (fp32) and its bf16 copy: 6 bytes x heads x s^2 x b, less the log-sum-exp.
  EXPECT_EQ(eager - flash, int64_t{6} * 12 * 1024 * 1024 * 8 - int64_t{4} * 12 * 1024 * 8);
}

TEST(LayoutPlannerTest, LoraTrainsOnlyAdapters) {
  Workload w = Work(Preset("llama3-8b"), 4096, 8);
  const ClusterShape c = Cluster("h100-sxm", 1, 8);
  const LayoutChoice l{1, 1, 1, 0, 1, false, v1::ACTIVATION_CHECKPOINTING_FULL};
  const v1::MemoryEstimate full = EstimateMemory(w, l, c)[0];
  w.lora_rank = 16;
  const v1::MemoryEstimate lora = EstimateMemory(w, l, c)[0];
  // Frozen base in bf16 (2 bytes per parameter) plus small fp32 adapters.
  const int64_t params = CountParameters(w.dims);
  EXPECT_GT(lora.weights_bytes(), 2 * params);
  EXPECT_LT(lora.weights_bytes(), 2 * params + 2 * params / 50);
  EXPECT_LT(lora.optimizer_bytes(), full.optimizer_bytes() / 100);
  EXPECT_FALSE(EvaluateLayout(Work(Preset("llama3-8b"), 4096, 8), l, c).plan().fits());
  EXPECT_TRUE(EvaluateLayout(w, l, c).plan().fits());
  // The adapters are matrices: one decay run, one step counter, per layer; nothing else trains.
  EXPECT_EQ(lora.optimizer_bytes() - 2 * lora.gradients_bytes(), 4 * 32);
}

TEST(LayoutPlannerTest, StepCountersArePerRunOfEachUnit) {
  // The trainer's fused AdamW keeps one float32 step counter per contiguous run of decay
  // (matrices, embeddings, head) or no-decay (biases, norms) parameters a rank steps, at most two
  // per unit. At ZeRO 0 on one dp rank (no padding) the optimizer term is 8 bytes per trained
  // parameter plus those counters.
  auto counters = [](const v1::MemoryEstimate& m) {
    return m.optimizer_bytes() - 2 * m.gradients_bytes();
  };
  const Workload w = Work(Preset("llama3-8b"), 4096, 64);
  const std::vector<v1::MemoryEstimate> stages =
      EstimateMemory(w, {1, 1, 4, 0, 1}, Cluster("h100-sxm", 4, 8));
  ASSERT_EQ(stages.size(), 4u);
  // 8 layers per stage, each of matrices and norms; the first stage's non-layer unit holds only
  // the embedding (one run), the middle stages' nothing, the last stage's the final norm and the
  // untied head (two runs).
  EXPECT_EQ(counters(stages[0]), 4 * (8 * 2 + 1));
  EXPECT_EQ(counters(stages[1]), 4 * (8 * 2));
  EXPECT_EQ(counters(stages[2]), 4 * (8 * 2));
  EXPECT_EQ(counters(stages[3]), 4 * (8 * 2 + 2));
  // Tensor parallelism splits parameters, not runs.
  const std::vector<v1::MemoryEstimate> split =
      EstimateMemory(w, {1, 2, 4, 0, 1}, Cluster("h100-sxm", 8, 8));
  EXPECT_EQ(counters(split[0]), 4 * (8 * 2 + 1));
  EXPECT_EQ(counters(split[3]), 4 * (8 * 2 + 2));
  const v1::MemoryEstimate whole = EstimateMemory(w, {1, 1, 1, 0, 1}, Cluster("h100-sxm", 1, 8))[0];
  EXPECT_EQ(counters(whole), 4 * (32 * 2 + 2));
  // ZeRO-1 counts the worst dp rank, whose shard of each unit straddles its decay/no-decay
  // boundary: as many counters as the whole model's. It keeps the full (padded) flat gradients,
  // and its moments cover a 1/8 shard of them.
  const v1::MemoryEstimate zero1 = EstimateMemory(w, {8, 1, 1, 1, 1}, Cluster("h100-sxm", 8, 8))[0];
  EXPECT_EQ(zero1.optimizer_bytes() - 2 * zero1.gradients_bytes() / 8, 4 * (32 * 2 + 2));
}

TEST(LayoutPlannerTest, SearchRanksFittingLayoutsByTokensPerSecond) {
  const Workload w = Work(Preset("llama3-8b"), 4096, 64);
  const ClusterShape c = Cluster("h100-sxm", 16, 8);
  // The dp x tp x pp layouts (context parallelism and interleaving are layout_split_test.cc's).
  SearchLimits plain;
  plain.max_cp = 1;
  plain.max_v = 1;
  const SearchResult result = SearchLayouts(w, c, plain);
  ASSERT_GT(result.fitting, 10);
  ASSERT_GT(result.candidates.size(), static_cast<size_t>(result.fitting));
  double previous = 1e30;
  for (int i = 0; i < result.fitting; ++i) {
    const v1::LayoutCandidate& x = result.candidates[i];
    EXPECT_TRUE(x.plan().fits());
    EXPECT_EQ(x.rejected_reason(), "");
    EXPECT_LE(x.plan().step_time().tokens_per_second(), previous);
    previous = x.plan().step_time().tokens_per_second();
  }
  for (size_t i = result.fitting; i < result.candidates.size(); ++i) {
    EXPECT_FALSE(result.candidates[i].plan().fits());
    EXPECT_NE(result.candidates[i].rejected_reason(), "");
  }
  // Data parallel with no state sharding does not fit 8B on 80 GB: it is among the rejected.
  const bool plain_dp_rejected =
      std::any_of(result.candidates.begin() + result.fitting, result.candidates.end(),
                  [](const v1::LayoutCandidate& x) {
                    const v1::Layout& l = x.plan().layout();
                    return l.data_parallel() == 16 && l.zero_stage() == 0;
                  });
  EXPECT_TRUE(plain_dp_rejected);
  const v1::LayoutPlan plan = ChoosePlan(result, c);
  EXPECT_TRUE(plan.fits());
  EXPECT_THAT(plan.explanation(), HasSubstr("fastest of"));
  EXPECT_THAT(plan.explanation(), HasSubstr("Runner-up"));
}

TEST(LayoutPlannerTest, LimitsRestrictTheSearchAndNothingFittingIsExplained) {
  const Workload w = Work(Preset("llama3-8b"), 4096, 64);
  const ClusterShape c = Cluster("h100-sxm", 8, 8);
  SearchLimits data_parallel_only;
  data_parallel_only.max_tp = 1;
  data_parallel_only.max_pp = 1;
  data_parallel_only.max_zero = 0;
  data_parallel_only.allow_activation_checkpointing = false;
  data_parallel_only.micro_batch = 1;
  data_parallel_only.max_cp = 1;
  const SearchResult result = SearchLayouts(w, c, data_parallel_only);
  ASSERT_EQ(result.candidates.size(), 1u);
  EXPECT_EQ(result.fitting, 0);
  const v1::LayoutPlan plan = ChoosePlan(result, c);
  EXPECT_FALSE(plan.fits());
  EXPECT_THAT(plan.explanation(), HasSubstr("No layout fits (1 considered)"));
  EXPECT_THAT(plan.explanation(), HasSubstr("over by"));
}

// What `parallelism: auto` picks among the layouts the trainer runs (TrainerCapabilities).
bool ModelParallel(const v1::Layout& l) {
  return l.tensor_parallel() > 1 || l.pipeline_parallel() > 1;
}

TEST(LayoutPlannerTest, TrainerRunsEveryLayoutButZeroTwoAndThreeWithModelParallelism) {
  const SearchLimits runs = TrainerCapabilities();
  EXPECT_EQ(runs.max_tp, 0);
  EXPECT_EQ(runs.max_pp, 0);
  EXPECT_EQ(runs.max_zero, 3);
  EXPECT_EQ(runs.max_zero_with_model_parallel, 1);
  EXPECT_TRUE(runs.allow_sequence_parallel);
  EXPECT_TRUE(runs.allow_activation_checkpointing);
  for (int zero = 0; zero <= 3; ++zero) {
    for (auto ac : {v1::ACTIVATION_CHECKPOINTING_NONE, v1::ACTIVATION_CHECKPOINTING_SELECTIVE,
                    v1::ACTIVATION_CHECKPOINTING_FULL}) {
      EXPECT_TRUE(CheckTrainerRuns(ToProto({8, 1, 1, zero, 1, false, ac})).ok()) << zero;
      // Tensor (with or without sp) and pipeline parallelism run with ZeRO 0 and 1 only.
      for (LayoutChoice l :
           {LayoutChoice{4, 2, 1, zero, 1, false, ac}, LayoutChoice{4, 2, 1, zero, 1, true, ac},
            LayoutChoice{4, 1, 2, zero, 1, false, ac}, LayoutChoice{2, 2, 2, zero, 1, true, ac}}) {
        EXPECT_EQ(CheckTrainerRuns(ToProto(l)).ok(), zero <= 1) << Describe(l);
      }
    }
  }
  // ZeRO over one data-parallel rank next to tp is ZeRO-0 in effect, but still refused as
  // written: the trainer checks the stage, not its effect.
  const absl::Status tp = CheckTrainerRuns(ToProto({1, 2, 1, 2, 1}));
  EXPECT_EQ(tp.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(tp.message()),
              HasSubstr("parallelism.layout.zero_stage: 2 with tensor_parallel 2: this trainer "
                        "does not run ZeRO 2 together with tensor or pipeline parallelism"));
  EXPECT_THAT(std::string(tp.message()), HasSubstr("set zero_stage to 1"));
  EXPECT_THAT(std::string(tp.message()), HasSubstr("or use parallelism: auto"));
  const absl::Status both = CheckTrainerRuns(ToProto({2, 2, 2, 3, 1, true}));
  EXPECT_EQ(both.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(both.message()),
              HasSubstr("parallelism.layout.zero_stage: 3 with tensor_parallel 2 and "
                        "pipeline_parallel 2: "));
  EXPECT_THAT(std::string(CheckTrainerRuns(ToProto({4, 1, 2, 2, 1})).message()),
              HasSubstr("parallelism.layout.zero_stage: 2 with pipeline_parallel 2: "));
}

TEST(LayoutPlannerTest, RunnableSearchKeepsPlainDataParallelWhenItFits) {
  // gpt2-124m on one node of H100s: every ZeRO stage and recomputation mode fits, and plain data
  // parallelism is the fastest (ZeRO-1/2 add an exposed all-gather, recomputation a forward,
  // tensor parallelism per-layer collectives, pipeline parallelism a bubble).
  const Workload w = Work(Preset("gpt2-124m"), 1024, 64);
  const ClusterShape c = Cluster("h100-sxm", 8, 8);
  SearchLimits runnable = TrainerCapabilities();
  runnable.micro_batch = 8;
  runnable.max_cp = 1;  // dp against tp and pp here; cp is layout_split_test.cc's
  const SearchResult result = SearchLayouts(w, c, runnable);
  const v1::LayoutPlan plan = ChoosePlan(result, c);
  EXPECT_TRUE(plan.fits());
  EXPECT_EQ(plan.layout().data_parallel(), 8);
  EXPECT_EQ(plan.layout().zero_stage(), 0);
  EXPECT_EQ(plan.layout().activation_checkpointing_mode(), v1::ACTIVATION_CHECKPOINTING_NONE);
  // ZeRO-3 is estimated a few percent faster (the optimizer steps a 1/8 shard): within the
  // model's error, so the simpler layout is chosen and the explanation says so.
  const v1::LayoutPlan& fastest = result.candidates[0].plan();
  EXPECT_EQ(fastest.layout().zero_stage(), 3);
  EXPECT_EQ(fastest.layout().tensor_parallel(), 1);
  EXPECT_GT(fastest.step_time().tokens_per_second(), plan.step_time().tokens_per_second());
  EXPECT_GT(plan.step_time().tokens_per_second(), 0.9 * fastest.step_time().tokens_per_second());
  EXPECT_THAT(plan.explanation(), HasSubstr("simplest of the layouts within 10% of the fastest"));
  EXPECT_THAT(plan.explanation(), HasSubstr("Fastest: dp=8 tp=1 pp=1 zero=3"));
  // At equal speed the simpler layout ranks first: recomputation costs nothing with flash
  // attention under selective, so none and selective tie and none comes first; sequence
  // parallelism moves the same bytes, so sp off comes first.
  auto complexity = [](const v1::Layout& l) {
    return std::make_tuple(l.zero_stage(), static_cast<int>(l.activation_checkpointing_mode()),
                           l.sequence_parallel(), l.pipeline_parallel(), l.tensor_parallel());
  };
  int ties = 0;
  for (int i = 0; i + 1 < result.fitting; ++i) {
    const v1::LayoutPlan& a = result.candidates[i].plan();
    const v1::LayoutPlan& b = result.candidates[i + 1].plan();
    if (a.step_time().tokens_per_second() == b.step_time().tokens_per_second()) {
      ++ties;
      EXPECT_LT(complexity(a.layout()), complexity(b.layout())) << i;
    }
  }
  EXPECT_GT(ties, 0);
  // Data parallel alone: ZeRO 0-3 x recomputation none/selective/full. Tensor (with and without
  // sp) and pipeline layouts are considered too, but never with ZeRO 2 or 3.
  int data_parallel = 0, tensor = 0, pipeline = 0, sequence = 0;
  for (const v1::LayoutCandidate& x : result.candidates) {
    const v1::Layout& l = x.plan().layout();
    if (!x.plan().has_memory()) continue;  // structurally invalid (tp 8 of 12 heads, pp 8)
    if (!ModelParallel(l)) ++data_parallel;
    tensor += l.tensor_parallel() > 1;
    pipeline += l.pipeline_parallel() > 1;
    sequence += l.sequence_parallel();
    if (ModelParallel(l)) {
      EXPECT_LE(l.zero_stage(), 1) << x.ShortDebugString();
    }
  }
  EXPECT_EQ(data_parallel, 4 * 3);
  EXPECT_GT(tensor, 0);
  EXPECT_GT(pipeline, 0);
  EXPECT_GT(sequence, 0);
}

TEST(LayoutPlannerTest, RunnableSearchUsesModelParallelismWhenDataParallelFitsWorse) {
  // llama3-8b at seq 16384 on 8 x 80 GB: 16 bytes x 8B parameters of replicated state is 128 GB,
  // so data parallelism alone fits only with ZeRO 2/3, and it is estimated slower than splitting
  // the model with ZeRO <= 1. (At seq 8192 data parallelism with ZeRO-3 ties since the head's
  // loss runs in chunks of tokens and the logits no longer scale with the micro-batch.)
  const Workload w = Work(Preset("llama3-8b"), 16384, 64);
  const ClusterShape c = Cluster("h100-sxm", 8, 8);
  SearchLimits runnable = TrainerCapabilities();
  runnable.max_cp = 1;  // dp against tp and pp here; cp is layout_split_test.cc's
  const SearchResult result = SearchLayouts(w, c, runnable);
  ASSERT_GT(result.fitting, 0);
  for (int i = 0; i < result.fitting; ++i) {
    const v1::Layout& l = result.candidates[i].plan().layout();
    if (ModelParallel(l)) {
      EXPECT_LE(l.zero_stage(), 1) << i;
    } else {
      EXPECT_GE(l.zero_stage(), 2) << i;
    }
  }
  const v1::LayoutPlan plan = ChoosePlan(result, c);
  EXPECT_TRUE(plan.fits());
  EXPECT_TRUE(ModelParallel(plan.layout())) << plan.explanation();
  EXPECT_LE(plan.layout().zero_stage(), 1);
  EXPECT_TRUE(CheckTrainerRuns(plan.layout()).ok());
  // The data-parallel-only search (the trainer's earlier limits) still finds ZeRO 2/3 layouts, all
  // estimated slower.
  SearchLimits data_parallel_only = TrainerCapabilities();
  data_parallel_only.max_tp = 1;
  data_parallel_only.max_pp = 1;
  data_parallel_only.max_cp = 1;
  const SearchResult dp = SearchLayouts(w, c, data_parallel_only);
  ASSERT_GT(dp.fitting, 0);
  EXPECT_GE(dp.candidates[0].plan().layout().zero_stage(), 2);
  EXPECT_LT(dp.candidates[0].plan().step_time().tokens_per_second(),
            plan.step_time().tokens_per_second());
  // Without ZeRO and recomputation nothing fits at all.
  SearchLimits plain = data_parallel_only;
  plain.max_zero = 0;
  plain.allow_activation_checkpointing = false;
  EXPECT_EQ(SearchLayouts(w, c, plain).fitting, 0);
}

TEST(LayoutPlannerTest, RunnableSearchSplitsTheModelWhenShardingIsCappedAtZeroOne) {
  // llama3-8b at seq 4096 on 8 x 80 GB fits data parallel with ZeRO-3, the fastest layout. Capped
  // at ZeRO-1 (auto_layout.max_zero_stage: 1) data parallelism alone no longer fits (64 GB of
  // float32 weights and gradients per GPU before activations) and the plan splits the model.
  const Workload w = Work(Preset("llama3-8b"), 4096, 64);
  const ClusterShape c = Cluster("h100-sxm", 8, 8);
  const v1::LayoutPlan uncapped = ChoosePlan(SearchLayouts(w, c, TrainerCapabilities()), c);
  EXPECT_TRUE(uncapped.fits());
  EXPECT_FALSE(ModelParallel(uncapped.layout()));
  EXPECT_EQ(uncapped.layout().zero_stage(), 3);
  SearchLimits capped = TrainerCapabilities();
  capped.max_zero = 1;
  const SearchResult result = SearchLayouts(w, c, capped);
  ASSERT_GT(result.fitting, 0);
  for (int i = 0; i < result.fitting; ++i) {
    EXPECT_TRUE(ModelParallel(result.candidates[i].plan().layout())) << i;
    EXPECT_LE(result.candidates[i].plan().layout().zero_stage(), 1) << i;
  }
  const v1::LayoutPlan plan = ChoosePlan(result, c);
  EXPECT_TRUE(plan.fits());
  EXPECT_TRUE(ModelParallel(plan.layout()));
  EXPECT_TRUE(CheckTrainerRuns(plan.layout()).ok());
}

TEST(LayoutPlannerTest, MaxZeroWithModelParallelLimitsOnlyModelParallelLayouts) {
  const Workload w = Work(Preset("llama3-8b"), 4096, 64);
  const ClusterShape c = Cluster("h100-sxm", 8, 8);
  SearchLimits limits;
  limits.micro_batch = 1;
  limits.allow_activation_checkpointing = false;
  limits.allow_sequence_parallel = false;
  limits.max_cp = 1;
  limits.max_v = 1;
  auto zero_stages = [&](int tp, int pp) {
    std::vector<int> stages;
    for (const v1::LayoutCandidate& x : SearchLayouts(w, c, limits).candidates) {
      const v1::Layout& l = x.plan().layout();
      if (l.tensor_parallel() == tp && l.pipeline_parallel() == pp) {
        stages.push_back(l.zero_stage());
      }
    }
    std::sort(stages.begin(), stages.end());
    return stages;
  };
  EXPECT_EQ(zero_stages(2, 1), (std::vector<int>{0, 1, 2, 3}));
  limits.max_zero_with_model_parallel = 1;
  EXPECT_EQ(zero_stages(1, 1), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(zero_stages(2, 1), (std::vector<int>{0, 1}));
  EXPECT_EQ(zero_stages(1, 2), (std::vector<int>{0, 1}));
  EXPECT_EQ(zero_stages(2, 2), (std::vector<int>{0, 1}));
  // max_zero still bounds both.
  limits.max_zero = 0;
  EXPECT_EQ(zero_stages(1, 1), (std::vector<int>{0}));
  EXPECT_EQ(zero_stages(2, 1), (std::vector<int>{0}));
}

TEST(DevicesTest, PresetsByNameAndByNvmlName) {
  auto h100 = DeviceForGpuName("NVIDIA H100 80GB HBM3", 0);
  ASSERT_TRUE(h100.ok());
  EXPECT_EQ(h100->name(), "h100-sxm");
  EXPECT_EQ(h100->peak_flops_bf16(), 989e12);
  auto a100_40 = DeviceForGpuName("NVIDIA A100-SXM4-40GB", int64_t{40} << 30);
  ASSERT_TRUE(a100_40.ok());
  EXPECT_EQ(a100_40->memory_bytes(), int64_t{40} << 30);
  EXPECT_EQ(DeviceForGpuName("NVIDIA H200", 0)->name(), "h200");
  EXPECT_EQ(DeviceForGpuName("NVIDIA L40S", 0)->name(), "l40s");
  EXPECT_EQ(DeviceForGpuName("NVIDIA RTX PRO 6000 Blackwell Server Edition", 0)->name(),
            "rtx-pro-6000");
  EXPECT_EQ(DeviceForGpuName("", 0)->name(), "cpu");
  EXPECT_EQ(DeviceForGpuName("Radeon 7", 0).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(DevicePreset("tpu").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(DevicePreset("tpu").status().message()), HasSubstr("h100-sxm"));
  v1::DeviceModel overrides;
  overrides.set_memory_bytes(int64_t{94} << 30);
  const v1::DeviceModel nvl = ApplyDeviceOverrides(*DevicePreset("H100-SXM"), overrides);
  EXPECT_EQ(nvl.memory_bytes(), int64_t{94} << 30);
  EXPECT_EQ(nvl.peak_flops_bf16(), 989e12);
  EXPECT_TRUE(ValidateDeviceModel(nvl).ok());
  overrides.set_achievable_flops_fraction(1.5);
  EXPECT_THAT(std::string(ValidateDeviceModel(ApplyDeviceOverrides(nvl, overrides)).message()),
              HasSubstr("device.achievable_flops_fraction"));
  for (const std::string& name : DevicePresetNames()) {
    EXPECT_TRUE(ValidateDeviceModel(*DevicePreset(name)).ok()) << name;
  }
}

}  // namespace
}  // namespace tessera::planner

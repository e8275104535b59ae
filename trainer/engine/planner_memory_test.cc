// The planner's model-state terms against what the trainer really allocates on CPU: for several
// model shapes, build the trainer's module under its ShardedEngine, run one step, and compare the
// bytes of parameters, gradients and optimizer state with planner::EstimateMemory for the same
// config;
// then, for dp/tp/pp meshes on threads as ranks, every rank's engine against the planner's terms
// for its pipeline stage.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "planner/devices.h"
#include "planner/layout_planner.h"
#include "planner/lora.h"
#include "planner/model_config.h"
#include "trainer/engine/sharded_engine.h"
#include "trainer/model/hf_weights.h"
#include "trainer/model/model.h"
#include "trainer/model/model_dims_fixture.h"
#include "trainer/parallel/distributed.h"
#include "trainer/parallel/mesh.h"
#include "trainer/parallel/tensor_parallel.h"

#define USE_C10D_GLOO 1
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

namespace tessera::trainer {
namespace {

struct Allocated {
  int64_t weights = 0;
  int64_t gradients = 0;
  int64_t optimizer = 0;
};

// One training step of the trainer's model and optimizer as train.cc sets them up on one rank: a
// ShardedEngine at dp 1 (flat float32 buffers per unit that the parameters and their gradients
// view, and a fused AdamW stepping each unit's decay and no-decay runs).
Allocated TrainOneStep(const v1::ModelDims& dims, int seq, int batch) {
  torch::manual_seed(7);
  CausalLM model(dims, planner::kDefaultInitStd);
  ShardedEngineOptions options;  // ZeRO 0, one rank, no tensor or pipeline parallelism
  options.weight_decay = 0.1;
  ShardedEngine engine(model, options);
  at::Tensor tokens = torch::randint(dims.vocab_size(), {batch, seq + 1}, torch::kLong);
  engine.ForwardBackward(tokens.narrow(1, 0, seq), tokens.narrow(1, 1, seq), 1.0, true);
  engine.Step(1e-3, 1.0);
  Allocated out;
  for (const auto& param : model->parameters()) {
    out.weights += static_cast<int64_t>(param.nbytes());
    if (param.grad().defined()) out.gradients += static_cast<int64_t>(param.grad().nbytes());
  }
  // The AdamW state tensors themselves (two moments and a step counter per run).
  const EngineMemory memory = engine.Memory();
  out.optimizer = memory.moment_bytes + memory.step_counter_bytes;
  // At dp 1 nothing is padded: the flat buffers are exactly the parameters and gradients.
  EXPECT_EQ(memory.padding_elements, 0);
  EXPECT_EQ(memory.parameter_bytes, out.weights);
  EXPECT_EQ(memory.gradient_bytes, out.gradients);
  return out;
}

using testing::ResolvedDims;

std::vector<std::pair<std::string, v1::ModelDims>> Shapes() {
  std::vector<std::pair<std::string, v1::ModelDims>> shapes;
  for (const char* preset : {"tiny-gpt2", "tiny-llama"}) {
    v1::ModelSpec spec;
    spec.set_preset(preset);
    shapes.emplace_back(preset, ResolvedDims(spec));
  }
  v1::ModelSpec qwen_like;  // GQA, qk_norm, untied head
  v1::ModelDims* d = qwen_like.mutable_dims();
  d->set_architecture(v1::ARCHITECTURE_LLAMA);
  d->set_num_layers(3);
  d->set_hidden_size(96);
  d->set_num_attention_heads(6);
  d->set_num_kv_heads(2);
  d->set_head_dim(32);
  d->set_ffn_hidden_size(200);
  d->set_vocab_size(300);
  d->set_max_seq_len(64);
  d->set_qk_norm(true);
  shapes.emplace_back("llama-gqa-qk_norm-untied", ResolvedDims(qwen_like));
  v1::ModelSpec gpt2_untied;
  d = gpt2_untied.mutable_dims();
  d->set_architecture(v1::ARCHITECTURE_GPT2);
  d->set_num_layers(2);
  d->set_hidden_size(64);
  d->set_num_attention_heads(4);
  d->set_vocab_size(257);
  d->set_max_seq_len(32);
  d->set_tie_embeddings(false);
  shapes.emplace_back("gpt2-untied", ResolvedDims(gpt2_untied));
  return shapes;
}

TEST(PlannerMemoryTest, ModelStateMatchesTheTrainersAllocations) {
  planner::ClusterShape cpu;
  cpu.device = *planner::DevicePreset("cpu");
  for (const auto& [name, dims] : Shapes()) {
    SCOPED_TRACE(name);
    const int seq = 16, micro = 2;
    const Allocated real = TrainOneStep(dims, seq, micro);
    planner::Workload workload;
    workload.dims = dims;
    workload.seq_len = seq;
    workload.global_batch = micro;
    workload.precision = v1::PRECISION_FP32;
    const planner::LayoutChoice layout{.micro_batch = micro};
    ASSERT_EQ(planner::InvalidReason(workload, layout, cpu), std::nullopt);
    const v1::MemoryEstimate estimate = planner::EstimateMemory(workload, layout, cpu).at(0);
    EXPECT_EQ(estimate.parameters(), planner::CountParameters(dims));
    EXPECT_EQ(estimate.weights_bytes(), real.weights);
    EXPECT_EQ(estimate.gradients_bytes(), real.gradients);
    EXPECT_EQ(estimate.optimizer_bytes(), real.optimizer);
    // No bf16 copies on CPU, and a single process has no gradient buckets.
    EXPECT_EQ(estimate.cast_weights_bytes(), 0);
    EXPECT_EQ(estimate.communication_bytes(), 0);
  }
}

// The ZeRO engine's per-rank bytes against the planner's terms for the same layout, on dp ranks
// simulated by threads sharing a HashStore over Gloo (c10d's own way). The trainer pads each
// unit (a layer, or the rest of the model) to a multiple of dp, so its shard of a unit can exceed
// the planner's ceil(bytes / dp) by at most dp - 1 elements per unit.
TEST(PlannerMemoryTest, ZeroShardsMatchThePlannerPerRank) {
  // c10d's FlightRecorder is one per process and races (crashes inserting into its map) when
  // several process groups of one process record collectives at once, as threads-as-ranks do;
  // a trainer has one rank per process. Off for this test, before the first group exists.
  setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/1);
  planner::ClusterShape cpu;
  cpu.device = *planner::DevicePreset("cpu");
  for (const auto& [name, dims] : Shapes()) {
    for (int dp : {2, 4}) {
      for (int zero = 0; zero <= 3; ++zero) {
        SCOPED_TRACE(absl::StrCat(name, " dp ", dp, " zero ", zero));
        const int seq = 16, micro = 2;
        planner::Workload workload;
        workload.dims = dims;
        workload.seq_len = seq;
        workload.global_batch = micro * dp;
        workload.precision = v1::PRECISION_FP32;
        planner::LayoutChoice layout;
        layout.dp = dp;
        layout.zero = zero;
        layout.micro_batch = micro;
        cpu.gpus = dp;
        cpu.gpus_per_node = dp;
        ASSERT_EQ(planner::InvalidReason(workload, layout, cpu), std::nullopt);
        const v1::MemoryEstimate estimate = planner::EstimateMemory(workload, layout, cpu).at(0);

        auto store = c10::make_intrusive<c10d::HashStore>();
        std::vector<EngineMemory> memory(dp);
        std::vector<std::thread> ranks;
        for (int rank = 0; rank < dp; ++rank) {
          ranks.emplace_back([&, rank] {
            auto options = c10d::ProcessGroupGloo::Options::create();
            options->devices.push_back(
                c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
            auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, dp, options);
            auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, dp);
            group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
            group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
            torch::manual_seed(7);
            CausalLM model(dims, planner::kDefaultInitStd);
            ShardedEngineOptions engine_options;  // no tensor or pipeline parallelism
            engine_options.zero_stage = zero;
            engine_options.dp_group = group;
            engine_options.dp_rank = rank;
            engine_options.dp_size = dp;
            engine_options.weight_decay = 0.1;
            ShardedEngine engine(model, engine_options);
            at::Tensor tokens = torch::randint(dims.vocab_size(), {micro, seq + 1}, torch::kLong);
            engine.ForwardBackward(tokens.narrow(1, 0, seq), tokens.narrow(1, 1, seq), 0.5, true);
            engine.Step(1e-3, 1.0);
            memory[rank] = engine.Memory();
          });
        }
        for (auto& thread : ranks) thread.join();
        const int64_t units = 1 + dims.num_layers();
        const int64_t slack = 4 * (dp - 1) * units;
        for (int rank = 0; rank < dp; ++rank) {
          SCOPED_TRACE(absl::StrCat("rank ", rank));
          const EngineMemory& m = memory[rank];
          EXPECT_GE(m.parameter_bytes, estimate.weights_bytes());
          EXPECT_LE(m.parameter_bytes, estimate.weights_bytes() + slack);
          EXPECT_GE(m.gradient_bytes, estimate.gradients_bytes());
          EXPECT_LE(m.gradient_bytes, estimate.gradients_bytes() + slack);
          // The padding itself: what each rank holds beyond the exact parameter count.
          EXPECT_EQ(m.parameter_bytes,
                    4 * (zero == 3 ? (planner::CountParameters(dims) + m.padding_elements) / dp
                                   : planner::CountParameters(dims) + m.padding_elements));
          // Moments cover exactly the elements the rank steps (all of them for ZeRO 0); the
          // planner's optimizer term adds a 4-byte step counter per run (below).
          if (zero == 0) {
            EXPECT_EQ(m.moment_bytes, 8 * planner::CountParameters(dims));
          } else {
            EXPECT_LE(m.moment_bytes,
                      8 * ((planner::CountParameters(dims) + dp - 1) / dp) + 8 * (dp - 1) * units);
          }
        }
        if (zero >= 1) {
          int64_t total = 0;
          for (const EngineMemory& m : memory) total += m.moment_bytes;
          // Every element's moments live on exactly one rank.
          EXPECT_EQ(total, 8 * planner::CountParameters(dims));
        }
        // Step counters: the planner's optimizer term less its moments (every real element under
        // ZeRO 0, a 1/dp shard of the padded units otherwise) is one counter per decay and one
        // per no-decay run of each unit (every unit here holds both), the worst rank's count. A
        // rank's shard may lie within one kind; the rank whose shard straddles the boundary
        // steps both, and for these shapes one rank does so in every unit.
        const int64_t planner_moments =
            zero == 0 ? 8 * planner::CountParameters(dims)
                      : 8 * (planner::CountParameters(dims) + memory[0].padding_elements) / dp;
        const int64_t planner_counters = estimate.optimizer_bytes() - planner_moments;
        EXPECT_EQ(planner_counters, 4 * 2 * units);
        int64_t worst = 0;
        for (const EngineMemory& m : memory) {
          EXPECT_LE(m.step_counter_bytes, planner_counters);
          if (zero == 0) {
            EXPECT_EQ(m.step_counter_bytes, planner_counters);
          }
          worst = std::max(worst, m.step_counter_bytes);
        }
        EXPECT_EQ(worst, planner_counters);
      }
    }
  }
}

// A dp x tp x pp mesh as the trainer builds it (train.cc's Setup): every rank, a thread here,
// joins the world group (over a shared HashStore instead of a TCPStore), builds its DeviceMesh,
// its stage of the model under its tensor-parallel split, broadcasts the parameters over dp and
// hands the model to a ShardedEngine with the trainer's options. Each rank's EngineMemory must
// equal the planner's per-device terms for that rank's pipeline stage, byte for byte: the planner
// counts the same flat units padded to a multiple of dp, the ceil(vocab / tp) rows per rank and
// the tied head's copy on the last stage.
struct MeshCase {
  std::string name;
  v1::ModelDims dims;
  MeshShape shape;
  int zero = 0;
  bool sequence_parallel = false;
};

struct RankResult {
  int stage = 0;
  int dp_rank = 0;
  int tp_rank = 0;
  int64_t parameters = 0;  // elements the rank's model holds (vocab padding rows included)
  // Elements whose AdamW moments the rank keeps, counted from the model's units (the non-layer
  // parameters, then each layer): all of them under ZeRO 0, else the real elements of the rank's
  // 1/dp shard of each unit padded to a multiple of dp.
  int64_t stepped = 0;
  // The planner's moment elements for the rank: every element under ZeRO 0, else the size of the
  // rank's shard (padding included) summed over the units.
  int64_t shard_elements = 0;
  // AdamW step counters of the stage's worst dp rank, counted from the model's units: one per kind
  // of parameter (decay: dim >= 2; no-decay: biases, norms) a unit holds.
  int64_t worst_runs = 0;
  EngineMemory memory;
  // After one training step (only without pipeline parallelism, where ForwardBackward runs the
  // whole model).
  std::optional<EngineMemory> after_step;
  std::string error;
};

using testing::PresetDims;

std::vector<MeshCase> MeshCases() {
  const v1::ModelDims gpt2 = PresetDims("tiny-gpt2", 4);
  const v1::ModelDims llama = PresetDims("tiny-llama");
  return {
      {"gpt2 tp2", gpt2, {.pp = 1, .dp = 1, .tp = 2}},
      {"gpt2 tp2 sp", gpt2, {.pp = 1, .dp = 1, .tp = 2}, 0, true},
      {"gpt2 pp2", gpt2, {.pp = 2, .dp = 1, .tp = 1}},
      {"gpt2 pp4", gpt2, {.pp = 4, .dp = 1, .tp = 1}},
      {"gpt2 tp2 x pp2", gpt2, {.pp = 2, .dp = 1, .tp = 2}},
      {"gpt2 dp2 x tp2 zero1", gpt2, {.pp = 1, .dp = 2, .tp = 2}, 1},
      {"gpt2 dp2 x pp2 zero1", gpt2, {.pp = 2, .dp = 2, .tp = 1}, 1},
      {"llama tp2 x pp2", llama, {.pp = 2, .dp = 1, .tp = 2}},
  };
}

RankResult BuildRank(const MeshCase& c, int rank, const c10::intrusive_ptr<c10d::Store>& store,
                     int seq, int micro) {
  RankResult out;
  const MeshShape& shape = c.shape;
  const ProcessGroupOptions group_options{.timeout = absl::Minutes(2)};
  auto group =
      NewProcessGroup(store, rank, shape.world(), v1::DEVICE_TYPE_CPU, "127.0.0.1", group_options);
  if (!group.ok()) {
    out.error = group.status().ToString();
    return out;
  }
  const JoinedGroup world{
      .store = store, .group = *group, .backend = "gloo", .hostname = "127.0.0.1"};
  auto created = DeviceMesh::Create(shape, rank, &world, group_options);
  if (!created.ok()) {
    out.error = created.status().ToString();
    return out;
  }
  const DeviceMesh mesh = *std::move(created);
  const int stage = mesh.coord(MeshDim::kPipeline), stages = shape.pp;
  const int layers_per_stage = c.dims.num_layers() / stages;
  out.stage = stage;
  out.dp_rank = mesh.coord(MeshDim::kData);
  out.tp_rank = mesh.coord(MeshDim::kTensor);
  const TensorParallel tp{.group = mesh.group(MeshDim::kTensor),
                          .rank = mesh.coord(MeshDim::kTensor),
                          .size = shape.tp,
                          .sequence_parallel = shape.tp > 1 && c.sequence_parallel};
  torch::manual_seed(1234);
  CausalLM model(c.dims, planner::kDefaultInitStd,
                 ModelPartition{.tp = tp,
                                .first_layer = stage * layers_per_stage,
                                .num_layers = layers_per_stage,
                                .embedding = stage == 0,
                                .head = stage == stages - 1});
  if (const auto& dp_group = mesh.group(MeshDim::kData)) {
    for (auto& param : model->parameters()) {
      std::vector<at::Tensor> tensors{param.data()};
      dp_group->broadcast(tensors)->wait();
    }
  }
  for (const auto& param : model->parameters()) out.parameters += param.numel();
  const int dp = shape.dp;
  for (int layer = -1; layer < layers_per_stage; ++layer) {
    int64_t numel = 0;
    bool decay = false, no_decay = false;
    for (const auto& [name, param] :
         model->LayerParameters(layer < 0 ? -1 : stage * layers_per_stage + layer)) {
      numel += param.numel();
      (param.dim() >= 2 ? decay : no_decay) = true;
    }
    const int64_t shard = (numel + dp - 1) / dp;
    out.stepped += c.zero == 0 ? numel
                               : std::min(numel, (out.dp_rank + 1) * shard) -
                                     std::min(numel, out.dp_rank * shard);
    out.shard_elements += c.zero == 0 ? numel : shard;
    out.worst_runs += (decay ? 1 : 0) + (no_decay ? 1 : 0);
  }
  ShardedEngine engine(model, ShardedEngineOptions{.zero_stage = c.zero,
                                                   .dp_group = mesh.group(MeshDim::kData),
                                                   .dp_rank = mesh.coord(MeshDim::kData),
                                                   .dp_size = mesh.size(MeshDim::kData),
                                                   .adamw = {.beta1 = 0.9, .beta2 = 0.95},
                                                   .weight_decay = 0.1,
                                                   .bf16 = false,
                                                   .sharded_collectives_as_all_reduce = true,
                                                   .tp = tp,
                                                   .world_group = world.group,
                                                   .pp_group = mesh.group(MeshDim::kPipeline),
                                                   .pp_stage = stage,
                                                   .pp_size = stages});
  out.memory = engine.Memory();
  if (stages == 1) {
    // The same tokens on every rank of the mesh (tp ranks must agree), from a generator of our
    // own: the global one is shared by the threads.
    at::Generator generator = at::detail::createCPUGenerator(7 + out.dp_rank);
    at::Tensor tokens = at::randint(c.dims.vocab_size(), {micro, seq + 1}, generator,
                                    at::TensorOptions().dtype(at::kLong));
    engine.ForwardBackward(tokens.narrow(1, 0, seq), tokens.narrow(1, 1, seq), 1.0 / shape.dp,
                           true);
    engine.Step(1e-3, 1.0);
    out.after_step = engine.Memory();
  }
  return out;
}

TEST(PlannerMemoryTest, TensorAndPipelineShardsMatchThePlannerPerRank) {
  // See ZeroShardsMatchThePlannerPerRank: c10d's FlightRecorder off before the first group.
  setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/1);
  const int seq = 16, micro = 2;
  for (const MeshCase& c : MeshCases()) {
    SCOPED_TRACE(c.name);
    const MeshShape& shape = c.shape;
    planner::Workload workload;
    workload.dims = c.dims;
    workload.seq_len = seq;
    workload.global_batch = int64_t{micro} * shape.dp;
    workload.precision = v1::PRECISION_FP32;
    const planner::LayoutChoice layout{.dp = shape.dp,
                                       .tp = shape.tp,
                                       .pp = shape.pp,
                                       .zero = c.zero,
                                       .micro_batch = micro,
                                       .sp = c.sequence_parallel};
    planner::ClusterShape cpu;
    cpu.device = *planner::DevicePreset("cpu");
    cpu.gpus = shape.world();
    cpu.gpus_per_node = shape.world();
    ASSERT_EQ(planner::InvalidReason(workload, layout, cpu), std::nullopt);
    const std::vector<v1::MemoryEstimate> estimates =
        planner::EstimateMemory(workload, layout, cpu);
    ASSERT_EQ(static_cast<int>(estimates.size()), shape.pp);

    auto store = c10::make_intrusive<c10d::HashStore>();
    std::vector<RankResult> results(shape.world());
    std::vector<std::thread> ranks;
    for (int rank = 0; rank < shape.world(); ++rank) {
      ranks.emplace_back([&, rank] {
        try {
          results[rank] = BuildRank(c, rank, store, seq, micro);
        } catch (const std::exception& e) {
          results[rank].error = e.what();
        }
      });
    }
    for (auto& thread : ranks) thread.join();

    for (int rank = 0; rank < shape.world(); ++rank) {
      SCOPED_TRACE(absl::StrCat("rank ", rank));
      const RankResult& r = results[rank];
      ASSERT_EQ(r.error, "");
      // The trainer's world layout: pipeline outermost, tensor innermost.
      EXPECT_EQ(DeviceMesh::RankAt(shape, {.pp = r.stage, .dp = r.dp_rank, .tp = r.tp_rank}), rank);
      const v1::MemoryEstimate& estimate = estimates.at(r.stage);
      const EngineMemory& m = r.memory;
      std::cout << c.name << " rank " << rank << " (pp " << r.stage << ", dp " << r.dp_rank
                << ", tp " << r.tp_rank << "): parameters " << r.parameters << " vs planner "
                << estimate.parameters() << "; weights " << m.parameter_bytes << " vs "
                << estimate.weights_bytes() << "; gradients " << m.gradient_bytes << " vs "
                << estimate.gradients_bytes() << "; moments " << m.moment_bytes << " (stepped "
                << r.stepped << " elements) + step counters " << m.step_counter_bytes << " = "
                << m.moment_bytes + m.step_counter_bytes << " vs optimizer "
                << estimate.optimizer_bytes() << " (step counters of the worst dp rank "
                << 4 * r.worst_runs << ", padding " << m.padding_elements << ")" << std::endl;
      EXPECT_EQ(r.parameters, estimate.parameters());
      EXPECT_EQ(m.parameter_bytes, estimate.weights_bytes());
      EXPECT_EQ(m.gradient_bytes, estimate.gradients_bytes());
      // AdamW's two float32 moments for exactly the elements the rank steps; the planner's
      // moments are those of the rank's whole shard (padding included) under ZeRO >= 1.
      EXPECT_EQ(m.moment_bytes, 8 * r.stepped);
      const int64_t planner_counters = estimate.optimizer_bytes() - 8 * r.shard_elements;
      // The rest of the planner's optimizer term: a float32 step counter per decay or no-decay
      // run of each unit, the stage's worst dp rank's count; this rank's can only be fewer.
      EXPECT_EQ(planner_counters, 4 * r.worst_runs);
      EXPECT_LE(m.step_counter_bytes, planner_counters);
      if (c.zero == 0) {
        EXPECT_EQ(m.step_counter_bytes, planner_counters);
      }
      if (r.after_step.has_value()) {
        // A step allocates no further model state.
        EXPECT_EQ(r.after_step->parameter_bytes, m.parameter_bytes);
        EXPECT_EQ(r.after_step->gradient_bytes, m.gradient_bytes);
        EXPECT_EQ(r.after_step->moment_bytes, m.moment_bytes);
        EXPECT_EQ(r.after_step->step_counter_bytes, m.step_counter_bytes);
      }
    }
    // The planner's counters are exact for the worst dp rank of each stage (and tp rank: the tp
    // ranks of a stage hold the same units): the rank whose shard of each unit straddles its
    // decay/no-decay boundary (for these shapes, dp rank 1, in every unit).
    for (int stage = 0; stage < shape.pp; ++stage) {
      for (int tp_rank = 0; tp_rank < shape.tp; ++tp_rank) {
        SCOPED_TRACE(absl::StrCat("stage ", stage, " tp rank ", tp_rank));
        int64_t worst = 0, planner_counters = -1;
        for (const RankResult& r : results) {
          if (r.stage != stage || r.tp_rank != tp_rank) continue;
          worst = std::max(worst, r.memory.step_counter_bytes);
          planner_counters = estimates.at(stage).optimizer_bytes() - 8 * r.shard_elements;
        }
        EXPECT_EQ(worst, planner_counters);
      }
    }
  }
}

// LoRA: the planner's terms for a LoRA workload (frozen base at its precision, float32 adapters
// with gradients and AdamW state) against the engine's bytes after a step, for every linear
// layer and for a subset of them; and only the adapters move while the base stays bit for bit.
TEST(PlannerMemoryTest, LoraStateMatchesThePlannerAndOnlyAdaptersTrain) {
  planner::ClusterShape cpu;
  cpu.device = *planner::DevicePreset("cpu");
  for (const auto& [name, dims] : Shapes()) {
    const bool gpt2 = dims.architecture() == v1::ARCHITECTURE_GPT2;
    for (const std::vector<std::string>& targets :
         {std::vector<std::string>{},
          gpt2 ? std::vector<std::string>{"attn.qkv", "mlp.proj"}
               : std::vector<std::string>{"attn.q", "mlp.down"}}) {
      SCOPED_TRACE(absl::StrCat(name, targets.empty() ? " all-linear" : " some layers"));
      v1::LoraSpec spec;
      spec.set_rank(4);
      for (const std::string& target : targets) spec.add_target_modules(target);
      auto lora = planner::ResolveLora(spec, dims);
      ASSERT_TRUE(lora.ok()) << lora.status();
      const int seq = 16, micro = 2;
      torch::manual_seed(7);
      CausalLM model(dims, planner::kDefaultInitStd);
      model->AddLora(LoraOptionsOf(*lora));
      std::map<std::string, at::Tensor> before;
      for (const auto& item : model->named_parameters()) before[item.key()] = item.value().clone();
      ShardedEngineOptions options;
      options.weight_decay = 0.1;
      ShardedEngine engine(model, options);
      at::Tensor tokens = torch::randint(dims.vocab_size(), {micro, seq + 1}, torch::kLong);
      for (int step = 0; step < 2; ++step) {
        engine.ForwardBackward(tokens.narrow(1, 0, seq), tokens.narrow(1, 1, seq), 1.0, true);
        engine.Step(1e-2, 1.0);
      }
      int adapters = 0;
      for (const auto& item : model->named_parameters()) {
        const bool equal = torch::equal(before.at(item.key()), item.value());
        if (IsLoraParameter(item.key())) {
          ++adapters;
          EXPECT_FALSE(equal) << item.key() << " did not train";
        } else {
          EXPECT_TRUE(equal) << item.key() << " is frozen but changed";
          EXPECT_FALSE(item.value().grad().defined()) << item.key();
        }
      }
      EXPECT_EQ(adapters, 2 * dims.num_layers() * static_cast<int>(lora->targets.size()));

      planner::Workload workload;
      workload.dims = dims;
      workload.seq_len = seq;
      workload.global_batch = micro;
      workload.precision = v1::PRECISION_FP32;
      workload.lora_rank = lora->rank;
      workload.lora_layer_parameters = lora->parameters_per_layer;
      const planner::LayoutChoice layout{.micro_batch = micro};
      const v1::MemoryEstimate estimate = planner::EstimateMemory(workload, layout, cpu).at(0);
      const EngineMemory memory = engine.Memory();
      EXPECT_EQ(memory.parameter_bytes, 4 * lora->parameters_per_layer * dims.num_layers());
      EXPECT_EQ(estimate.weights_bytes(), memory.parameter_bytes + memory.frozen_bytes);
      EXPECT_EQ(estimate.gradients_bytes(), memory.gradient_bytes);
      EXPECT_EQ(estimate.optimizer_bytes(), memory.moment_bytes + memory.step_counter_bytes);
    }
  }
}

}  // namespace
}  // namespace tessera::trainer

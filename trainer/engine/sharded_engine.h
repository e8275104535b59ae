// The step engine of a data-parallel group: how a rank turns micro-batches into an optimizer step
// with ZeRO stage 0, 1, 2 or 3 (Rajbhandari et al. 2020), on c10d collectives over the mesh's dp
// group (Gloo on CPU, NCCL on CUDA), or alone when dp is 1.
//
// Parameters live in flat float32 buffers, one per unit: each transformer layer is a unit, and
// everything else (embeddings, final norm, head) is the "outer" unit. With expert parallelism each
// layer's routed experts form one more unit, after the layers, over the edp group instead of dp
// (a unit's group, rank and size below mean dp for the others). A unit's buffer is padded to
// a multiple of dp and split into dp equal shards; rank r owns shard r. The model's parameters are
// views into the buffers, ordered within a unit by decay group (matrices, then biases and norms),
// so a shard holds at most two optimizer runs. As in FSDP and DeepSpeed, collectives move whole
// flat buffers, never tensor by tensor.
//
//   stage 0: full gradients (the parameters' .grad are views into a flat buffer per unit),
//            all-reduced per unit as backward finishes it (overlapped with the rest of backward,
//            like DDP's buckets), on the last micro-batch only; AdamW on the whole model.
//   stage 1: same gradients, reduce-scattered instead; AdamW on the owned shard; the updated
//            shards all-gathered into the full parameters after the step.
//   stage 2: gradients reduce-scattered per unit on every micro-batch and accumulated into the
//            owned shard; a unit's full gradients live only until their reduce-scatter is sent.
//   stage 3: parameters sharded too: a layer's full parameters are all-gathered just before its
//            forward (the next layer's gather is prefetched while it computes) and freed after;
//            gathered again (prefetching the layer below) when backward reaches the layer, and
//            freed once its gradients are reduce-scattered. The outer unit stays gathered from the
//            start of forward to the end of backward (its embedding is also the tied head).
// At most two reduce-scatters (or all-reduces) are in flight; the oldest is finished before a
// third starts, which bounds the transient full gradients to two units.
//
// Thread safety: one thread drives it (the training loop); autograd hooks run on the autograd
// engine's thread while that thread waits inside backward().
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "trainer/engine/adamw.h"
#include "trainer/model/model.h"
#include "trainer/parallel/collective_timer.h"
#include "trainer/parallel/expert_parallel.h"
#include "trainer/parallel/tensor_parallel.h"
#include "trainer/torch_pch.h"

namespace tessera::trainer {

struct ShardedEngineOptions {
  int zero_stage = 0;
  // The mesh's dp group, null when dp_size is 1.
  c10::intrusive_ptr<c10d::ProcessGroup> dp_group;
  int dp_rank = 0;
  int dp_size = 1;
  AdamWOptions adamw;
  double weight_decay = 0;
  // bf16 autocast on CUDA around forward.
  bool bf16 = false;
  // Reduce-scatter as an in-place all-reduce keeping the owned shard, and all-gather as an
  // in-place all-reduce of the shards laid out over zeros. Gloo's reduce-scatter and all-gather
  // on CPU allocate and copy more than its ring all-reduce (bench/zero_bench.py: fewer page
  // faults and a faster step with this), so the trainer sets it on Gloo; on NCCL the real
  // collectives move half the bytes.
  bool sharded_collectives_as_all_reduce = false;
  // Reduce-scatters / all-reduces allowed in flight before the oldest is waited for.
  int max_in_flight = 2;
  // Tensor parallelism of the model (the same as its ModelPartition's). With sequence
  // parallelism, the replicated parameters' gradients are summed over tp before the dp reduction.
  TensorParallel tp;
  // The group of every rank of the job (null for one rank): the global gradient norm is summed
  // over it, each element counted once.
  c10::intrusive_ptr<c10d::ProcessGroup> world_group;
  // The pipeline group (null without pipeline parallelism) and this rank's stage in it. With
  // tied embeddings, the first stage's embed.weight and the last stage's copy get the sum of both
  // gradients (an all-reduce over the pipeline group, middle stages adding zeros) before the dp
  // reduction, which for that unit waits until Step.
  c10::intrusive_ptr<c10d::ProcessGroup> pp_group;
  int pp_stage = 0;
  int pp_size = 1;
  // Replay each micro-batch's forward and backward as a CUDA graph (--cuda_graphs): one launch
  // instead of ~700 kernel launches from the host. It applies to a CUDA rank alone (dp, tp and
  // pp 1), ZeRO 0 or 1, without activation checkpointing, for micro-batches of the captured
  // shape without packed-record positions; anything else runs eagerly. After a few eager
  // micro-batches the first one of a step runs eagerly, is captured, replayed on the same
  // tensors, and the replay is kept only if its loss and per-unit gradient norms match the eager
  // run's (CudaGraphStatus() says what happened). In this mode the flat gradients are zeroed at
  // the start of each step and every backward accumulates into them (no first-backward copy).
  bool cuda_graphs = false;
  // Where a model of ParameterStorage::kDeferred gets its memory (its parameters carry none).
  at::Device device = at::kCPU;
  // Expert parallelism (the model's ModelPartition::ep): each layer's routed expert tensors
  // (IsExpertParameter) are this rank's ep shard and go into a unit of their own, reduced and
  // sharded over the edp group (the dp ranks holding the same experts) instead of dp. ZeRO 0
  // and 1 only.
  ExpertParallel ep;
  c10::intrusive_ptr<c10d::ProcessGroup> edp_group;  // null when edp_size is 1
  int edp_rank = 0;
  int edp_size = 1;
};

// Bytes this rank holds for its shard of the training state (what the planner's memory terms
// describe): parameters, gradients, AdamW moments and step counters. Transient buffers (a unit
// gathered in ZeRO-3, a unit's full gradients on the way to its reduce-scatter) are not counted.
struct EngineMemory {
  int64_t parameter_bytes = 0;
  int64_t gradient_bytes = 0;
  int64_t moment_bytes = 0;
  int64_t step_counter_bytes = 0;
  // Elements added to pad units to a multiple of dp, all units together.
  int64_t padding_elements = 0;
  // Parameters without gradients (LoRA's frozen base), in the dtype they are held in; not part
  // of parameter_bytes.
  int64_t frozen_bytes = 0;
};

// A contiguous range of one model tensor's row-major flattened elements, as a 1-D float32 view.
struct TensorRange {
  // "model/<parameter name>", "exp_avg/<name>" or "exp_avg_sq/<name>".
  std::string name;
  std::vector<int64_t> global_shape;
  int64_t offset = 0;
  at::Tensor data;  // 1-D, data.numel() elements starting at `offset`
  // The block of the tensor the range lies in, for tensor-parallel shards: a box of `box_shape`
  // elements at `box_offset` in the global tensor. Both empty: the whole tensor. `offset` counts
  // in the box's row-major flattening.
  std::vector<int64_t> box_offset = {};
  std::vector<int64_t> box_shape = {};
};

class ShardedEngine : public LayerHooks {
 public:
  // Takes over `model`'s trainable parameters (they become views into the engine's buffers; frozen
  // ones, requires_grad false, are left alone) and builds the optimizer. Every rank of the dp
  // group must call it on an identically initialised model. A model of ParameterStorage::kDeferred
  // (ZeRO-3 only) gets its buffers on options.device, its owned shards zero until
  // InitializeShards fills them: no rank holds more than its shards and one unit in full.
  ShardedEngine(CausalLM model, const ShardedEngineOptions& options);
  ~ShardedEngine() override;
  ShardedEngine(const ShardedEngine&) = delete;
  ShardedEngine& operator=(const ShardedEngine&) = delete;

  // Forward and backward of one micro-batch. The gradient is that of loss * `scale` summed over
  // the dp group (pass 1 / (accumulation * dp) for the mean over the global batch). `last` marks
  // the step's last micro-batch. Returns the unscaled loss, detached. `positions`: undefined, or
  // the tokens' positions in their records (CausalLM::StageForward).
  at::Tensor ForwardBackward(const at::Tensor& inputs, const at::Tensor& targets, double scale,
                             bool last, const at::Tensor& positions = {});
  // Host seconds the last ForwardBackward spent in its forward (the loss included), for the step
  // timer to split it from the backward; 0 after a CUDA graph replay, which runs both as one.
  double last_forward_seconds() const { return last_forward_seconds_; }

  // Finishes the gradient reduction, clips the global gradient norm to `clip_norm` (infinity:
  // no clipping), steps AdamW at `lr` and zeroes the gradients. Returns the norm before clipping.
  // With `update` false (a step whose global batch has no counted target) AdamW does not step:
  // parameters, moments and AdamW's step counter stay as they are; the collectives still run,
  // so every rank of the job must pass the same `update`. `accept`, when set, sees the norm before
  // anything is applied and may withhold the update (the loss-spike guard); it must answer the
  // same on every rank (it may run a collective to agree).
  double Step(double lr, double clip_norm, bool update = true,
              const std::function<bool(double norm)>& accept = {});

  // The mean loss of a batch without gradients (ZeRO-3 gathers layer by layer as in training).
  at::Tensor EvalLoss(const at::Tensor& inputs, const at::Tensor& targets,
                      const at::Tensor& positions = {});

  // Pipeline stages: the stage's forward of one micro-batch (under the engine's autocast), and
  // the backward from its output: `grad` is the next stage's gradient for it, or undefined on
  // the last stage, whose output is the loss (then loss * scale is differentiated). `last` marks
  // the step's last backward through the layers it reaches (ZeRO 0/1 reduce them then): with
  // interleaved stages, the last backward of each of the stage's chunks. `chunk`: the model's
  // chunk the forward runs (CausalLMImpl::StageForward).
  at::Tensor ForwardStage(const at::Tensor& input, const at::Tensor& targets,
                          const at::Tensor& positions = {}, int chunk = 0);
  void BackwardStage(const at::Tensor& output, const at::Tensor& grad, double scale, bool last);

  EngineMemory Memory() const;

  // A kDeferred model: fills this rank's owned shard of every unit from `values`, asking only for
  // the parameters the shard overlaps (about 1/dp of them), one at a time. INVALID_ARGUMENT
  // naming the parameter when a value has another shape; `values`' own errors as they come.
  // FAILED_PRECONDITION for a model built with its parameters.
  absl::Status InitializeShards(const ParameterValues& values);

  // What this rank writes to a checkpoint: its owned range of every parameter and of both AdamW
  // moments (under ZeRO 0 too, so that the dp replicas write 1/dp each, not dp copies).
  std::vector<TensorRange> SaveRanges();
  // Where this rank reads a checkpoint into: the parameters it keeps (all of them below ZeRO-3,
  // its shard under ZeRO-3) and the moments it steps.
  std::vector<TensorRange> LoadRanges();
  // Whether `name` ("model/<parameter>", "exp_avg/<parameter>", "exp_avg_sq/<parameter>") is a
  // tensor of this model, on whichever rank it lives.
  bool Knows(const std::string& name) const;
  // AdamW's step counter (the same for every parameter).
  int64_t optimizer_step() const;
  void set_optimizer_step(int64_t step);

  // LayerHooks (ZeRO-3's gathers and frees).
  void BeforeLayer(int layer) override;
  torch::Tensor AfterLayer(int layer, torch::Tensor output) override;

  // Called by the parameters' post-accumulate-grad hooks: parameter `entry` of `unit` has its
  // gradient of this backward.
  void OnGradientReady(int unit, int entry);

  // With cuda_graphs: "off: <why>", "warming up", or "replaying (captured at micro-batch N)";
  // empty without cuda_graphs.
  std::string CudaGraphStatus() const;

 private:
  struct Entry {
    std::string name;
    at::Tensor param;  // the model's parameter, a view into its unit's buffer
    std::vector<int64_t> shape;
    int64_t offset = 0;  // in the unit's flat buffer
    int64_t numel = 0;
    bool decay = false;
    // Where its elements lie in the global tensor (tensor-parallel shards).
    std::vector<ShardPiece> pieces;
    // Whole on every tp rank (norms, row-parallel biases, position embeddings) when tp > 1.
    bool replicated = false;
    // Written to checkpoints by this rank: not by tp ranks other than 0 for replicated
    // parameters, nor by the last pipeline stage for its copy of a tied embedding.
    bool saved = true;
    // Its share of the global gradient norm: 0 for a tied copy, 1 / tp when replicated.
    double norm_share = 1;
    // ZeRO 0/1, during the first backward of a step: its gradient is in the flat buffer.
    bool arrived = false;
  };
  struct Run {
    int unit = 0;
    int64_t begin = 0;  // [begin, end) in the unit's flat coordinates
    int64_t end = 0;
    bool decay = false;
    at::Tensor param;        // leaf view the optimizer steps; its grad is set to the matching view
    size_t state_index = 0;  // position in its AdamW group (0 decay, 1 no decay)
  };
  enum class GatherState { kFreed, kGathering, kGathered };
  struct Unit {
    std::vector<Entry> entries;
    // The ranks the unit's gradients are reduced over and its shards split between: dp, or edp
    // for an expert unit. Null group when size is 1.
    c10::intrusive_ptr<c10d::ProcessGroup> group;
    int rank = 0;
    int size = 1;
    int64_t numel = 0;
    int64_t padded = 0;
    int64_t shard = 0;      // padded / size
    int64_t decay_end = 0;  // entries [0, decay_end) decay
    at::Tensor full;        // [padded]: the parameters' storage (freed between uses in ZeRO-3)
    at::Tensor owned;       // [shard]: the owned parameters (a view of full below ZeRO-3)
    at::Tensor full_grad;   // [padded], ZeRO 0/1
    at::Tensor shard_grad;  // [shard], ZeRO 2/3 (a view of full_grad in ZeRO 1)
    int ready = 0;          // parameters whose gradient arrived this backward
    GatherState gather = GatherState::kFreed;
    c10::intrusive_ptr<c10d::Work> gather_work;
    CollectiveIssue gather_issue;
  };
  struct Pending {
    int unit = 0;
    c10::intrusive_ptr<c10d::Work> work;
    CollectiveIssue issue;
    at::Tensor input;   // kept alive until the collective finishes
    at::Tensor output;  // reduce-scatter result to accumulate into the unit's shard gradient
  };

  int stage() const { return options_.zero_stage; }
  int64_t OwnedBegin(const Unit& unit) const { return unit.rank * unit.shard; }
  void BuildUnits();
  void BuildRuns();
  void AllocateFull(Unit& unit);
  void StartGather(int unit);
  // Gathers every rank's `shard` of `unit` into unit.full (asynchronously); `*issue` marks the
  // collective for its wait (collective_timer.h).
  c10::intrusive_ptr<c10d::Work> GatherInto(Unit& unit, const at::Tensor& shard,
                                            CollectiveIssue* issue);
  void EnsureGathered(int unit);
  void Free(int unit);
  void ReduceUnit(int unit);
  void FinishOldest();
  void FinishAll();
  // ZeRO 0/1: marks the flat gradients as holding nothing; the next backward writes them.
  void ZeroGradients();
  // ZeRO 0/1: the first backward after ZeroGradients() runs with the parameters' .grad undefined,
  // and each gradient autograd delivers is copied into the parameter's place in the flat buffer
  // (OnGradientReady), which becomes its .grad again; EndFirstBackward zeroes the places of
  // parameters that got none. Later backwards accumulate into the buffer as autograd does.
  void BeginFirstBackward();
  void EndFirstBackward();
  // Ends the first backward however backward() leaves (an exception included).
  class FirstBackwardScope {
   public:
    explicit FirstBackwardScope(ShardedEngine* engine) : engine_(engine) {}
    ~FirstBackwardScope() { engine_->EndFirstBackward(); }
    FirstBackwardScope(const FirstBackwardScope&) = delete;
    FirstBackwardScope& operator=(const FirstBackwardScope&) = delete;

   private:
    ShardedEngine* engine_;
  };
  // The view of `entry`'s gradient in the unit's flat buffer (ZeRO 0/1).
  static at::Tensor GradientView(const Unit& unit, const Entry& entry);
  // Sequence parallelism: sums the replicated parameters' gradients of `unit` over tp.
  void SumReplicatedGradients(int unit);
  // Pipeline with tied embeddings: sums the two copies' gradients over the pipeline group.
  void SumTiedEmbeddingGradients();
  bool defer_outer_unit() const { return options_.pp_size > 1 && model_->dims().tie_embeddings(); }
  // Reusable CPU buffers: glibc maps every block above 32 MiB afresh and unmaps it on free, so
  // without reuse each gathered layer or flattened gradient costs page faults for all its bytes,
  // every step (bench/zero_bench.py measured 4.5M minor faults per rank over 5 ZeRO-3 steps).
  // On CUDA the caching allocator reuses blocks already, and nothing is kept here.
  at::Tensor TakeBuffer(int64_t numel, const at::TensorOptions& options);
  void GiveBuffer(at::Tensor buffer);
  // Appends the ranges of elements [from, to) (unit coordinates, inside `entry`) of unit `u`:
  // the parameter values when `values`, AdamW's moments from the run holding them when
  // `moments`. Nothing when from >= to.
  void AppendRanges(int u, const Entry& entry, int64_t from, int64_t to, bool values, bool moments,
                    std::vector<TensorRange>* out);

  CausalLM model_;
  ShardedEngineOptions options_;
  std::vector<Unit> units_;  // units_[0] is the outer unit, units_[1 + i] layer i
  std::vector<Run> runs_;
  std::set<std::string> names_;  // every parameter name of the whole model
  // The gradient views this rank steps, grouped by their share of the global norm.
  std::map<double, std::vector<at::Tensor>> norm_groups_;
  std::unique_ptr<FusedAdamW> optimizer_;
  std::deque<Pending> pending_;
  // Spare CPU buffers by element count, and spare ZeRO-3 unit storage by bytes, at most
  // kSpareBuffers of each size (the engine never holds more than two units' worth in flight).
  static constexpr int kSpareBuffers = 3;
  std::map<int64_t, std::vector<at::Tensor>> spare_buffers_;
  std::map<size_t, std::vector<at::DataPtr>> spare_storage_;
  // The CUDA graph of a micro-batch (cuda_graphs): null when the option is off or this rank is
  // not eligible.
  struct CudaGraph;
  std::unique_ptr<CudaGraph> graph_;
  std::string graph_status_;
  at::Tensor EagerForwardBackward(const at::Tensor& inputs, const at::Tensor& targets, double scale,
                                  const at::Tensor& positions);
  // Replays (or captures and checks) the graph for this micro-batch; nullopt: run it eagerly.
  std::optional<at::Tensor> GraphForwardBackward(const at::Tensor& inputs,
                                                 const at::Tensor& targets, double scale,
                                                 const at::Tensor& positions);
  // cuda_graphs: zeroes the flat gradients and makes every parameter's .grad its view in them.
  void PrepareGradientsForAccumulation();
  // Per unit, the L1 and L2 norms of the flat gradients (the capture's check).
  std::vector<double> GradientSignature();
  bool last_micro_batch_ = true;
  double last_forward_seconds_ = 0;
  // ZeRO 0/1: the flat gradients hold nothing since the last step (the buffers start zeroed).
  bool gradients_empty_ = false;
  // ZeRO 0/1: inside the first backward after ZeroGradients().
  bool writing_first_gradients_ = false;
};

}  // namespace tessera::trainer

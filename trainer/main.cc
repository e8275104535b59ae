// tessera-trainer: the process that trains one rank of a job. Launched by a
// worker with a task file, or run standalone from flags.
#include <atomic>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "client/job_spec_file.h"
#include "common/command_line.h"
#include "common/trainer_env.h"
#include "coordinator/admission/job_validation.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/util/json_util.h"
#include "planner/lora.h"
#include "planner/model_config.h"
#include "planner/training_settings.h"
#include "trainer/data/prepare.h"
#include "trainer/io/safetensors.h"
#include "trainer/kernels/device.h"
#include "trainer/kernels/fused_ops.h"
#include "trainer/model/hf_weights.h"
#include "trainer/model/model.h"
#include "trainer/parallel/collective_timer.h"
#include "trainer/parallel/distributed.h"
#include "trainer/parallel/mesh.h"
#include "trainer/report/heartbeat.h"
#include "trainer/report/reporter.h"
#include "trainer/report/worker_lifeline.h"
#include "trainer/runtime/self_check.h"
#include "trainer/runtime/train.h"

ABSL_FLAG(std::string, task, "",
          "TrainerTask file written by the worker: binary protobuf, or JSON (.json) or text "
          "format (.txtpb).");
ABSL_FLAG(std::string, job_spec, "",
          "A job spec file (YAML or JSON, what `tessera submit` takes; ${VAR} expanded from the "
          "environment), validated, resolved and planned as the coordinator does a submitted job "
          "(coordinator::PlanJob): this process runs it as one rank, or as the rank torchrun's "
          "environment names (RANK, WORLD_SIZE), which must match the ranks the spec's resources "
          "ask for. An automatic layout is data parallel over them (the coordinator's plan before "
          "it knows the cluster).");
ABSL_FLAG(bool, check, false,
          "Train a small MLP for a few AdamW steps on --gpu (or the CPU) and print the result as "
          "one JSON line; exit 0 when the loss falls.");
ABSL_FLAG(int, gpu, -1, "CUDA device ordinal for --check and standalone runs; -1 uses the CPU.");
ABSL_FLAG(bool, fused_kernels, true,
          "Run RMSNorm, LayerNorm, rotary embedding, SwiGLU and the head's cross-entropy as fused "
          "CUDA kernels on a GPU, and RMSNorm, rotary embedding, SwiGLU and GELU as fused float32 "
          "kernels on the CPU; false runs ATen's ops (on the CPU bit for bit as eager PyTorch).");
ABSL_FLAG(bool, cuda_graphs, false,
          "Replay each micro-batch's forward and backward as a CUDA graph: a rank alone on a GPU "
          "(dp, tp, pp 1), ZeRO 0 or 1, no activation checkpointing. The first capture is checked "
          "against an eager run of the same micro-batch and dropped if they differ; the log says "
          "what happened. Elsewhere it changes nothing.");
ABSL_FLAG(bool, step_breakdown, true,
          "Measure where each step's time goes (forward, backward, optimizer, data wait, "
          "checkpoint, collectives by kind and mesh dimension), report it with every rank's step "
          "and log its summary; false measures nothing.");
ABSL_FLAG(bool, collective_probe, false,
          "With --step_breakdown: precede every collective that its whole group issues with a "
          "barrier on the group and wait for it right after its issue, so that the breakdown "
          "separates the wait for the slowest peer (peer_wait_seconds) from the transfer "
          "(seconds). Slows training: for measurements, e.g. bench/planner_fit_bench.py.");
ABSL_FLAG(std::string, profile_dir, "",
          "Record a profile of --profile_steps training steps (operators, and on a GPU every "
          "kernel and copy) and write it to DIR/trace-rank-R.json as a Chrome trace "
          "(bench/profile_summary.py summarises it); empty: no profile.");
ABSL_FLAG(std::string, profile_steps, "3:3",
          "With --profile_dir: FIRST:COUNT, the 1-based first step recorded and how many.");
// Standalone training (no --task).
ABSL_FLAG(std::string, preset, "tiny-gpt2", "Standalone: model preset.");
ABSL_FLAG(std::vector<std::string>, data, {}, "Standalone: training shard paths or globs.");
ABSL_FLAG(std::vector<std::string>, val_data, {},
          "Standalone: validation shard paths or globs (evaluated every --eval_every steps).");
ABSL_FLAG(int64_t, eval_every, 0, "Standalone: evaluation interval in steps; 0 never.");
ABSL_FLAG(int, eval_batches, 20, "Standalone: micro-batches per rank per evaluation.");
ABSL_FLAG(int, seq_len, 128, "Standalone: tokens per sequence.");
ABSL_FLAG(int64_t, global_batch, 16, "Standalone: sequences per optimizer step (whole job).");
ABSL_FLAG(int, micro_batch, 4, "Standalone: sequences per rank per forward/backward.");
ABSL_FLAG(int64_t, steps, 50, "Standalone: optimizer steps (also the step count of --check).");
ABSL_FLAG(double, lr, 3e-3, "Standalone: peak learning rate.");
ABSL_FLAG(int64_t, warmup, 10, "Standalone: warmup steps.");
ABSL_FLAG(int64_t, decay_steps, 0, "Standalone: step where cosine decay ends; 0 = --steps.");
ABSL_FLAG(double, min_lr_ratio, 0.1, "Standalone: floor of the cosine decay, fraction of peak.");
ABSL_FLAG(double, weight_decay, 0.1, "Standalone: AdamW weight decay.");
ABSL_FLAG(double, grad_clip, 1.0, "Standalone: global gradient-norm clip; 0 disables.");
ABSL_FLAG(uint64_t, seed, tessera::planner::kDefaultSeed,
          "Standalone: seed of initialisation and data order.");
ABSL_FLAG(std::string, checkpoint_dir, "", "Standalone: checkpoint directory; empty: none.");
ABSL_FLAG(int64_t, checkpoint_every, 0, "Standalone: checkpoint interval in steps.");
ABSL_FLAG(int, keep_last, 0, "Standalone: checkpoints kept; 0 keeps all.");
ABSL_FLAG(bool, resume, true, "Standalone: resume from the newest complete checkpoint.");
ABSL_FLAG(bool, export_safetensors, false, "Standalone: export the final weights.");
ABSL_FLAG(std::string, export_format, "",
          "Standalone: the final export's format (checkpoint.export_format): tessera, or hf for a "
          "Hugging Face directory under <checkpoint_dir>/export/hf (the PEFT adapter with LoRA); "
          "empty: tessera when --export_safetensors.");
ABSL_FLAG(bool, export_merged, false,
          "Standalone: with --export_format=hf and LoRA, also write the base with the adapters "
          "merged in under <checkpoint_dir>/export/hf-merged.");
ABSL_FLAG(int, zero_stage, 0,
          "Standalone: ZeRO stage over the data-parallel ranks (0 none, 1 optimizer state, 2 + "
          "gradients, 3 + parameters).");
ABSL_FLAG(int, num_layers, 0, "Standalone: override the preset's number of layers; 0 keeps it.");
ABSL_FLAG(int, tensor_parallel, 1,
          "Standalone: tensor-parallel degree (consecutive ranks; must divide the attention heads, "
          "key/value heads and ffn_hidden_size).");
ABSL_FLAG(bool, sequence_parallel, false,
          "Standalone: split norms and activations between tensor-parallel regions along the "
          "sequence (needs --tensor_parallel > 1).");
ABSL_FLAG(int, context_parallel, 1,
          "Standalone: context-parallel degree (ring attention over the sequence; 2 x it must "
          "divide --seq_len).");
ABSL_FLAG(int, pipeline_parallel, 1,
          "Standalone: pipeline stages (1F1B; must divide the layers). Data parallelism is the "
          "rest of the world size.");
ABSL_FLAG(int, pipeline_virtual_stages, 1,
          "Standalone: model chunks per pipeline stage (interleaved 1F1B when > 1; must divide "
          "each stage's layers, and the micro-batches per step must be a multiple of "
          "--pipeline_parallel).");
// Expert parallelism, and a mixture-of-experts variant of a Llama-family preset to use it on.
ABSL_FLAG(int, expert_parallel, 1,
          "Standalone: expert-parallel degree (blocks of consecutive data-parallel ranks split each "
          "layer's experts; must divide the data-parallel degree and --num_experts).");
ABSL_FLAG(int, num_experts, 0,
          "Standalone: make every block of a Llama-family preset a mixture of this many experts "
          "(0 keeps the preset's).");
ABSL_FLAG(int, experts_per_token, 2, "Standalone: with --num_experts, the experts each token uses.");
ABSL_FLAG(double, router_aux_loss_coef, 0,
          "Standalone: with --num_experts, the weight of the routers' load-balancing loss in the "
          "training loss.");
ABSL_FLAG(std::string, activation_checkpointing, "none",
          "Standalone: activation recomputation: none, selective or full.");
ABSL_FLAG(std::string, job_id, "standalone", "Standalone: job id in reports and checkpoints.");
ABSL_FLAG(std::string, export_initial, "",
          "With --task or standalone flags: write the weights the run would start step 1 from "
          "(a fresh run, no resume) to this safetensors file, float32 and named as "
          "--export_safetensors names them, with the resolved model in its metadata; then exit "
          "without training. For comparing against other implementations.");
// tessera-trainer prepare
ABSL_FLAG(std::string, init_from, "",
          "Standalone: a Hugging Face model directory (config.json + safetensors of a "
          "LlamaForCausalLM, Qwen3ForCausalLM or GPT2LMHeadModel) to start from instead of "
          "--preset (the spec's model.from_pretrained).");
ABSL_FLAG(std::string, weights, "",
          "With --export_hf / --logits_out: a Tessera safetensors export (a checkpoint's "
          "model.safetensors, --export_initial) of the model --preset / --init_from describe, "
          "to load instead of --init_from's or the seeded initial weights.");
ABSL_FLAG(std::string, export_hf, "",
          "Write the model (--init_from, --weights or the seeded initial weights) to this "
          "directory as a Hugging Face model (config.json, model.safetensors, "
          "generation_config.json) that transformers loads; then exit.");
ABSL_FLAG(double, epochs, 0,
          "Standalone: passes over the training data to train instead of --steps (the spec's "
          "epochs); 0 uses --steps.");
ABSL_FLAG(std::string, guard, "",
          "Standalone: the loss-spike guard, a GuardSpec in protobuf text format, e.g. "
          "'loss_spike_factor: 5 window: 8 skipped { step: 120 batches: 2 }'; empty: none.");
ABSL_FLAG(int, lora_rank, 0,
          "Standalone: LoRA adapter rank (the spec's lora.rank); 0 trains every weight.");
ABSL_FLAG(double, lora_alpha, 0, "Standalone: LoRA alpha; 0 means 2 * rank.");
ABSL_FLAG(double, lora_dropout, 0, "Standalone: dropout on the LoRA adapters' input.");
ABSL_FLAG(std::vector<std::string>, lora_targets, {},
          "Standalone: the linear layers that get adapters (q_proj, v_proj, ..., c_attn, ...); "
          "empty: all-linear.");
ABSL_FLAG(bool, lora_nf4, false,
          "Standalone: QLoRA, the frozen base's block linear weights held in NF4 (the spec's "
          "lora.base_quantization = LORA_BASE_QUANTIZATION_NF4); needs --lora_rank.");
ABSL_FLAG(std::string, lora_adapter, "",
          "With --export_hf / --logits_out: a PEFT LoRA adapter directory (adapter_config.json, "
          "adapter_model.safetensors; a LoRA job's final checkpoint holds one in adapter/) to "
          "apply to the model; --export_hf then merges it into the weights.");
ABSL_FLAG(std::vector<std::string>, logits_tokens, {},
          "With --logits_out: token ids of one sequence to run the model on.");
ABSL_FLAG(std::string, logits_out, "",
          "Write the float32 logits [1, len(--logits_tokens), vocab] of the model (as for "
          "--export_hf) to this safetensors file under 'logits'; then exit.");
ABSL_FLAG(std::vector<std::string>, input, {}, "prepare: input .txt / .jsonl files.");
ABSL_FLAG(std::string, output_dir, "", "prepare: directory for the token shards.");
ABSL_FLAG(std::string, tokenizer, "byte",
          "prepare: 'byte', a sentencepiece .model path, or a Hugging Face tokenizer.json (or "
          "a model directory holding one; runs in $TESSERA_PYTHON's `tokenizers` package).");
ABSL_FLAG(std::string, eos_token, "",
          "prepare: with a tokenizer.json, the added token that ends documents (default: "
          "<|end_of_text|>, <|endoftext|>, </s>, ... whichever the tokenizer has).");
ABSL_FLAG(std::string, format, "auto", "prepare: text, jsonl or auto (by extension).");
ABSL_FLAG(double, val_fraction, 0.05, "prepare: fraction of tokens held out for validation.");
ABSL_FLAG(std::string, prompt_template, "alpaca",
          "prepare: how JSONL Alpaca records {instruction, input, output} become prompt and "
          "response: 'alpaca' (Stanford Alpaca's template) or 'chat' (role tags, as chat "
          "records {messages: [{role, content}...]} always are). Only response tokens count in "
          "the loss.");
ABSL_FLAG(int, sample_seq_len, 0,
          "prepare: write every record as one sample of N + 1 tokens (truncated, or padded with "
          "eos that does not count); training must then use --seq_len=N. 0: one token stream.");
ABSL_FLAG(bool, pack, false,
          "prepare: with --sample_seq_len, put several short records into one sample; the shards "
          "mark where each begins, and training keeps them from attending to one another.");

namespace {

constexpr char kUsage[] =
    "Usage: tessera-trainer --task=PATH\n"
    "       tessera-trainer --job_spec=FILE   (a job spec, resolved as the coordinator does)\n"
    "       tessera-trainer --data=GLOB [--preset=NAME --steps=N ...]   (standalone)\n"
    "       tessera-trainer prepare --input=FILES --output_dir=DIR [--tokenizer=byte|PATH]\n"
    "                               [--prompt_template=alpaca|chat --sample_seq_len=N [--pack]]\n"
    "       tessera-trainer --check [--gpu=N]\n"
    "       tessera-trainer --init_from=HF_DIR [--data=GLOB ...]   (from Hugging Face weights)\n"
    "       tessera-trainer [--init_from=HF_DIR | --preset=NAME --weights=FILE] --export_hf=DIR\n\n"
    "Trains one rank of a Tessera job on LibTorch. With --task it runs what the worker\n"
    "wrote; standalone it builds the task from flags and prints reports as JSON lines.\n"
    "RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (default\n"
    "29500), as set by torchrun or the worker, place the process in a multi-process job (Gloo\n"
    "on CPU, NCCL on GPU) and override the task's assignment; the worker also sets\n"
    "CUDA_VISIBLE_DEVICES to the rank's GPU (common/trainer_env.h has the contract).\n"
    "`prepare` tokenizes text or JSONL into token shards.\n";

absl::StatusOr<tessera::v1::TrainerTask> ReadTask(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("--task ", path, ": cannot open"));
  std::stringstream buffer;
  buffer << in.rdbuf();
  tessera::v1::TrainerTask task;
  if (absl::EndsWith(path, ".json")) {
    auto status = google::protobuf::util::JsonStringToMessage(buffer.str(), &task);
    if (!status.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--task ", path, ": ", status.ToString()));
    }
  } else if (absl::EndsWith(path, ".txtpb") || absl::EndsWith(path, ".textproto")) {
    if (!google::protobuf::TextFormat::ParseFromString(buffer.str(), &task)) {
      return absl::InvalidArgumentError(absl::StrCat("--task ", path, ": not a text TrainerTask"));
    }
  } else if (!task.ParseFromString(buffer.str())) {
    return absl::InvalidArgumentError(absl::StrCat("--task ", path, ": not a binary TrainerTask"));
  }
  return task;
}

tessera::v1::TrainerTask TaskFromFlags() {
  tessera::v1::TrainerTask task;
  task.set_job_id(absl::GetFlag(FLAGS_job_id));
  tessera::v1::JobSpec* spec = task.mutable_spec();
  spec->set_name(absl::GetFlag(FLAGS_job_id));
  spec->mutable_model()->set_preset(absl::GetFlag(FLAGS_preset));
  if (!absl::GetFlag(FLAGS_init_from).empty()) {
    if (absl::GetFlag(FLAGS_num_layers) > 0) {
      std::cerr << "tessera-trainer: --num_layers cannot change an --init_from model\n";
      std::exit(2);
    }
    spec->mutable_model()->set_from_pretrained(absl::GetFlag(FLAGS_init_from));
  }
  if (absl::GetFlag(FLAGS_num_layers) > 0 || absl::GetFlag(FLAGS_num_experts) > 0) {
    // A spec names a preset or dimensions, not both: spell out the preset's, with the override.
    auto preset = tessera::planner::ResolveModel(spec->model(), absl::GetFlag(FLAGS_seq_len));
    if (!preset.ok()) {
      std::cerr << "tessera-trainer: --preset: " << preset.status() << "\n";
      std::exit(2);
    }
    spec->mutable_model()->clear_preset();
    *spec->mutable_model()->mutable_dims() = preset->dims();
    tessera::v1::ModelDims* dims = spec->mutable_model()->mutable_dims();
    if (absl::GetFlag(FLAGS_num_layers) > 0) dims->set_num_layers(absl::GetFlag(FLAGS_num_layers));
    if (absl::GetFlag(FLAGS_num_experts) > 0) {
      dims->set_num_experts(absl::GetFlag(FLAGS_num_experts));
      dims->set_num_experts_per_token(absl::GetFlag(FLAGS_experts_per_token));
      dims->set_router_aux_loss_coef(absl::GetFlag(FLAGS_router_aux_loss_coef));
    }
  }
  for (const auto& shard : absl::GetFlag(FLAGS_data)) spec->mutable_data()->add_train_shards(shard);
  spec->mutable_data()->set_seq_len(absl::GetFlag(FLAGS_seq_len));
  for (const auto& shard : absl::GetFlag(FLAGS_val_data)) {
    spec->mutable_data()->add_validation_shards(shard);
  }
  spec->mutable_data()->set_eval_interval_steps(absl::GetFlag(FLAGS_eval_every));
  spec->mutable_data()->set_eval_batches(absl::GetFlag(FLAGS_eval_batches));
  spec->mutable_batch()->set_global_batch_size(absl::GetFlag(FLAGS_global_batch));
  spec->mutable_batch()->set_micro_batch_size(absl::GetFlag(FLAGS_micro_batch));
  auto* schedule = spec->mutable_optimizer()->mutable_schedule();
  schedule->set_peak_learning_rate(absl::GetFlag(FLAGS_lr));
  schedule->set_warmup_steps(absl::GetFlag(FLAGS_warmup));
  schedule->set_min_lr_ratio(absl::GetFlag(FLAGS_min_lr_ratio));
  schedule->set_decay_steps(absl::GetFlag(FLAGS_decay_steps));
  spec->mutable_optimizer()->set_weight_decay(absl::GetFlag(FLAGS_weight_decay));
  spec->mutable_optimizer()->set_grad_clip_norm(absl::GetFlag(FLAGS_grad_clip));
  spec->set_max_steps(absl::GetFlag(FLAGS_epochs) > 0 ? 0 : absl::GetFlag(FLAGS_steps));
  spec->set_epochs(absl::GetFlag(FLAGS_epochs));
  if (absl::GetFlag(FLAGS_lora_rank) != 0 || absl::GetFlag(FLAGS_lora_nf4)) {
    tessera::v1::LoraSpec* lora = spec->mutable_lora();
    if (absl::GetFlag(FLAGS_lora_nf4)) {
      lora->set_base_quantization(tessera::v1::LORA_BASE_QUANTIZATION_NF4);
    }
    lora->set_rank(absl::GetFlag(FLAGS_lora_rank));
    lora->set_alpha(absl::GetFlag(FLAGS_lora_alpha));
    lora->set_dropout(absl::GetFlag(FLAGS_lora_dropout));
    for (const std::string& target : absl::GetFlag(FLAGS_lora_targets)) {
      lora->add_target_modules(target);
    }
  }
  if (const std::string guard = absl::GetFlag(FLAGS_guard); !guard.empty()) {
    if (!google::protobuf::TextFormat::ParseFromString(guard, spec->mutable_guard())) {
      std::cerr << "tessera-trainer: --guard: not a GuardSpec in text format: '" << guard << "'\n";
      std::exit(2);
    }
  }
  spec->set_seed(absl::GetFlag(FLAGS_seed));
  auto* checkpoint = spec->mutable_checkpoint();
  checkpoint->set_directory(absl::GetFlag(FLAGS_checkpoint_dir));
  checkpoint->set_interval_steps(absl::GetFlag(FLAGS_checkpoint_every));
  checkpoint->set_keep_last(absl::GetFlag(FLAGS_keep_last));
  checkpoint->set_resume(absl::GetFlag(FLAGS_resume));
  checkpoint->set_export_safetensors(absl::GetFlag(FLAGS_export_safetensors));
  if (const std::string format = absl::GetFlag(FLAGS_export_format); !format.empty()) {
    tessera::v1::ExportFormat value = tessera::v1::EXPORT_FORMAT_UNSPECIFIED;
    if (!tessera::v1::ExportFormat_Parse("EXPORT_FORMAT_" + absl::AsciiStrToUpper(format),
                                         &value) ||
        value == tessera::v1::EXPORT_FORMAT_UNSPECIFIED) {
      std::cerr << "tessera-trainer: --export_format must be tessera or hf, got '" << format
                << "'\n";
      std::exit(2);
    }
    if (absl::GetFlag(FLAGS_checkpoint_dir).empty()) {
      std::cerr << "tessera-trainer: --export_format needs --checkpoint_dir (the export is "
                   "written under it)\n";
      std::exit(2);
    }
    checkpoint->set_export_format(value);
  }
  checkpoint->set_export_merged(absl::GetFlag(FLAGS_export_merged));
  task.set_checkpoint_directory(absl::GetFlag(FLAGS_checkpoint_dir));
  tessera::v1::Layout* layout = task.mutable_plan()->mutable_layout();
  layout->set_zero_stage(absl::GetFlag(FLAGS_zero_stage));
  layout->set_tensor_parallel(absl::GetFlag(FLAGS_tensor_parallel));
  layout->set_pipeline_parallel(absl::GetFlag(FLAGS_pipeline_parallel));
  layout->set_context_parallel(absl::GetFlag(FLAGS_context_parallel));
  layout->set_pipeline_virtual_stages(absl::GetFlag(FLAGS_pipeline_virtual_stages));
  layout->set_expert_parallel(absl::GetFlag(FLAGS_expert_parallel));
  layout->set_sequence_parallel(absl::GetFlag(FLAGS_sequence_parallel));
  const std::string recompute =
      absl::AsciiStrToUpper(absl::GetFlag(FLAGS_activation_checkpointing));
  tessera::v1::ActivationCheckpointing mode = tessera::v1::ACTIVATION_CHECKPOINTING_UNSPECIFIED;
  if (!tessera::v1::ActivationCheckpointing_Parse("ACTIVATION_CHECKPOINTING_" + recompute, &mode)) {
    std::cerr << "tessera-trainer: --activation_checkpointing must be none, selective or full\n";
    std::exit(2);
  }
  layout->set_activation_checkpointing_mode(mode);
  int gpu = absl::GetFlag(FLAGS_gpu);
  task.mutable_assignment()->set_device_type(gpu >= 0 ? tessera::v1::DEVICE_TYPE_CUDA
                                                      : tessera::v1::DEVICE_TYPE_CPU);
  task.mutable_assignment()->set_gpu_index(gpu);
  return task;
}

// What SubmitJob decides of a spec: validated, resolved and planned (coordinator::PlanJob), and
// refused where this trainer does not run it (ValidateTrainerRuns).
absl::StatusOr<tessera::v1::LayoutPlan> PlanAsSubmitted(const tessera::v1::JobSpec& spec) {
  absl::StatusOr<tessera::v1::LayoutPlan> plan = tessera::coordinator::PlanJob(spec);
  if (!plan.ok()) return plan.status();
  if (absl::Status runs = tessera::coordinator::ValidateTrainerRuns(spec); !runs.ok()) {
    return runs;
  }
  return plan;
}

// --job_spec: the spec validated, resolved and planned by the coordinator's own functions, so a
// spec run here is the job the coordinator would run, defaults and all.
absl::StatusOr<tessera::v1::TrainerTask> TaskFromJobSpec(const std::string& path) {
  absl::StatusOr<tessera::v1::JobSpec> spec = tessera::client::LoadJobSpec(path);
  if (!spec.ok()) {
    return absl::Status(spec.status().code(),
                        absl::StrCat("--job_spec: ", spec.status().message()));
  }
  absl::StatusOr<tessera::v1::LayoutPlan> plan = PlanAsSubmitted(*spec);
  if (!plan.ok()) return plan.status();
  tessera::v1::TrainerTask task;
  task.set_job_id(spec->name());
  task.set_checkpoint_directory(spec->checkpoint().directory());
  const bool gpus = spec->resources().gpus() > 0;
  task.mutable_assignment()->set_device_type(gpus ? tessera::v1::DEVICE_TYPE_CUDA
                                                  : tessera::v1::DEVICE_TYPE_CPU);
  // -1: the rank's local rank picks its GPU (trainer/runtime/run_builder.cc).
  task.mutable_assignment()->set_gpu_index(gpus ? absl::GetFlag(FLAGS_gpu) : -1);
  *task.mutable_plan() = *std::move(plan);
  *task.mutable_spec() = *std::move(spec);
  return task;
}

// A training run from flags goes through the same planning as --job_spec: the spec the flags
// spell out, with their layout as an explicit one and resources for the ranks this process is
// one of (WORLD_SIZE, GPUs with --gpu), is validated, resolved and planned by
// coordinator::PlanJob. The task keeps the flags' job id (a spec's name has a stricter form: the
// check is made under "standalone").
absl::Status PlanFlagsTask(tessera::v1::TrainerTask* task) {
  auto assignment = tessera::trainer::ResolveRankAssignment(
      task->assignment(), [](const char* name) { return std::getenv(name); });
  if (!assignment.ok()) return assignment.status();
  tessera::v1::JobSpec* spec = task->mutable_spec();
  if (task->assignment().device_type() == tessera::v1::DEVICE_TYPE_CUDA) {
    spec->mutable_resources()->set_gpus(assignment->world_size());
  } else {
    spec->mutable_resources()->set_cpu_slots(assignment->world_size());
  }
  // The flags leave the data-parallel degree to the rest of the world; an explicit layout names it.
  absl::StatusOr<tessera::trainer::MeshShape> shape =
      tessera::trainer::MeshShapeForLayout(task->plan().layout(), assignment->world_size());
  if (!shape.ok()) return shape.status();
  tessera::v1::Layout* layout = spec->mutable_parallelism()->mutable_layout();
  *layout = task->plan().layout();
  layout->set_data_parallel(shape->dp);
  tessera::v1::JobSpec checked = *spec;
  checked.set_name("standalone");
  absl::StatusOr<tessera::v1::LayoutPlan> plan = PlanAsSubmitted(checked);
  if (!plan.ok()) return plan.status();
  *task->mutable_plan() = *std::move(plan);
  return absl::OkStatus();
}

int Prepare() {
  tessera::trainer::PrepareOptions options;
  options.inputs = absl::GetFlag(FLAGS_input);
  options.output_dir = absl::GetFlag(FLAGS_output_dir);
  options.tokenizer = absl::GetFlag(FLAGS_tokenizer);
  options.eos_token = absl::GetFlag(FLAGS_eos_token);
  options.format = absl::GetFlag(FLAGS_format);
  options.val_fraction = absl::GetFlag(FLAGS_val_fraction);
  options.prompt_template = absl::GetFlag(FLAGS_prompt_template);
  options.seq_len = absl::GetFlag(FLAGS_sample_seq_len);
  options.pack = absl::GetFlag(FLAGS_pack);
  auto result = tessera::trainer::PrepareData(options);
  if (!result.ok()) {
    std::cerr << "tessera-trainer prepare: " << result.status() << "\n";
    return 1;
  }
  std::cout << "prepared " << result->train_tokens << " training and " << result->val_tokens
            << " validation tokens (vocab " << result->vocab_size << ") in "
            << result->train_shards.size() + result->val_shards.size() << " shard(s) under "
            << options.output_dir;
  if (result->loss_mask) {
    std::cout << ", with a loss mask (prompt and padding tokens do not count)";
  }
  if (result->record_starts) {
    std::cout << ", records packed into samples and marked (each attends only to itself)";
  }
  if (result->dropped_records > 0) {
    std::cout << "; " << result->dropped_records
              << " record(s) dropped: no response token left within --sample_seq_len";
  }
  std::cout << "\n";
  return 0;
}

int Check() {
  auto result =
      tessera::trainer::RunSelfCheck({.gpu_index = absl::GetFlag(FLAGS_gpu),
                                      .steps = static_cast<int>(absl::GetFlag(FLAGS_steps))});
  if (!result.ok()) {
    std::cerr << "tessera-trainer: check failed: " << result.status() << "\n";
    return 1;
  }
  std::cout << tessera::trainer::ToJson(*result) << "\n";
  return 0;
}

// Contract with the run builder (runtime/run_builder.cc): a fresh run seeds LibTorch's CPU
// generator with the job seed (0 means planner::kDefaultSeed) and builds the model on the CPU
// before anything else draws from it, so the same steps here give bit-identical weights. A change
// there that breaks this shows up as a first-step loss mismatch in bench/trainer_bench.py.
int ExportInitialWeights(const tessera::v1::TrainerTask& task, const std::string& path) {
  const tessera::v1::JobSpec& spec = task.spec();
  auto summary = tessera::planner::ResolveModel(spec.model(), spec.data().seq_len());
  if (!summary.ok()) {
    std::cerr << "tessera-trainer: " << summary.status() << "\n";
    return 2;
  }
  std::string dims_json;
  google::protobuf::util::JsonPrintOptions json_options;
  json_options.preserve_proto_field_names = true;
  json_options.always_print_primitive_fields = true;
  if (!google::protobuf::util::MessageToJsonString(summary->dims(), &dims_json, json_options)
           .ok()) {
    std::cerr << "tessera-trainer: cannot print the model dims as JSON\n";
    return 1;
  }
  try {
    torch::manual_seed(tessera::planner::EffectiveSeed(spec.seed()));
    tessera::trainer::CausalLM model(summary->dims(), spec.model().init_std());
    std::vector<tessera::trainer::TensorView> views;
    for (const auto& item : model->named_parameters()) {
      const at::Tensor& value = item.value();
      views.push_back({.name = item.key(),
                       .dtype = "F32",
                       .shape = value.sizes().vec(),
                       .data = value.data_ptr(),
                       .nbytes = static_cast<size_t>(value.nbytes())});
    }
    absl::Status status = tessera::trainer::WriteSafetensors(
        path, views,
        {{"format", "pt"},
         {"tessera.step", "0"},
         {"tessera.preset", summary->preset()},
         {"tessera.dims", dims_json},
         {"tessera.num_parameters", std::to_string(summary->num_parameters())},
         {"tessera.flops_per_token", absl::StrFormat("%.17g", summary->flops_per_token())}});
    if (!status.ok()) {
      std::cerr << "tessera-trainer: --export_initial: " << status << "\n";
      return 1;
    }
  } catch (const c10::Error& e) {
    std::cerr << "tessera-trainer: --export_initial: LibTorch: " << e.what_without_backtrace()
              << "\n";
    return 1;
  }
  std::cout << "exported the initial weights of " << summary->num_parameters() << " parameters to "
            << path << "\n";
  return 0;
}

// --export_hf and --logits_out: builds the whole model on the CPU as ExportInitialWeights does,
// loads --weights or the spec's from_pretrained weights into it, and writes what was asked for.
int RunModelTool(const tessera::v1::TrainerTask& task) {
  const tessera::v1::JobSpec& spec = task.spec();
  auto summary = tessera::planner::ResolveModel(spec.model(), spec.data().seq_len());
  if (!summary.ok()) {
    std::cerr << "tessera-trainer: " << summary.status() << "\n";
    return 2;
  }
  std::vector<int64_t> tokens;
  for (const std::string& token : absl::GetFlag(FLAGS_logits_tokens)) {
    int64_t id = 0;
    if (!absl::SimpleAtoi(token, &id) || id < 0 || id >= summary->dims().vocab_size()) {
      std::cerr << "tessera-trainer: --logits_tokens: '" << token << "' is not a token id below "
                << summary->dims().vocab_size() << "\n";
      return 2;
    }
    tokens.push_back(id);
  }
  const std::string logits_out = absl::GetFlag(FLAGS_logits_out);
  if (!logits_out.empty() && tokens.empty()) {
    std::cerr << "tessera-trainer: --logits_out needs --logits_tokens\n";
    return 2;
  }
  try {
    torch::manual_seed(tessera::planner::EffectiveSeed(spec.seed()));
    tessera::trainer::CausalLM model(summary->dims(), spec.model().init_std());
    absl::Status status;
    if (!absl::GetFlag(FLAGS_weights).empty()) {
      status = tessera::trainer::LoadTesseraWeights(*model, absl::GetFlag(FLAGS_weights));
    } else if (spec.model().has_from_pretrained()) {
      status = tessera::trainer::LoadHfWeights(*model, spec.model().from_pretrained());
    }
    if (!status.ok()) {
      std::cerr << "tessera-trainer: " << status << "\n";
      return 1;
    }
    if (const std::string adapter = absl::GetFlag(FLAGS_lora_adapter); !adapter.empty()) {
      absl::StatusOr<tessera::v1::LoraSpec> lora = tessera::trainer::ReadPeftAdapterConfig(adapter);
      absl::StatusOr<tessera::planner::ResolvedLora> resolved =
          lora.ok() ? tessera::planner::ResolveLora(*lora, summary->dims())
                    : absl::StatusOr<tessera::planner::ResolvedLora>(lora.status());
      if (resolved.ok()) {
        model->AddLora(tessera::trainer::LoraOptionsOf(*resolved));
        status = tessera::trainer::LoadPeftAdapterWeights(*model, adapter);
      } else {
        status = resolved.status();
      }
      if (!status.ok()) {
        std::cerr << "tessera-trainer: --lora_adapter: " << status << "\n";
        return 1;
      }
    }
    model->eval();
    if (!logits_out.empty()) {
      torch::NoGradGuard no_grad;
      torch::Tensor logits =
          model->forward(torch::tensor(tokens, torch::kInt64).unsqueeze(0)).contiguous();
      status =
          tessera::trainer::WriteSafetensors(logits_out,
                                             {{.name = "logits",
                                               .dtype = "F32",
                                               .shape = logits.sizes().vec(),
                                               .data = logits.data_ptr(),
                                               .nbytes = static_cast<size_t>(logits.nbytes())}},
                                             {{"format", "pt"}});
      if (!status.ok()) {
        std::cerr << "tessera-trainer: --logits_out: " << status << "\n";
        return 1;
      }
      std::cout << "wrote the logits of " << tokens.size() << " tokens to " << logits_out << "\n";
    }
    if (const std::string dir = absl::GetFlag(FLAGS_export_hf); !dir.empty()) {
      status = tessera::trainer::ExportHfModel(*model, dir, spec.model().from_pretrained());
      if (!status.ok()) {
        std::cerr << "tessera-trainer: --export_hf: " << status << "\n";
        return 1;
      }
      std::cout << "exported " << summary->num_parameters() << " parameters to " << dir
                << " as a Hugging Face model\n";
    }
  } catch (const c10::Error& e) {
    std::cerr << "tessera-trainer: LibTorch: " << e.what_without_backtrace() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace

namespace {
// Set by kCheckpointAndStopSignal (common/trainer_env.h): a lock-free atomic, safe to store from
// a signal handler.
std::atomic<bool> checkpoint_and_stop{false};
static_assert(std::atomic<bool>::is_always_lock_free);
}  // namespace

int main(int argc, char** argv) {
  // First: the worker signals a rank only once it has reported (worker_agent.cc), but the
  // signal's default action would end a process that has no handler yet. One asked during setup
  // stops after its first step.
  struct sigaction on_signal {};
  on_signal.sa_handler = [](int) { checkpoint_and_stop.store(true, std::memory_order_relaxed); };
  sigemptyset(&on_signal.sa_mask);
  on_signal.sa_flags = SA_RESTART;
  sigaction(tessera::kCheckpointAndStopSignal, &on_signal, nullptr);
  // Before anything else: a trainer whose worker is already gone must not start training.
  if (const char* worker_pid = std::getenv(tessera::kWorkerPidEnv); worker_pid != nullptr) {
    if (absl::Status status = tessera::trainer::DieWithWorker(worker_pid); !status.ok()) {
      std::cerr << "tessera-trainer: " << status << "\n";
      if (absl::IsFailedPrecondition(status)) return 1;
    }
  }
  if (!tessera::trainer::RetainFreedHostMemory()) {
    std::cerr << "tessera-trainer: malloc refused to keep freed memory; each step's host "
                 "allocations will fault in fresh pages\n";
  }
  std::vector<char*> args = tessera::ParseCommandLine(argc, argv, kUsage);
  tessera::trainer::SetFusedKernelsEnabled(absl::GetFlag(FLAGS_fused_kernels));
  if (args.size() == 2 && std::string(args[1]) == "prepare") return Prepare();
  if (args.size() > 1) {
    std::cerr << "tessera-trainer: unexpected argument '" << args[1] << "'\n\n" << kUsage;
    return 2;
  }
  if (absl::GetFlag(FLAGS_check)) return Check();

  tessera::v1::TrainerTask task;
  if (!absl::GetFlag(FLAGS_job_spec).empty()) {
    if (!absl::GetFlag(FLAGS_task).empty() || !absl::GetFlag(FLAGS_data).empty()) {
      std::cerr << "tessera-trainer: --job_spec is the whole job: pass it without --task or "
                   "--data\n";
      return 2;
    }
    auto from_spec = TaskFromJobSpec(absl::GetFlag(FLAGS_job_spec));
    if (!from_spec.ok()) {
      std::cerr << "tessera-trainer: " << from_spec.status() << "\n";
      return 2;
    }
    task = std::move(*from_spec);
  } else if (!absl::GetFlag(FLAGS_task).empty()) {
    auto read = ReadTask(absl::GetFlag(FLAGS_task));
    if (!read.ok()) {
      std::cerr << "tessera-trainer: " << read.status() << "\n";
      return 2;
    }
    task = std::move(*read);
  } else if (!absl::GetFlag(FLAGS_data).empty() || !absl::GetFlag(FLAGS_export_hf).empty() ||
             !absl::GetFlag(FLAGS_logits_out).empty()) {
    task = TaskFromFlags();
    const bool tool = !absl::GetFlag(FLAGS_export_hf).empty() ||
                      !absl::GetFlag(FLAGS_logits_out).empty() ||
                      !absl::GetFlag(FLAGS_export_initial).empty();
    if (!tool) {
      if (absl::Status planned = PlanFlagsTask(&task); !planned.ok()) {
        std::cerr << "tessera-trainer: " << planned << "\n";
        return 2;
      }
    }
  } else {
    std::cerr << "tessera-trainer: nothing to do; pass --task, --data, prepare or --check\n\n"
              << kUsage;
    return 2;
  }
  if (!absl::GetFlag(FLAGS_export_initial).empty()) {
    return ExportInitialWeights(task, absl::GetFlag(FLAGS_export_initial));
  }
  if (!absl::GetFlag(FLAGS_export_hf).empty() || !absl::GetFlag(FLAGS_logits_out).empty()) {
    return RunModelTool(task);
  }
  auto assignment = tessera::trainer::ResolveRankAssignment(
      task.assignment(), [](const char* name) { return std::getenv(name); });
  if (!assignment.ok()) {
    std::cerr << "tessera-trainer: " << assignment.status() << "\n";
    return 2;
  }
  *task.mutable_assignment() = *assignment;
  if (!absl::GetFlag(FLAGS_job_spec).empty() &&
      task.assignment().world_size() != task.plan().world_size()) {
    std::cerr << "tessera-trainer: --job_spec: the spec's resources ask for "
              << task.plan().world_size() << " rank(s) and this process is one of "
              << task.assignment().world_size()
              << " (WORLD_SIZE): start as many trainers (torchrun --nproc_per_node="
              << task.plan().world_size() << "), or change resources\n";
    return 2;
  }

  std::unique_ptr<tessera::trainer::Reporter> reporter;
  if (!task.report_socket().empty()) {
    auto socket = tessera::trainer::SocketReporter::Connect(
        task.report_socket(), {.on_worker_gone = tessera::trainer::ExitBecauseWorkerGone});
    if (!socket.ok()) {
      std::cerr << "tessera-trainer: " << socket.status() << "\n";
      return 2;
    }
    reporter = std::move(*socket);
  } else {
    reporter = std::make_unique<tessera::trainer::JsonLinesReporter>(std::cout);
  }
  // Heartbeats go to a worker only (standalone output stays one line per event), from a thread
  // started before the model and data are set up, so that slow setup is not taken for a hang.
  tessera::trainer::RankProgress progress;
  std::optional<tessera::trainer::HeartbeatSender> heartbeat;
  if (!task.report_socket().empty()) {
    heartbeat.emplace(
        *reporter, progress,
        tessera::trainer::HeartbeatOptions{.job_id = task.job_id(),
                                           .attempt = task.attempt(),
                                           .rank = task.assignment().rank(),
                                           .interval = tessera::trainer::HeartbeatInterval(task)});
  }
  tessera::trainer::TrainOptions train_options{.log = &std::cerr,
                                               .progress = &progress,
                                               .stop_requested = &checkpoint_and_stop};
  if (const char* step = std::getenv(tessera::kFaultNanLossAtStepEnv); step != nullptr) {
    if (!absl::SimpleAtoi(step, &train_options.nan_loss_from_step)) {
      std::cerr << "tessera-trainer: " << tessera::kFaultNanLossAtStepEnv
                << " must be a step number, not '" << step << "'\n";
      return 2;
    }
    std::cerr << "tessera-trainer: fault injection: loss reads NaN from step "
              << train_options.nan_loss_from_step << "\n";
  }
  if (const char* batch = std::getenv(tessera::kFaultLossSpikeAtBatchEnv); batch != nullptr) {
    if (!absl::SimpleAtoi(batch, &train_options.loss_spike_at_batch)) {
      std::cerr << "tessera-trainer: " << tessera::kFaultLossSpikeAtBatchEnv
                << " must be a batch number, not '" << batch << "'\n";
      return 2;
    }
    std::cerr << "tessera-trainer: fault injection: the loss of global batch "
              << train_options.loss_spike_at_batch << " reads 1000x\n";
  }
  if (const char* step = std::getenv(tessera::kFaultKillInCheckpointAtStepEnv); step != nullptr) {
    if (!absl::SimpleAtoi(step, &train_options.kill_in_checkpoint_at_step)) {
      std::cerr << "tessera-trainer: " << tessera::kFaultKillInCheckpointAtStepEnv
                << " must be a step number, not '" << step << "'\n";
      return 2;
    }
    std::cerr << "tessera-trainer: fault injection: the checkpoint of step "
              << train_options.kill_in_checkpoint_at_step << " dies half-written\n";
  }
  if (const char* ignore = std::getenv(tessera::kFaultIgnoreCheckpointSignalEnv);
      ignore != nullptr && std::string(ignore) == "1") {
    signal(tessera::kCheckpointAndStopSignal, SIG_IGN);
    std::cerr << "tessera-trainer: fault injection: the checkpoint-and-stop signal is ignored\n";
  }
  train_options.cuda_graphs = absl::GetFlag(FLAGS_cuda_graphs);
  train_options.step_breakdown = absl::GetFlag(FLAGS_step_breakdown);
  if (absl::GetFlag(FLAGS_collective_probe)) {
    if (!train_options.step_breakdown) {
      std::cerr << "tessera-trainer: --collective_probe needs --step_breakdown\n";
      return 2;
    }
    tessera::trainer::SetCollectiveProbeEnabled(true);
    std::cerr << "tessera-trainer: collectives are probed: a barrier before each, waited at "
                 "once (slower training)\n";
  }
  if (!absl::GetFlag(FLAGS_profile_dir).empty()) {
    train_options.profile.directory = absl::GetFlag(FLAGS_profile_dir);
    if (absl::Status status = tessera::trainer::ParseProfileSteps(
            absl::GetFlag(FLAGS_profile_steps), &train_options.profile);
        !status.ok()) {
      std::cerr << "tessera-trainer: --profile_steps: " << status.message() << "\n";
      return 2;
    }
  }
  auto result = tessera::trainer::RunTraining(task, *reporter, train_options);
  if (!result.ok()) {
    std::cerr << "tessera-trainer: " << result.status() << "\n";
    return 1;
  }
  return 0;
}

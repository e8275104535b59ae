// tessera-trainer: the process that trains one rank of a job. Launched by a
// worker with a task file, or run by hand (or torchrun) on a job spec.
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
          "environment), with the --set settings applied, validated, resolved and planned as the "
          "coordinator does a submitted job (coordinator::PlanJob): this process runs it as one "
          "rank, or as the rank torchrun's environment names (RANK, WORLD_SIZE), which must match "
          "the ranks the spec's resources ask for. An automatic layout is data parallel over them "
          "(the coordinator's plan before it knows the cluster). Without it, --set settings make "
          "the whole spec.");
ABSL_FLAG(bool, check, false,
          "Train a small MLP for --check_steps AdamW steps on --gpu (or the CPU) and print the "
          "result as one JSON line; exit 0 when the loss falls.");
ABSL_FLAG(int, check_steps, 50, "--check: optimizer steps.");
ABSL_FLAG(int, gpu, -1,
          "CUDA device ordinal for --check, and for a --job_spec / --set run that asks for "
          "resources.gpus; -1: the rank's local rank picks it.");
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
ABSL_FLAG(std::string, export_initial, "",
          "With --task, --job_spec or --set: write the weights the run would start step 1 from "
          "(a fresh run, no resume) to this safetensors file, float32 and named as "
          "checkpoint.export_safetensors names them, with the resolved model in its metadata; "
          "then exit without training. For comparing against other implementations.");
ABSL_FLAG(std::string, weights, "",
          "With --export_hf / --logits_out: a Tessera safetensors export (a checkpoint's "
          "model.safetensors, --export_initial) of the spec's model (model.preset, model.dims "
          "or model.from_pretrained), to load instead of from_pretrained's or the seeded "
          "initial weights.");
ABSL_FLAG(std::string, export_hf, "",
          "Write the spec's model (model.from_pretrained's weights, --weights or the seeded "
          "initial weights) to this directory as a Hugging Face model (config.json, "
          "model.safetensors, generation_config.json) that transformers loads; then exit.");
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
          "eos that does not count); training must then use data.seq_len N. 0: one token stream.");
ABSL_FLAG(bool, pack, false,
          "prepare: with --sample_seq_len, put several short records into one sample; the shards "
          "mark where each begins, and training keeps them from attending to one another.");

namespace {

constexpr char kUsage[] =
    "Usage: tessera-trainer --task=PATH\n"
    "       tessera-trainer --job_spec=FILE [--set PATH=VALUE ...]\n"
    "       tessera-trainer --set PATH=VALUE ...   (the spec from settings alone)\n"
    "       tessera-trainer prepare --input=FILES --output_dir=DIR [--tokenizer=byte|PATH]\n"
    "                               [--prompt_template=alpaca|chat --sample_seq_len=N [--pack]]\n"
    "       tessera-trainer --check [--gpu=N]\n"
    "       tessera-trainer --set model.from_pretrained=HF_DIR | model.preset=NAME\n"
    "                       [--weights=FILE] --export_hf=DIR\n\n"
    "Trains one rank of a Tessera job on LibTorch. With --task it runs what the worker\n"
    "wrote; with a job spec it runs the job the coordinator would (validated, resolved and\n"
    "planned by the same functions) and prints reports as JSON lines. A --set PATH=VALUE\n"
    "(repeatable, like helm's) sets one spec field over the file: PATH is field names joined\n"
    "by dots, VALUE one YAML value, e.g.\n"
    "  --set model.preset=tiny-gpt2 --set data.train_shards=[/data/train-*.bin]\n"
    "  --set max_steps=200 --set optimizer.schedule.peak_learning_rate=3e-3\n"
    "  --set resources.cpu_slots=2 --set parallelism.layout={data_parallel: 1,\n"
    "        tensor_parallel: 2, pipeline_parallel: 1}\n"
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

// The spec of --job_spec with the --set settings over it, or of the settings alone.
absl::StatusOr<tessera::v1::JobSpec> SpecFromCommandLine(
    const tessera::client::SpecSettings& settings) {
  const std::string path = absl::GetFlag(FLAGS_job_spec);
  absl::StatusOr<tessera::v1::JobSpec> spec =
      path.empty()
          ? tessera::client::ParseJobSpec("{}", tessera::client::ProcessEnvironment(), settings)
          : tessera::client::LoadJobSpec(path, tessera::client::ProcessEnvironment(), settings);
  if (!spec.ok() && !path.empty()) {
    return absl::Status(spec.status().code(),
                        absl::StrCat("--job_spec: ", spec.status().message()));
  }
  return spec;
}

// A spec to run: validated, resolved and planned by the coordinator's own functions, so a spec
// run here is the job the coordinator would run, defaults and all.
absl::StatusOr<tessera::v1::TrainerTask> TaskFromSpec(absl::StatusOr<tessera::v1::JobSpec> spec) {
  if (!spec.ok()) return spec.status();
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
  auto result = tessera::trainer::RunSelfCheck(
      {.gpu_index = absl::GetFlag(FLAGS_gpu), .steps = absl::GetFlag(FLAGS_check_steps)});
  if (!result.ok()) {
    std::cerr << "tessera-trainer: check failed: " << result.status() << "\n";
    return 1;
  }
  std::cout << tessera::trainer::ToJson(*result) << "\n";
  return 0;
}

// The model a tool builds (--export_initial, --export_hf, --logits_out): the spec's, at its
// data.seq_len, or at the model's own context length when the spec names none.
absl::StatusOr<tessera::v1::ModelSummary> ToolModel(const tessera::v1::JobSpec& spec) {
  if (spec.data().seq_len() > 0) {
    return tessera::planner::ResolveModel(spec.model(), spec.data().seq_len());
  }
  auto model = tessera::planner::ResolveModel(spec.model(), 1);
  if (!model.ok()) return model.status();
  return tessera::planner::ResolveModel(spec.model(), model->dims().max_seq_len());
}

// Contract with the run builder (runtime/run_builder.cc): a fresh run seeds LibTorch's CPU
// generator with the job seed (0 means planner::kDefaultSeed) and builds the model on the CPU
// before anything else draws from it, so the same steps here give bit-identical weights. A change
// there that breaks this shows up as a first-step loss mismatch in bench/trainer_bench.py.
int ExportInitialWeights(const tessera::v1::TrainerTask& task, const std::string& path) {
  const tessera::v1::JobSpec& spec = task.spec();
  auto summary = ToolModel(spec);
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
  auto summary = ToolModel(spec);
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
  // --set may be given many times, and absl keeps a flag's last value only: the settings are
  // taken out of the command line before the flags are parsed.
  tessera::client::SpecSettings settings;
  std::vector<char*> rest = {argv[0]};
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--") {  // the rest is positional
      rest.insert(rest.end(), argv + i, argv + argc);
      break;
    }
    if (arg == "--set" || arg == "-set") {
      if (i + 1 == argc) {
        std::cerr << "tessera-trainer: --set needs PATH=VALUE\n";
        return 2;
      }
      settings.emplace_back(argv[++i]);
    } else if (absl::StartsWith(arg, "--set=") || absl::StartsWith(arg, "-set=")) {
      settings.emplace_back(arg.substr(arg.find('=') + 1));
    } else {
      rest.push_back(argv[i]);
    }
  }
  std::vector<char*> args =
      tessera::ParseCommandLine(static_cast<int>(rest.size()), rest.data(), kUsage);
  tessera::trainer::SetFusedKernelsEnabled(absl::GetFlag(FLAGS_fused_kernels));
  if (args.size() == 2 && std::string(args[1]) == "prepare") return Prepare();
  if (args.size() > 1) {
    std::cerr << "tessera-trainer: unexpected argument '" << args[1] << "'\n\n" << kUsage;
    return 2;
  }
  if (absl::GetFlag(FLAGS_check)) return Check();

  const bool tool = !absl::GetFlag(FLAGS_export_initial).empty() ||
                    !absl::GetFlag(FLAGS_export_hf).empty() ||
                    !absl::GetFlag(FLAGS_logits_out).empty();
  const bool from_spec = !absl::GetFlag(FLAGS_job_spec).empty() || !settings.empty();
  tessera::v1::TrainerTask task;
  if (!absl::GetFlag(FLAGS_task).empty()) {
    if (from_spec) {
      std::cerr << "tessera-trainer: --task is the whole job: pass it without --job_spec or "
                   "--set\n";
      return 2;
    }
    auto read = ReadTask(absl::GetFlag(FLAGS_task));
    if (!read.ok()) {
      std::cerr << "tessera-trainer: " << read.status() << "\n";
      return 2;
    }
    task = std::move(*read);
  } else if (from_spec) {
    absl::StatusOr<tessera::v1::JobSpec> spec = SpecFromCommandLine(settings);
    if (tool && spec.ok()) {
      // A tool builds the spec's model only: nothing else of the job is planned or checked.
      *task.mutable_spec() = *std::move(spec);
    } else {
      absl::StatusOr<tessera::v1::TrainerTask> planned = TaskFromSpec(std::move(spec));
      if (!planned.ok()) {
        std::cerr << "tessera-trainer: " << planned.status() << "\n";
        return 2;
      }
      task = std::move(*planned);
    }
  } else {
    std::cerr << "tessera-trainer: nothing to do; pass --task, --job_spec, --set, prepare or "
                 "--check\n\n"
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
  if (from_spec && task.assignment().world_size() != task.plan().world_size()) {
    std::cerr << "tessera-trainer: the spec's resources ask for " << task.plan().world_size()
              << " rank(s) and this process is one of " << task.assignment().world_size()
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

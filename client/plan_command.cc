#include "client/plan_command.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/coordinator_client.h"
#include "client/job_spec_file.h"
#include "client/text_format.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "nlohmann/json.hpp"
#include "planner/job_plan.h"
#include "planner/layout_planner.h"

ABSL_FLAG(std::string, model, "", "plan: model preset, e.g. llama3-8b (overrides the spec's).");
ABSL_FLAG(int, seq_len, 0, "plan: tokens per sequence (overrides the spec's data.seq_len).");
ABSL_FLAG(int64_t, global_batch, 0, "plan: sequences per optimizer step (overrides the spec's).");
ABSL_FLAG(int, micro_batch, -1,
          "plan: sequences per rank per pass; 0 searches micro-batches (default: the spec's, or "
          "0 without a spec).");
ABSL_FLAG(std::string, precision, "", "plan: bf16 or fp32 (default: the spec's, else by device).");
ABSL_FLAG(int, gpus, 0, "plan: devices to plan for (overrides the spec's resources).");
ABSL_FLAG(int, gpus_per_node, 0, "plan: devices per node (default: the cluster's, or 8).");
ABSL_FLAG(std::string, device, "",
          "plan: device preset (h100-sxm, h200, a100-80gb, l40s, rtx-pro-6000, b200, cpu); plans "
          "offline.");
ABSL_FLAG(std::string, gpu_memory, "",
          "plan: memory per device, e.g. 80GiB (with no --device: an h100-sxm with this memory); "
          "plans offline.");
ABSL_FLAG(std::string, device_override, "",
          "plan: device model fields to override, e.g. "
          "peak_flops_bf16=700e12,intra_node_bandwidth=200e9,achievable_flops_fraction=0.5 (names "
          "of tessera.v1.DeviceModel; byte counts take sizes like 1GiB); plans offline.");
ABSL_FLAG(std::string, layout, "",
          "plan: evaluate this layout only, e.g. tp=4,pp=2,dp=1,zero=1,sp=on,ac=selective.");
ABSL_FLAG(int, lora_rank, 0, "plan: LoRA adapter rank; 0 plans full training.");
ABSL_FLAG(int, max_candidates, 15, "plan: layouts to list, best first.");

namespace tessera::client {
namespace {

using nlohmann::json;
using planner::FormatBytes;

absl::Status BadFlag(const std::string& flag, const std::string& problem) {
  return absl::InvalidArgumentError(absl::StrCat("--", flag, ": ", problem));
}

std::string AcName(const v1::Layout& layout) {
  return planner::ActivationCheckpointingName(planner::FromProto(layout, 1).ac);
}

json MemoryJson(const v1::MemoryEstimate& m) {
  return json{{"pipeline_stage", m.pipeline_stage()},
              {"parameters", m.parameters()},
              {"weights_bytes", m.weights_bytes()},
              {"gradients_bytes", m.gradients_bytes()},
              {"optimizer_bytes", m.optimizer_bytes()},
              {"embedding_state_bytes", m.embedding_state_bytes()},
              {"cast_weights_bytes", m.cast_weights_bytes()},
              {"activations_bytes", m.activations_bytes()},
              {"activations_per_layer_bytes", m.activations_per_layer_bytes()},
              {"in_flight_micro_batches", m.in_flight_micro_batches()},
              {"logits_bytes", m.logits_bytes()},
              {"communication_bytes", m.communication_bytes()},
              {"expert_all_to_all_bytes", m.expert_all_to_all_bytes()},
              {"context_ring_bytes", m.context_ring_bytes()},
              {"expert_state_bytes", m.expert_state_bytes()},
              {"overhead_bytes", m.overhead_bytes()},
              {"peak_bytes", m.total_bytes()},
              {"usable_bytes", m.usable_bytes()},
              {"device_capacity_bytes", m.device_capacity_bytes()}};
}

json CandidateJson(const v1::LayoutCandidate& candidate) {
  const v1::LayoutPlan& p = candidate.plan();
  const v1::Layout& l = p.layout();
  json out{{"dp", l.data_parallel()},
           {"tp", l.tensor_parallel()},
           {"pp", l.pipeline_parallel()},
           {"cp", std::max(1, l.context_parallel())},
           {"ep", std::max(1, l.expert_parallel())},
           {"v", std::max(1, l.pipeline_virtual_stages())},
           {"zero", l.zero_stage()},
           {"micro_batch", p.micro_batch_size()},
           {"grad_accum", p.gradient_accumulation_steps()},
           {"sp", l.sequence_parallel()},
           {"ac", AcName(l)},
           {"fits", p.fits()}};
  if (p.has_memory()) {
    json memory = MemoryJson(p.memory());
    if (p.stage_memory_size() > 0) {
      json stages = json::array();
      for (const auto& stage : p.stage_memory()) stages.push_back(MemoryJson(stage));
      memory["stages"] = std::move(stages);
    }
    out["memory"] = std::move(memory);
    const v1::StepTimeEstimate& t = p.step_time();
    out["est_step_time_s"] = t.step_seconds();
    out["est_tokens_per_s"] = t.tokens_per_second();
    out["est_mfu"] = t.mfu();
    out["step_time"] = json{{"compute_s", t.compute_seconds()},
                            {"tensor_parallel_s", t.tensor_parallel_seconds()},
                            {"pipeline_bubble_s", t.pipeline_bubble_seconds()},
                            {"pipeline_bubble_fraction", t.pipeline_bubble_fraction()},
                            {"expert_all_to_all_s", t.expert_all_to_all_seconds()},
                            {"context_ring_s", t.context_ring_seconds()},
                            {"pipeline_transfer_s", t.pipeline_transfer_seconds()},
                            {"data_parallel_s", t.data_parallel_seconds()},
                            {"exposed_communication_s", t.exposed_communication_seconds()},
                            {"optimizer_s", t.optimizer_seconds()},
                            {"model_flops", t.model_flops()},
                            {"hardware_flops", t.hardware_flops()}};
  }
  if (!candidate.rejected_reason().empty()) out["reason"] = candidate.rejected_reason();
  return out;
}

}  // namespace

absl::StatusOr<int64_t> ParseBytes(const std::string& text) {
  absl::string_view rest = absl::StripAsciiWhitespace(text);
  size_t digits = 0;
  while (digits < rest.size() &&
         (std::isdigit(static_cast<unsigned char>(rest[digits])) || rest[digits] == '.')) {
    ++digits;
  }
  double value = 0;
  if (digits == 0 || !absl::SimpleAtod(rest.substr(0, digits), &value)) {
    return absl::InvalidArgumentError(absl::StrCat("'", text, "' is not a size like 80GiB"));
  }
  const std::string unit = absl::AsciiStrToLower(absl::StripAsciiWhitespace(rest.substr(digits)));
  double scale = 0;
  if (unit.empty() || unit == "b") scale = 1;
  if (unit == "kib") scale = 1024.0;
  if (unit == "mib") scale = 1024.0 * 1024;
  if (unit == "gib") scale = 1024.0 * 1024 * 1024;
  if (unit == "tib") scale = 1024.0 * 1024 * 1024 * 1024;
  if (unit == "kb") scale = 1e3;
  if (unit == "mb") scale = 1e6;
  if (unit == "gb") scale = 1e9;
  if (unit == "tb") scale = 1e12;
  if (scale == 0 || value <= 0 || value * scale > 9e18) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", text, "' is not a size like 80GiB, 80GB or 512MiB"));
  }
  return static_cast<int64_t>(std::llround(value * scale));
}

absl::StatusOr<v1::Layout> ParseLayout(const std::string& text) {
  v1::Layout layout;
  layout.set_tensor_parallel(1);
  layout.set_pipeline_parallel(1);
  layout.set_activation_checkpointing_mode(v1::ACTIVATION_CHECKPOINTING_NONE);
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    std::vector<std::string> kv = absl::StrSplit(part, '=');
    if (kv.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat("'", part, "' is not key=value"));
    }
    const std::string key = absl::AsciiStrToLower(absl::StripAsciiWhitespace(kv[0]));
    const std::string value = absl::AsciiStrToLower(absl::StripAsciiWhitespace(kv[1]));
    int number = 0;
    const bool numeric = absl::SimpleAtoi(value, &number);
    if (key == "dp" || key == "tp" || key == "pp" || key == "zero" || key == "cp" || key == "ep" ||
        key == "v") {
      if (!numeric || number < (key == "zero" ? 0 : 1)) {
        return absl::InvalidArgumentError(
            absl::StrCat(key, "=", value, ": must be an integer >= ", key == "zero" ? 0 : 1));
      }
      if (key == "dp") layout.set_data_parallel(number);
      if (key == "tp") layout.set_tensor_parallel(number);
      if (key == "pp") layout.set_pipeline_parallel(number);
      if (key == "zero") layout.set_zero_stage(number);
      if (key == "cp") layout.set_context_parallel(number);
      if (key == "ep") layout.set_expert_parallel(number);
      if (key == "v") layout.set_pipeline_virtual_stages(number);
    } else if (key == "sp") {
      if (value != "on" && value != "off" && value != "true" && value != "false") {
        return absl::InvalidArgumentError(absl::StrCat("sp=", value, ": must be on or off"));
      }
      layout.set_sequence_parallel(value == "on" || value == "true");
    } else if (key == "ac") {
      if (value == "none") {
        layout.set_activation_checkpointing_mode(v1::ACTIVATION_CHECKPOINTING_NONE);
      } else if (value == "selective") {
        layout.set_activation_checkpointing_mode(v1::ACTIVATION_CHECKPOINTING_SELECTIVE);
      } else if (value == "full") {
        layout.set_activation_checkpointing_mode(v1::ACTIVATION_CHECKPOINTING_FULL);
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat("ac=", value, ": must be none, selective or full"));
      }
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown key '", key, "'; use dp, tp, pp, cp, ep, v, zero, sp, ac"));
    }
  }
  return layout;
}

absl::Status ParseDeviceOverrides(const std::string& text, v1::DeviceModel* device) {
  const google::protobuf::Descriptor* descriptor = device->GetDescriptor();
  const google::protobuf::Reflection* reflection = device->GetReflection();
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    std::vector<std::string> kv = absl::StrSplit(part, '=');
    if (kv.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat("'", part, "' is not field=value"));
    }
    const std::string name(absl::StripAsciiWhitespace(kv[0]));
    const std::string value(absl::StripAsciiWhitespace(kv[1]));
    const google::protobuf::FieldDescriptor* field = descriptor->FindFieldByName(name);
    if (field == nullptr || name == "name") {
      std::vector<std::string> names;
      for (int i = 0; i < descriptor->field_count(); ++i) {
        if (descriptor->field(i)->name() != "name") names.push_back(descriptor->field(i)->name());
      }
      return absl::InvalidArgumentError(
          absl::StrCat("unknown field '", name, "'; known: ", absl::StrJoin(names, ", ")));
    }
    if (field->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_DOUBLE) {
      double number = 0;
      if (!absl::SimpleAtod(value, &number)) {
        return absl::InvalidArgumentError(absl::StrCat(name, "=", value, ": not a number"));
      }
      reflection->SetDouble(device, field, number);
    } else {
      auto bytes = ParseBytes(value);
      if (!bytes.ok())
        return absl::InvalidArgumentError(absl::StrCat(name, ": ", bytes.status().message()));
      reflection->SetInt64(device, field, *bytes);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::PlanLayoutRequest> PlanRequestFromFlags(const std::string& spec_path) {
  v1::PlanLayoutRequest request;
  v1::JobSpec& spec = *request.mutable_spec();
  if (!spec_path.empty()) {
    auto loaded = LoadJobSpec(spec_path, ProcessEnvironment());
    if (!loaded.ok()) return loaded.status();
    spec = *std::move(loaded);
  } else {
    spec.mutable_batch()->set_micro_batch_size(0);
  }
  if (const std::string model = absl::GetFlag(FLAGS_model); !model.empty()) {
    spec.mutable_model()->set_preset(model);
  }
  if (int seq = absl::GetFlag(FLAGS_seq_len); seq != 0) spec.mutable_data()->set_seq_len(seq);
  if (int64_t batch = absl::GetFlag(FLAGS_global_batch); batch != 0) {
    spec.mutable_batch()->set_global_batch_size(batch);
  }
  if (int micro = absl::GetFlag(FLAGS_micro_batch); micro >= 0) {
    spec.mutable_batch()->set_micro_batch_size(micro);
  }
  if (const std::string p = absl::AsciiStrToLower(absl::GetFlag(FLAGS_precision)); !p.empty()) {
    if (p != "bf16" && p != "fp32") return BadFlag("precision", "must be bf16 or fp32");
    spec.set_precision(p == "bf16" ? v1::PRECISION_BF16 : v1::PRECISION_FP32);
  }
  if (spec.model().source_case() == v1::ModelSpec::SOURCE_NOT_SET) {
    return BadFlag("model", "give a model preset (or a job spec file)");
  }
  if (spec.data().seq_len() <= 0) return BadFlag("seq_len", "must be > 0");
  if (spec.batch().global_batch_size() <= 0) return BadFlag("global_batch", "must be > 0");
  if (int gpus = absl::GetFlag(FLAGS_gpus); gpus != 0) {
    if (gpus < 0) return BadFlag("gpus", "must be > 0");
    request.set_gpus(gpus);
  }
  if (spec_path.empty() && request.gpus() == 0) return BadFlag("gpus", "must be > 0");
  if (int per_node = absl::GetFlag(FLAGS_gpus_per_node); per_node != 0) {
    if (per_node < 0) return BadFlag("gpus_per_node", "must be > 0");
    request.set_gpus_per_node(per_node);
  }
  const std::string device = absl::GetFlag(FLAGS_device);
  const std::string memory = absl::GetFlag(FLAGS_gpu_memory);
  if (!device.empty()) request.mutable_device()->set_name(device);
  if (!memory.empty()) {
    auto bytes = ParseBytes(memory);
    if (!bytes.ok()) return BadFlag("gpu_memory", std::string(bytes.status().message()));
    request.mutable_device()->set_memory_bytes(*bytes);
    if (device.empty()) request.mutable_device()->set_name("h100-sxm");
  }
  if (const std::string text = absl::GetFlag(FLAGS_device_override); !text.empty()) {
    if (auto status = ParseDeviceOverrides(text, request.mutable_device()); !status.ok()) {
      return BadFlag("device_override", std::string(status.message()));
    }
    if (request.device().name().empty()) request.mutable_device()->set_name("h100-sxm");
  }
  if (int rank = absl::GetFlag(FLAGS_lora_rank); rank != 0) {
    if (rank < 0) return BadFlag("lora_rank", "must be >= 0");
    request.set_lora_rank(rank);
  }
  const int devices = request.gpus() > 0            ? request.gpus()
                      : spec.resources().gpus() > 0 ? spec.resources().gpus()
                                                    : spec.resources().cpu_slots();
  if (const std::string text = absl::GetFlag(FLAGS_layout); !text.empty()) {
    auto layout = ParseLayout(text);
    if (!layout.ok()) return BadFlag("layout", std::string(layout.status().message()));
    if (layout->data_parallel() == 0) {
      // Context-parallel ranks multiply the world like tp and pp (ep's are data-parallel ranks).
      const int model_parallel = layout->tensor_parallel() * layout->pipeline_parallel() *
                                 std::max(1, layout->context_parallel());
      if (devices % model_parallel != 0) {
        return BadFlag("layout", absl::StrCat("tp x pp x cp = ", model_parallel,
                                              " does not divide the ", devices, " devices"));
      }
      layout->set_data_parallel(devices / model_parallel);
    }
    *spec.mutable_parallelism()->mutable_layout() = *layout;
  }
  request.set_max_candidates(std::max(1, absl::GetFlag(FLAGS_max_candidates)));
  return request;
}

bool PlansOffline(const v1::PlanLayoutRequest& request) {
  return !request.device().name().empty() || !request.gpu_type().empty();
}

std::string PlanJson(const v1::PlanLayoutRequest& request, const v1::PlanLayoutResponse& response) {
  const v1::LayoutPlan& plan = response.plan();
  json layouts = json::array();
  for (const auto& candidate : response.candidates()) layouts.push_back(CandidateJson(candidate));
  const v1::DeviceModel& d = plan.device();
  json out{{"model",
            {{"preset", request.spec().model().preset()},
             {"parameters", plan.model().num_parameters()},
             {"seq_len", request.spec().data().seq_len()},
             {"global_batch", request.spec().batch().global_batch_size()},
             {"precision", plan.precision() == v1::PRECISION_FP32 ? "fp32" : "bf16"},
             {"lora_rank", plan.lora_rank()}}},
           {"cluster",
            {{"devices", plan.world_size()},
             {"devices_per_node", plan.devices_per_node()},
             {"device",
              {{"name", d.name()},
               {"memory_bytes", d.memory_bytes()},
               {"peak_flops_bf16", d.peak_flops_bf16()},
               {"peak_flops_fp32", d.peak_flops_fp32()},
               {"intra_node_bandwidth", d.intra_node_bandwidth()},
               {"inter_node_bandwidth", d.inter_node_bandwidth()},
               {"achievable_flops_fraction", d.achievable_flops_fraction()}}}}},
           {"fits", plan.fits()},
           {"explanation", plan.explanation()},
           {"layouts", std::move(layouts)}};
  return out.dump(2) + "\n";
}

std::string PlanTable(const v1::PlanLayoutRequest& request,
                      const v1::PlanLayoutResponse& response) {
  const v1::LayoutPlan& plan = response.plan();
  const v1::JobSpec& spec = request.spec();
  std::string out = absl::StrFormat(
      "Model %s: %.2fB parameters; seq %d, global batch %d, %s, %s\n"
      "Devices: %d x %s (%s), %d per node\n\n",
      spec.model().preset().empty() ? "custom" : spec.model().preset(),
      static_cast<double>(plan.model().num_parameters()) / 1e9, spec.data().seq_len(),
      spec.batch().global_batch_size(), plan.precision() == v1::PRECISION_FP32 ? "fp32" : "bf16",
      plan.lora_rank() > 0 ? absl::StrCat("LoRA rank ", plan.lora_rank()) : "full training",
      plan.world_size(), plan.device().name(), FormatBytes(plan.device().memory_bytes()),
      plan.devices_per_node());
  absl::StrAppendFormat(
      &out, "%3s %4s %3s %3s %3s %3s %2s %4s %4s %5s %3s %-9s %10s %4s %9s %6s %8s  %s\n", "#",
      "dp", "tp", "pp", "cp", "ep", "v", "zero", "mb", "accum", "sp", "ac", "peak/dev", "fits",
      "tokens/s", "MFU", "step", "reason");
  int index = 0;
  for (const auto& candidate : response.candidates()) {
    const v1::LayoutPlan& p = candidate.plan();
    const v1::Layout& l = p.layout();
    const bool estimated = p.has_memory();
    absl::StrAppendFormat(
        &out, "%3d %4d %3d %3d %3d %3d %2d %4d %4d %5d %3s %-9s %10s %4s %9s %6s %8s  %s\n",
        ++index, l.data_parallel(), l.tensor_parallel(), l.pipeline_parallel(),
        std::max(1, l.context_parallel()), std::max(1, l.expert_parallel()),
        std::max(1, l.pipeline_virtual_stages()), l.zero_stage(), p.micro_batch_size(),
        p.gradient_accumulation_steps(), l.sequence_parallel() ? "on" : "off", AcName(l),
        estimated ? FormatBytes(p.memory().total_bytes()) : "-", p.fits() ? "yes" : "no",
        estimated ? FormatRate(p.step_time().tokens_per_second()) : "-",
        estimated ? absl::StrFormat("%.1f%%", 100 * p.step_time().mfu()) : "-",
        estimated ? absl::StrFormat("%.3fs", p.step_time().step_seconds()) : "-",
        candidate.rejected_reason());
  }
  absl::StrAppend(&out, "\n", plan.fits() ? "Chosen: " : "", plan.explanation(), "\n");
  if (plan.has_memory()) {
    const v1::MemoryEstimate& m = plan.memory();
    absl::StrAppendFormat(
        &out,
        "Memory per device%s: weights %s, gradients %s, optimizer %s (embeddings %s of these), "
        "bf16 weight copies %s, activations %s (%s per layer x %d layers x %d micro-batches in "
        "flight), logits %s, communication %s, workspace and fragmentation %s; peak %s of %s "
        "usable.\n",
        plan.stage_memory_size() > 0 ? absl::StrCat(" (stage ", m.pipeline_stage(), ")") : "",
        FormatBytes(m.weights_bytes()), FormatBytes(m.gradients_bytes()),
        FormatBytes(m.optimizer_bytes()), FormatBytes(m.embedding_state_bytes()),
        FormatBytes(m.cast_weights_bytes()), FormatBytes(m.activations_bytes()),
        FormatBytes(m.activations_per_layer_bytes()),
        plan.model().dims().num_layers() / std::max(1, plan.layout().pipeline_parallel()),
        m.in_flight_micro_batches(), FormatBytes(m.logits_bytes()),
        FormatBytes(m.communication_bytes()), FormatBytes(m.overhead_bytes()),
        FormatBytes(m.total_bytes()), FormatBytes(m.usable_bytes()));
    // The terms of expert, context and interleaved pipeline parallelism, when the layout has them.
    std::vector<std::string> splits;
    if (m.expert_state_bytes() > 0) {
      splits.push_back(absl::StrCat("routed experts' state ", FormatBytes(m.expert_state_bytes()),
                                    " (of weights, gradients and optimizer)"));
    }
    if (m.expert_all_to_all_bytes() > 0) {
      splits.push_back(
          absl::StrCat("all-to-all buffers ", FormatBytes(m.expert_all_to_all_bytes())));
    }
    if (m.context_ring_bytes() > 0) {
      splits.push_back(absl::StrCat("ring buffers ", FormatBytes(m.context_ring_bytes())));
    }
    const v1::StepTimeEstimate& t = plan.step_time();
    if (t.expert_all_to_all_seconds() > 0) {
      splits.push_back(absl::StrFormat("expert all-to-all %.3fs per step (not overlapped)",
                                       t.expert_all_to_all_seconds()));
    }
    if (t.context_ring_seconds() > 0) {
      splits.push_back(
          absl::StrFormat("context ring %.3fs per step before overlap", t.context_ring_seconds()));
    }
    if (t.pipeline_bubble_fraction() > 0) {
      splits.push_back(absl::StrFormat(
          "pipeline bubble %.1f%% of the micro-batches' time ((pp-1)/(v x m) = %d/(%d x %d))",
          100 * t.pipeline_bubble_fraction(), plan.layout().pipeline_parallel() - 1,
          std::max(1, plan.layout().pipeline_virtual_stages()),
          plan.gradient_accumulation_steps()));
    }
    if (!splits.empty()) absl::StrAppend(&out, "Of these: ", absl::StrJoin(splits, "; "), ".\n");
  }
  return out;
}

int RunPlan(const std::string& spec_path, CoordinatorClient& client, bool json_output) {
  auto request = PlanRequestFromFlags(spec_path);
  if (!request.ok()) {
    std::cerr << "tessera plan: " << request.status().message() << "\n";
    return 2;
  }
  absl::StatusOr<v1::PlanLayoutResponse> response =
      PlansOffline(*request)
          ? planner::PlanLayoutRequest(*request,
                                       absl::FailedPreconditionError("offline: no live cluster"))
          : client.Plan(*request);
  if (!response.ok()) {
    std::cerr << "tessera plan: " << response.status().message() << "\n";
    return 1;
  }
  std::cout << (json_output ? PlanJson(*request, *response) : PlanTable(*request, *response));
  return response->plan().fits() ? 0 : 1;
}

}  // namespace tessera::client

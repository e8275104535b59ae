// `tessera plan`: the layout planner from the command line. It plans a job spec file, or a job
// described by flags (--model, --seq_len, --global_batch, --micro_batch, --precision, --gpus,
// --gpus_per_node, --device, --gpu_memory, --layout, --lora_rank), and prints the ranked layouts
// as a table or as JSON. With a device named (--device or --gpu_memory) it runs offline, with no
// coordinator; otherwise it asks the coordinator to plan for its live cluster.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "tessera/v1/coordinator_service.pb.h"

namespace tessera::client {

class CoordinatorClient;

// Builds the PlanLayout request from `spec_path` (may be empty) and the plan flags;
// INVALID_ARGUMENT naming the flag for bad values.
absl::StatusOr<v1::PlanLayoutRequest> PlanRequestFromFlags(const std::string& spec_path);

// Whether the request can be planned without a coordinator (it names its device).
bool PlansOffline(const v1::PlanLayoutRequest& request);

// Runs the command: plans locally or through `client`, prints text or JSON (`json`). Returns the
// process exit code (0 when a layout fits, 1 otherwise or on error).
int RunPlan(const std::string& spec_path, CoordinatorClient& client, bool json);

// "80GiB", "80GB", "512MiB", "85899345920" -> bytes; INVALID_ARGUMENT otherwise.
absl::StatusOr<int64_t> ParseBytes(const std::string& text);

// "peak_flops_bf16=700e12,memory_bytes=94GiB" -> the named DeviceModel fields set in `device`;
// INVALID_ARGUMENT for unknown fields or bad values.
absl::Status ParseDeviceOverrides(const std::string& text, v1::DeviceModel* device);

// "tp=4,pp=2,dp=1,zero=1,sp=on,ac=selective" -> Layout (unnamed degrees: tp, pp 1, zero 0, sp off,
// ac none; cp, ep and v (virtual pipeline stages) unset, i.e. 1; dp: what remains of the GPUs,
// filled in by the planner's checks).
absl::StatusOr<v1::Layout> ParseLayout(const std::string& text);

// The JSON document `plan --output json` prints.
std::string PlanJson(const v1::PlanLayoutRequest& request, const v1::PlanLayoutResponse& response);

// The table `plan` prints.
std::string PlanTable(const v1::PlanLayoutRequest& request, const v1::PlanLayoutResponse& response);

}  // namespace tessera::client

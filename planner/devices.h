// Device models for the layout planner: peak FLOP/s, memory and link bandwidths of common
// accelerators (and of a CPU trainer slot), looked up by preset name or by the GPU name a worker
// registers, with per-request overrides. Figures are the vendors' datasheet numbers (dense, no
// sparsity); `achievable_flops_fraction`, `reserved_bytes`, `workspace_bytes` and
// `fragmentation_fraction` are this project's estimates (docs/planner.md says which are measured).
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "tessera/v1/common.pb.h"
#include "tessera/v1/layout.pb.h"

namespace tessera::planner {

// The preset called `name` ("h100-pcie", "h100-nvl", "h100-sxm", "h200", "a100-80gb", "l40s",
// "rtx-pro-6000", "b200", "cpu"); INVALID_ARGUMENT listing the known names otherwise. Matching
// ignores case.
absl::StatusOr<v1::DeviceModel> DevicePreset(absl::string_view name);

// The preset for a GPU as NVML names it ("NVIDIA H100 80GB HBM3" -> h100-sxm); NOT_FOUND when no
// preset matches. An empty name means a CPU slot. `memory_bytes` > 0 (what the node registered)
// replaces the preset's memory, so e.g. an A100 40GB is modelled with 40 GB.
absl::StatusOr<v1::DeviceModel> DeviceForGpuName(absl::string_view gpu_name, int64_t memory_bytes);

// `base` with every non-zero field of `overrides` (name included) replacing its value.
v1::DeviceModel ApplyDeviceOverrides(v1::DeviceModel base, const v1::DeviceModel& overrides);

// Checks a (possibly overridden) model: positive peaks, bandwidths and fraction in (0, 1],
// fragmentation in [0, 1), non-negative byte counts. Memory 0 means "unknown" and is allowed only
// for CPU. Errors are INVALID_ARGUMENT naming the field ("device.memory_bytes: ...").
absl::Status ValidateDeviceModel(const v1::DeviceModel& device);

// Dense matmul peak of `device` at `precision` (bf16 or fp32; UNSPECIFIED counts as bf16 on a
// GPU and fp32 on a CPU), FLOP/s.
double PeakFlops(const v1::DeviceModel& device, v1::Precision precision);

// Whether the model is the CPU slot model (no bf16, memory shared with the host).
bool IsCpu(const v1::DeviceModel& device);

// Preset names, in the order above.
std::vector<std::string> DevicePresetNames();

}  // namespace tessera::planner

#include "planner/devices.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"

namespace tessera::planner {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kGiB = int64_t{1} << 30;

struct Entry {
  // Preset name.
  const char* name;
  // Substring of the NVML device name that selects this preset ("" for none).
  const char* nvml_match;
  v1::DeviceModel model;
};

v1::DeviceModel Gpu(const char* name, double bf16, double fp32, int64_t memory_mib,
                    double memory_bw, double intra_bw, double inter_bw) {
  v1::DeviceModel d;
  d.set_name(name);
  d.set_peak_flops_bf16(bf16);
  d.set_peak_flops_fp32(fp32);
  d.set_memory_bytes(memory_mib * kMiB);
  d.set_memory_bandwidth(memory_bw);
  d.set_intra_node_bandwidth(intra_bw);
  d.set_inter_node_bandwidth(inter_bw);
  // Large bf16 GEMMs reach 60-75% of the datasheet peak on these parts; end-to-end training adds
  // norms, softmax and launches, so the planner starts from 0.6 and scales down for small GEMMs.
  d.set_achievable_flops_fraction(0.6);
  // CUDA context, cuBLAS handles and NCCL's channel buffers live outside PyTorch's allocator.
  d.set_reserved_bytes(1 * kGiB);
  // cuBLAS workspaces (32 MiB per handle on Hopper) and cuDNN scratch inside the allocator.
  d.set_workspace_bytes(64 * kMiB);
  d.set_fragmentation_fraction(0.05);
  return d;
}

const std::vector<Entry>& Entries() {
  static const auto* entries = new std::vector<Entry>{
      // Memory in MiB as nvidia-smi reports the board; bandwidths are per GPU, per direction:
      // NVLink (or PCIe) inside a node, one 400 Gb/s (or 200 Gb/s) NIC per GPU across nodes.
      // Matched in this order, so the PCIe and NVL variants come before the SXM part.
      {"h100-pcie", "H100 PCIe", Gpu("h100-pcie", 756e12, 51e12, 81559, 2.0e12, 64e9, 50e9)},
      {"h100-nvl", "H100 NVL", Gpu("h100-nvl", 835e12, 60e12, 95830, 3.9e12, 300e9, 50e9)},
      {"h100-sxm", "H100", Gpu("h100-sxm", 989e12, 67e12, 81559, 3.35e12, 450e9, 50e9)},
      {"h200", "H200", Gpu("h200", 989e12, 67e12, 143771, 4.8e12, 450e9, 50e9)},
      {"a100-80gb", "A100", Gpu("a100-80gb", 312e12, 19.5e12, 81920, 2.039e12, 300e9, 25e9)},
      {"l40s", "L40S", Gpu("l40s", 362e12, 91.6e12, 46068, 864e9, 25e9, 12.5e9)},
      {"rtx-pro-6000", "RTX PRO 6000",
       Gpu("rtx-pro-6000", 500e12, 125e12, 97887, 1.792e12, 50e9, 25e9)},
      {"b200", "B200", Gpu("b200", 2250e12, 75e12, 183359, 8e12, 900e9, 50e9)},
      {"cpu", "",
       [] {
         v1::DeviceModel d;
         d.set_name("cpu");
         // One trainer slot (about one core with AVX2 FMA); no bf16 on CPU trainers.
         d.set_peak_flops_bf16(0);
         d.set_peak_flops_fp32(100e9);
         // Unknown: a CPU slot shares the host's memory; give it with an override.
         d.set_memory_bytes(0);
         d.set_memory_bandwidth(20e9);
         // Gloo over loopback inside a host, a 10 Gb/s network between hosts.
         d.set_intra_node_bandwidth(5e9);
         d.set_inter_node_bandwidth(1.25e9);
         d.set_achievable_flops_fraction(0.5);
         return d;
       }()},
  };
  return *entries;
}

absl::Status Invalid(absl::string_view field, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat("device.", field, ": ", problem));
}

}  // namespace

std::vector<std::string> DevicePresetNames() {
  std::vector<std::string> names;
  for (const Entry& entry : Entries()) names.emplace_back(entry.name);
  return names;
}

absl::StatusOr<v1::DeviceModel> DevicePreset(absl::string_view name) {
  for (const Entry& entry : Entries()) {
    if (absl::EqualsIgnoreCase(name, entry.name)) return entry.model;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("device '", name, "' is not a known device; known: ",
                   absl::StrJoin(DevicePresetNames(), ", "), " (or give the figures explicitly)"));
}

absl::StatusOr<v1::DeviceModel> DeviceForGpuName(absl::string_view gpu_name, int64_t memory_bytes) {
  v1::DeviceModel model;
  bool found = false;
  if (gpu_name.empty()) {
    model = *DevicePreset("cpu");
    found = true;
  }
  for (const Entry& entry : Entries()) {
    if (found) break;
    if (*entry.nvml_match != '\0' && absl::StrContains(absl::AsciiStrToLower(gpu_name),
                                                       absl::AsciiStrToLower(entry.nvml_match))) {
      model = entry.model;
      found = true;
    }
  }
  if (!found) {
    return absl::NotFoundError(absl::StrCat("no device model for GPU '", gpu_name, "'; known: ",
                                            absl::StrJoin(DevicePresetNames(), ", ")));
  }
  if (memory_bytes > 0) model.set_memory_bytes(memory_bytes);
  return model;
}

v1::DeviceModel ApplyDeviceOverrides(v1::DeviceModel base, const v1::DeviceModel& o) {
  if (!o.name().empty()) base.set_name(o.name());
  if (o.peak_flops_bf16() != 0) base.set_peak_flops_bf16(o.peak_flops_bf16());
  if (o.peak_flops_fp32() != 0) base.set_peak_flops_fp32(o.peak_flops_fp32());
  if (o.memory_bytes() != 0) base.set_memory_bytes(o.memory_bytes());
  if (o.memory_bandwidth() != 0) base.set_memory_bandwidth(o.memory_bandwidth());
  if (o.intra_node_bandwidth() != 0) base.set_intra_node_bandwidth(o.intra_node_bandwidth());
  if (o.inter_node_bandwidth() != 0) base.set_inter_node_bandwidth(o.inter_node_bandwidth());
  if (o.achievable_flops_fraction() != 0) {
    base.set_achievable_flops_fraction(o.achievable_flops_fraction());
  }
  if (o.reserved_bytes() != 0) base.set_reserved_bytes(o.reserved_bytes());
  if (o.workspace_bytes() != 0) base.set_workspace_bytes(o.workspace_bytes());
  if (o.fragmentation_fraction() != 0) base.set_fragmentation_fraction(o.fragmentation_fraction());
  return base;
}

bool IsCpu(const v1::DeviceModel& device) { return absl::EqualsIgnoreCase(device.name(), "cpu"); }

absl::Status ValidateDeviceModel(const v1::DeviceModel& d) {
  auto positive = [](double v) { return std::isfinite(v) && v > 0; };
  if (!IsCpu(d) && !positive(d.peak_flops_bf16())) {
    return Invalid("peak_flops_bf16", absl::StrCat("must be > 0, got ", d.peak_flops_bf16()));
  }
  if (!positive(d.peak_flops_fp32())) {
    return Invalid("peak_flops_fp32", absl::StrCat("must be > 0, got ", d.peak_flops_fp32()));
  }
  if (d.memory_bytes() < 0 || (d.memory_bytes() == 0 && !IsCpu(d))) {
    return Invalid("memory_bytes", absl::StrCat("must be > 0, got ", d.memory_bytes()));
  }
  if (!positive(d.memory_bandwidth())) {
    return Invalid("memory_bandwidth", absl::StrCat("must be > 0, got ", d.memory_bandwidth()));
  }
  if (!positive(d.intra_node_bandwidth())) {
    return Invalid("intra_node_bandwidth",
                   absl::StrCat("must be > 0, got ", d.intra_node_bandwidth()));
  }
  if (!positive(d.inter_node_bandwidth())) {
    return Invalid("inter_node_bandwidth",
                   absl::StrCat("must be > 0, got ", d.inter_node_bandwidth()));
  }
  if (!positive(d.achievable_flops_fraction()) || d.achievable_flops_fraction() > 1) {
    return Invalid("achievable_flops_fraction",
                   absl::StrCat("must be in (0, 1], got ", d.achievable_flops_fraction()));
  }
  if (d.reserved_bytes() < 0 || d.workspace_bytes() < 0) {
    return Invalid("reserved_bytes", "reserved_bytes and workspace_bytes must be >= 0");
  }
  if (!std::isfinite(d.fragmentation_fraction()) || d.fragmentation_fraction() < 0 ||
      d.fragmentation_fraction() >= 1) {
    return Invalid("fragmentation_fraction",
                   absl::StrCat("must be in [0, 1), got ", d.fragmentation_fraction()));
  }
  return absl::OkStatus();
}

double PeakFlops(const v1::DeviceModel& device, v1::Precision precision) {
  if (precision == v1::PRECISION_FP32 || IsCpu(device)) return device.peak_flops_fp32();
  return device.peak_flops_bf16();
}

}  // namespace tessera::planner

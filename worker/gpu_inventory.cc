#include "worker/gpu_inventory.h"

#include <dlfcn.h>

#include <cstring>
#include <set>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "planner/devices.h"

namespace tessera::worker {
namespace {

// The few NVML types and constants used here, as documented in nvml.h (NVML API reference,
// "Device Structs" and "Device Enums"); declared here so that no NVML header is needed to build.
using nvmlReturn_t = int;
using nvmlDevice_t = struct nvmlDevice_st*;
constexpr nvmlReturn_t kNvmlSuccess = 0;
constexpr int kNvmlTemperatureGpu = 0;            // nvmlTemperatureSensors_t NVML_TEMPERATURE_GPU
constexpr int kNvmlClockSm = 1;                   // nvmlClockType_t NVML_CLOCK_SM
constexpr int kNvmlMemoryErrorUncorrected = 1;    // nvmlMemoryErrorType_t
constexpr int kNvmlVolatileEcc = 0;               // nvmlEccCounterType_t
constexpr unsigned int kNvmlNameBufferSize = 96;  // NVML_DEVICE_NAME_V2_BUFFER_SIZE
constexpr unsigned int kNvmlUuidBufferSize = 96;  // NVML_DEVICE_UUID_V2_BUFFER_SIZE

struct nvmlMemory_t {
  unsigned long long total;  // NOLINT(runtime/int): NVML's declared type.
  unsigned long long free;   // NOLINT(runtime/int)
  unsigned long long used;   // NOLINT(runtime/int)
};

struct nvmlUtilization_t {
  unsigned int gpu;
  unsigned int memory;
};

struct nvmlPciInfo_t {
  char bus_id_legacy[16];  // NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE
  unsigned int domain;
  unsigned int bus;
  unsigned int device;
  unsigned int pci_device_id;
  unsigned int pci_sub_system_id;
  char bus_id[32];  // NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE
};

// NVML's entry points, resolved with dlsym. Optional ones may be null.
struct NvmlApi {
  nvmlReturn_t (*init)();
  nvmlReturn_t (*shutdown)();
  const char* (*error_string)(nvmlReturn_t);  // Optional.
  nvmlReturn_t (*get_count)(unsigned int*);
  nvmlReturn_t (*get_handle_by_index)(unsigned int, nvmlDevice_t*);
  nvmlReturn_t (*get_name)(nvmlDevice_t, char*, unsigned int);
  nvmlReturn_t (*get_uuid)(nvmlDevice_t, char*, unsigned int);
  nvmlReturn_t (*get_memory_info)(nvmlDevice_t, nvmlMemory_t*);
  nvmlReturn_t (*get_pci_info)(nvmlDevice_t, nvmlPciInfo_t*);  // Optional.
  nvmlReturn_t (*get_cuda_compute_capability)(nvmlDevice_t, int*, int*);
  nvmlReturn_t (*get_utilization_rates)(nvmlDevice_t, nvmlUtilization_t*);
  nvmlReturn_t (*get_power_usage)(nvmlDevice_t, unsigned int*);
  nvmlReturn_t (*get_temperature)(nvmlDevice_t, int, unsigned int*);
  nvmlReturn_t (*get_clock_info)(nvmlDevice_t, int, unsigned int*);
  // Optional. NOLINTNEXTLINE(runtime/int): NVML's declared type.
  nvmlReturn_t (*get_total_ecc_errors)(nvmlDevice_t, int, int, unsigned long long*);
};

// Resolves `name` into `*fn`; false if it is missing.
template <typename Fn>
bool Resolve(void* library, const char* name, Fn** fn) {
  *fn = reinterpret_cast<Fn*>(dlsym(library, name));
  return *fn != nullptr;
}

// Fills `api` from `library`; on a missing required symbol returns its name, else "".
std::string ResolveApi(void* library, NvmlApi& api) {
  struct Required {
    const char* name;
    bool found;
  };
  const Required required[] = {
      {"nvmlInit_v2", Resolve(library, "nvmlInit_v2", &api.init)},
      {"nvmlShutdown", Resolve(library, "nvmlShutdown", &api.shutdown)},
      {"nvmlDeviceGetCount_v2", Resolve(library, "nvmlDeviceGetCount_v2", &api.get_count)},
      {"nvmlDeviceGetHandleByIndex_v2",
       Resolve(library, "nvmlDeviceGetHandleByIndex_v2", &api.get_handle_by_index)},
      {"nvmlDeviceGetName", Resolve(library, "nvmlDeviceGetName", &api.get_name)},
      {"nvmlDeviceGetUUID", Resolve(library, "nvmlDeviceGetUUID", &api.get_uuid)},
      {"nvmlDeviceGetMemoryInfo",
       Resolve(library, "nvmlDeviceGetMemoryInfo", &api.get_memory_info)},
      {"nvmlDeviceGetCudaComputeCapability",
       Resolve(library, "nvmlDeviceGetCudaComputeCapability", &api.get_cuda_compute_capability)},
      {"nvmlDeviceGetUtilizationRates",
       Resolve(library, "nvmlDeviceGetUtilizationRates", &api.get_utilization_rates)},
      {"nvmlDeviceGetPowerUsage",
       Resolve(library, "nvmlDeviceGetPowerUsage", &api.get_power_usage)},
      {"nvmlDeviceGetTemperature",
       Resolve(library, "nvmlDeviceGetTemperature", &api.get_temperature)},
      {"nvmlDeviceGetClockInfo", Resolve(library, "nvmlDeviceGetClockInfo", &api.get_clock_info)},
  };
  Resolve(library, "nvmlErrorString", &api.error_string);
  Resolve(library, "nvmlDeviceGetPciInfo_v3", &api.get_pci_info);
  Resolve(library, "nvmlDeviceGetTotalEccErrors", &api.get_total_ecc_errors);
  for (const Required& symbol : required) {
    if (!symbol.found) return symbol.name;
  }
  return "";
}

// Copies a NUL-terminated string out of a fixed buffer that NVML may have left unterminated.
std::string FromBuffer(const char* buffer, size_t size) {
  return std::string(buffer, strnlen(buffer, size));
}

class NvmlBackend final : public GpuBackend {
 public:
  // Takes ownership of `library`, on which NVML has been initialised.
  NvmlBackend(void* library, const NvmlApi& api) : library_(library), api_(api) {}
  NvmlBackend(const NvmlBackend&) = delete;
  NvmlBackend& operator=(const NvmlBackend&) = delete;

  ~NvmlBackend() override {
    api_.shutdown();
    dlclose(library_);
  }

  std::vector<v1::GpuDevice> Devices() override {
    std::vector<v1::GpuDevice> devices;
    for (const auto& [index, handle] : Handles()) {
      v1::GpuDevice& device = devices.emplace_back();
      device.set_index(static_cast<int32_t>(index));
      char uuid[kNvmlUuidBufferSize] = {};
      if (api_.get_uuid(handle, uuid, sizeof(uuid)) == kNvmlSuccess) {
        device.set_uuid(FromBuffer(uuid, sizeof(uuid)));
      }
      char name[kNvmlNameBufferSize] = {};
      if (api_.get_name(handle, name, sizeof(name)) == kNvmlSuccess) {
        device.set_name(FromBuffer(name, sizeof(name)));
      }
      nvmlMemory_t memory = {};
      if (api_.get_memory_info(handle, &memory) == kNvmlSuccess) {
        device.set_memory_bytes(static_cast<int64_t>(memory.total));
      }
      nvmlPciInfo_t pci = {};
      if (api_.get_pci_info != nullptr && api_.get_pci_info(handle, &pci) == kNvmlSuccess) {
        device.set_pci_bus_id(FromBuffer(pci.bus_id, sizeof(pci.bus_id)));
      }
      int major = 0;
      int minor = 0;
      if (api_.get_cuda_compute_capability(handle, &major, &minor) == kNvmlSuccess) {
        device.set_compute_capability_major(major);
        device.set_compute_capability_minor(minor);
      }
      device.set_peak_bf16_flops(PeakBf16Flops(device.name()));
    }
    return devices;
  }

  std::vector<GpuSample> Sample() override {
    std::vector<GpuSample> samples;
    for (const auto& [index, handle] : Handles()) {
      GpuSample& sample = samples.emplace_back();
      v1::GpuMetrics& metrics = sample.metrics;
      metrics.set_index(static_cast<int32_t>(index));
      nvmlUtilization_t utilization = {};
      if (api_.get_utilization_rates(handle, &utilization) == kNvmlSuccess) {
        metrics.set_utilization_percent(utilization.gpu);
        metrics.set_memory_utilization_percent(utilization.memory);
      }
      nvmlMemory_t memory = {};
      if (api_.get_memory_info(handle, &memory) == kNvmlSuccess) {
        metrics.set_memory_used_bytes(static_cast<int64_t>(memory.used));
        metrics.set_memory_total_bytes(static_cast<int64_t>(memory.total));
      }
      unsigned int value = 0;
      if (api_.get_power_usage(handle, &value) == kNvmlSuccess) {
        metrics.set_power_watts(value / 1000.0);  // NVML reports milliwatts.
      }
      if (api_.get_temperature(handle, kNvmlTemperatureGpu, &value) == kNvmlSuccess) {
        metrics.set_temperature_celsius(value);
      }
      if (api_.get_clock_info(handle, kNvmlClockSm, &value) == kNvmlSuccess) {
        metrics.set_sm_clock_mhz(value);
      }
      unsigned long long ecc = 0;  // NOLINT(runtime/int): NVML's declared type.
      if (api_.get_total_ecc_errors != nullptr &&
          api_.get_total_ecc_errors(handle, kNvmlMemoryErrorUncorrected, kNvmlVolatileEcc, &ecc) ==
              kNvmlSuccess) {
        sample.ecc_uncorrected = static_cast<int64_t>(ecc);
      }
      const absl::Time now = absl::Now();
      const int64_t seconds = absl::ToUnixSeconds(now);
      metrics.mutable_time()->set_seconds(seconds);
      metrics.mutable_time()->set_nanos(
          static_cast<int32_t>(absl::ToInt64Nanoseconds(now - absl::FromUnixSeconds(seconds))));
    }
    return samples;
  }

 private:
  // Handles of the GPUs NVML can open now, by index; one NVML cannot open (lost, or not visible
  // to this process) is skipped.
  std::vector<std::pair<unsigned int, nvmlDevice_t>> Handles() {
    std::vector<std::pair<unsigned int, nvmlDevice_t>> handles;
    unsigned int count = 0;
    if (api_.get_count(&count) != kNvmlSuccess) return handles;
    for (unsigned int index = 0; index < count; ++index) {
      nvmlDevice_t handle = nullptr;
      if (api_.get_handle_by_index(index, &handle) == kNvmlSuccess) {
        handles.emplace_back(index, handle);
      }
    }
    return handles;
  }

  void* const library_;
  const NvmlApi api_;
};

// Families in the order of DcgmExporter's gauge arrays, with dcgm-exporter's help texts.
struct Field {
  const char* name;
  const char* help;
};
constexpr Field kFields[] = {
    {"DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %)."},
    {"DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %)."},
    {"DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB)."},
    {"DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB)."},
    {"DCGM_FI_DEV_POWER_USAGE", "Power draw (in W)."},
    {"DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C)."},
    {"DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz)."},
    {"DCGM_FI_DEV_XID_ERRORS", "Number of XID errors."},
    {"DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "Total number of double-bit volatile ECC errors."},
};

// Whole MiB, as dcgm-exporter reports framebuffer memory.
double WholeMib(int64_t bytes) { return bytes <= 0 ? 0.0 : static_cast<double>(bytes >> 20); }

}  // namespace

double PeakBf16Flops(absl::string_view name) {
  auto device = planner::DeviceForGpuName(name, 0);
  return device.ok() && !name.empty() ? device->peak_flops_bf16() : 0.0;
}

std::unique_ptr<GpuBackend> LoadNvml(std::string* error) {
  auto fail = [error](std::string why) -> std::unique_ptr<GpuBackend> {
    if (error != nullptr) *error = std::move(why);
    return nullptr;
  };
  void* library = nullptr;
  std::string dl_errors;
  for (const char* path : {"libnvidia-ml.so.1", "libnvidia-ml.so"}) {
    library = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (library != nullptr) break;
    const char* why = dlerror();
    absl::StrAppend(&dl_errors, dl_errors.empty() ? "" : "; ", why != nullptr ? why : path);
  }
  if (library == nullptr) return fail(absl::StrCat("NVML not loaded: ", dl_errors));

  NvmlApi api = {};
  if (std::string missing = ResolveApi(library, api); !missing.empty()) {
    dlclose(library);
    return fail(absl::StrCat("NVML library lacks ", missing));
  }
  if (const nvmlReturn_t status = api.init(); status != kNvmlSuccess) {
    const char* text = api.error_string != nullptr ? api.error_string(status) : nullptr;
    std::string why = absl::StrCat("nvmlInit_v2 failed: ", text != nullptr ? text : "error ",
                                   text != nullptr ? "" : absl::StrCat(status));
    dlclose(library);
    return fail(std::move(why));
  }
  return std::make_unique<NvmlBackend>(library, api);
}

DcgmExporter::DcgmExporter(prometheus::Registry& registry, std::string hostname)
    : hostname_(std::move(hostname)) {
  static_assert(std::size(kFields) == kNumFields);
  for (int i = 0; i < kNumFields; ++i) {
    families_[i] =
        &prometheus::BuildGauge().Name(kFields[i].name).Help(kFields[i].help).Register(registry);
  }
}

void DcgmExporter::Update(const std::vector<v1::GpuDevice>& devices,
                          const std::vector<GpuSample>& samples) {
  std::map<int32_t, const v1::GpuDevice*> by_index;
  for (const v1::GpuDevice& device : devices) by_index[device.index()] = &device;

  absl::MutexLock lock(&mutex_);
  std::set<prometheus::Labels> current;
  for (const GpuSample& sample : samples) {
    const v1::GpuMetrics& m = sample.metrics;
    const auto device = by_index.find(m.index());
    if (device == by_index.end()) continue;
    prometheus::Labels labels = {{"gpu", absl::StrCat(m.index())},
                                 {"UUID", device->second->uuid()},
                                 {"Hostname", hostname_},
                                 {"modelName", device->second->name()}};
    auto [it, inserted] = series_.try_emplace(labels);
    if (inserted) {
      for (int i = 0; i < kNumFields; ++i) it->second[i] = &families_[i]->Add(labels);
    }
    const double values[kNumFields] = {
        m.utilization_percent(),
        m.memory_utilization_percent(),
        WholeMib(m.memory_used_bytes()),
        WholeMib(m.memory_total_bytes() - m.memory_used_bytes()),
        m.power_watts(),
        m.temperature_celsius(),
        m.sm_clock_mhz(),
        static_cast<double>(sample.xid_errors),
        static_cast<double>(sample.ecc_uncorrected),
    };
    for (int i = 0; i < kNumFields; ++i) it->second[i]->Set(values[i]);
    current.insert(std::move(labels));
  }
  for (auto it = series_.begin(); it != series_.end();) {
    if (current.contains(it->first)) {
      ++it;
      continue;
    }
    for (int i = 0; i < kNumFields; ++i) families_[i]->Remove(it->second[i]);
    it = series_.erase(it);
  }
}

}  // namespace tessera::worker

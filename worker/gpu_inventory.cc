#include "worker/gpu_inventory.h"

#include <dlfcn.h>

#include <cstring>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
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
constexpr nvmlReturn_t kNvmlErrorTimeout = 10;    // NVML_ERROR_TIMEOUT
constexpr int kNvmlMemoryErrorCorrected = 0;      // nvmlMemoryErrorType_t
constexpr int kNvmlMemoryErrorUncorrected = 1;    // nvmlMemoryErrorType_t
constexpr int kNvmlVolatileEcc = 0;               // nvmlEccCounterType_t
constexpr unsigned int kNvmlNameBufferSize = 96;  // NVML_DEVICE_NAME_V2_BUFFER_SIZE
constexpr unsigned int kNvmlUuidBufferSize = 96;  // NVML_DEVICE_UUID_V2_BUFFER_SIZE

// nvmlEventTypeXidCriticalError: the event's data is the Xid.
constexpr unsigned long long kNvmlEventTypeXidCriticalError = 0x8;  // NOLINT(runtime/int)
using nvmlEventSet_t = struct nvmlEventSet_st*;

struct nvmlEventData_t {
  nvmlDevice_t device;
  unsigned long long event_type;  // NOLINT(runtime/int): NVML's declared type.
  unsigned long long event_data;  // NOLINT(runtime/int)
  unsigned int gpu_instance_id;
  unsigned int compute_instance_id;
};

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
  // Optional: nvmlDeviceGetCurrentClocksEventReasons (R535 on), else the older
  // nvmlDeviceGetCurrentClocksThrottleReasons. NOLINTNEXTLINE(runtime/int)
  nvmlReturn_t (*get_clock_reasons)(nvmlDevice_t, unsigned long long*);
  // Optional, all four or none: Xid events.
  nvmlReturn_t (*event_set_create)(nvmlEventSet_t*);
  // NOLINTNEXTLINE(runtime/int): NVML's declared type.
  nvmlReturn_t (*register_events)(nvmlDevice_t, unsigned long long, nvmlEventSet_t);
  nvmlReturn_t (*event_set_wait)(nvmlEventSet_t, nvmlEventData_t*, unsigned int);
  nvmlReturn_t (*event_set_free)(nvmlEventSet_t);
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
  if (!Resolve(library, "nvmlDeviceGetCurrentClocksEventReasons", &api.get_clock_reasons)) {
    Resolve(library, "nvmlDeviceGetCurrentClocksThrottleReasons", &api.get_clock_reasons);
  }
  // Every one resolved (no short circuit); Xid events need all four.
  bool events = true;
  for (const bool resolved :
       {Resolve(library, "nvmlEventSetCreate", &api.event_set_create),
        Resolve(library, "nvmlDeviceRegisterEvents", &api.register_events),
        Resolve(library, "nvmlEventSetWait_v2", &api.event_set_wait),
        Resolve(library, "nvmlEventSetFree", &api.event_set_free)}) {
    events = events && resolved;
  }
  if (!events) api.event_set_create = nullptr;
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
  // Takes ownership of `library`, on which NVML has been initialised; starts watching for Xid
  // events where the driver can deliver them.
  NvmlBackend(void* library, const NvmlApi& api) : library_(library), api_(api) {
    WatchXidEvents();
  }
  NvmlBackend(const NvmlBackend&) = delete;
  NvmlBackend& operator=(const NvmlBackend&) = delete;

  ~NvmlBackend() override {
    stop_.Notify();
    if (xid_thread_.joinable()) xid_thread_.join();
    if (event_set_ != nullptr) api_.event_set_free(event_set_);
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
        metrics.set_ecc_uncorrected_errors(static_cast<int64_t>(ecc));
      }
      if (api_.get_total_ecc_errors != nullptr &&
          api_.get_total_ecc_errors(handle, kNvmlMemoryErrorCorrected, kNvmlVolatileEcc, &ecc) ==
              kNvmlSuccess) {
        metrics.set_ecc_corrected_errors(static_cast<int64_t>(ecc));
      }
      unsigned long long reasons = 0;  // NOLINT(runtime/int): NVML's declared type.
      if (api_.get_clock_reasons != nullptr &&
          api_.get_clock_reasons(handle, &reasons) == kNvmlSuccess) {
        metrics.set_clock_throttle_reasons(reasons);
      }
      {
        absl::MutexLock lock(&xid_mu_);
        if (auto xid = xids_.find(handle); xid != xids_.end()) {
          metrics.set_xid_errors(xid->second.count);
          metrics.set_last_xid(xid->second.last);
        }
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

  // Registers every GPU that supports them for Xid critical-error events and starts the thread
  // that counts them. A driver without events, or GPUs that refuse them, only leave the counts 0.
  void WatchXidEvents() {
    if (api_.event_set_create == nullptr || api_.event_set_create(&event_set_) != kNvmlSuccess) {
      event_set_ = nullptr;
      return;
    }
    bool any = false;
    for (const auto& [index, handle] : Handles()) {
      any |=
          api_.register_events(handle, kNvmlEventTypeXidCriticalError, event_set_) == kNvmlSuccess;
    }
    if (any) xid_thread_ = std::thread([this] { XidLoop(); });
  }

  void XidLoop() {
    const auto wait_ms = static_cast<unsigned int>(absl::ToInt64Milliseconds(kXidEventWait));
    while (!stop_.HasBeenNotified()) {
      nvmlEventData_t event = {};
      const nvmlReturn_t status = api_.event_set_wait(event_set_, &event, wait_ms);
      if (status == kNvmlErrorTimeout) continue;
      if (status != kNvmlSuccess) {
        // A lost GPU can make every wait fail at once: do not spin.
        stop_.WaitForNotificationWithTimeout(kXidEventWait);
        continue;
      }
      if ((event.event_type & kNvmlEventTypeXidCriticalError) == 0) continue;
      absl::MutexLock lock(&xid_mu_);
      XidCount& xid = xids_[event.device];
      ++xid.count;
      xid.last = static_cast<int32_t>(event.event_data);
    }
  }

  struct XidCount {
    int64_t count = 0;
    int32_t last = 0;
  };

  void* const library_;
  const NvmlApi api_;
  nvmlEventSet_t event_set_ = nullptr;
  absl::Notification stop_;
  std::thread xid_thread_;
  absl::Mutex xid_mu_;
  // Xid events by the device NVML named in them.
  std::map<nvmlDevice_t, XidCount> xids_ ABSL_GUARDED_BY(xid_mu_);
};

// Families in the order of DcgmExporter's arrays, with dcgm-exporter's help texts.
struct Field {
  const char* name;
  const char* help;
};
constexpr Field kGauges[] = {
    {"DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %)."},
    {"DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %)."},
    {"DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB)."},
    {"DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB)."},
    {"DCGM_FI_DEV_POWER_USAGE", "Power draw (in W)."},
    {"DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C)."},
    {"DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz)."},
    {"DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered."},
    {"DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "Current clock throttle reasons."},
};
constexpr Field kCounters[] = {
    {"DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "Total number of single-bit volatile ECC errors."},
    {"DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "Total number of double-bit volatile ECC errors."},
    {"tessera_gpu_xid_errors_total",
     "Xid critical-error events NVML delivered since the worker started watching the GPU."},
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
  static_assert(std::size(kGauges) == kNumGauges);
  static_assert(std::size(kCounters) == kNumCounters);
  for (int i = 0; i < kNumGauges; ++i) {
    gauge_families_[i] =
        &prometheus::BuildGauge().Name(kGauges[i].name).Help(kGauges[i].help).Register(registry);
  }
  for (int i = 0; i < kNumCounters; ++i) {
    counter_families_[i] = &prometheus::BuildCounter()
                                .Name(kCounters[i].name)
                                .Help(kCounters[i].help)
                                .Register(registry);
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
    Series& series = it->second;
    if (inserted) {
      for (int i = 0; i < kNumGauges; ++i) series.gauges[i] = &gauge_families_[i]->Add(labels);
      for (int i = 0; i < kNumCounters; ++i) {
        series.counters[i] = &counter_families_[i]->Add(labels);
      }
    }
    const double gauges[kNumGauges] = {
        m.utilization_percent(),
        m.memory_utilization_percent(),
        WholeMib(m.memory_used_bytes()),
        WholeMib(m.memory_total_bytes() - m.memory_used_bytes()),
        m.power_watts(),
        m.temperature_celsius(),
        m.sm_clock_mhz(),
        static_cast<double>(m.last_xid()),
        static_cast<double>(m.clock_throttle_reasons()),
    };
    for (int i = 0; i < kNumGauges; ++i) series.gauges[i]->Set(gauges[i]);
    const double totals[kNumCounters] = {
        static_cast<double>(m.ecc_corrected_errors()),
        static_cast<double>(m.ecc_uncorrected_errors()),
        static_cast<double>(m.xid_errors()),
    };
    for (int i = 0; i < kNumCounters; ++i) {
      const double increase = totals[i] - series.counters[i]->Value();
      if (increase < 0) {
        // The total went down (the driver reloaded and reset its volatile counts): a new
        // series, which Prometheus's rate() reads as a counter reset.
        counter_families_[i]->Remove(series.counters[i]);
        series.counters[i] = &counter_families_[i]->Add(labels);
        series.counters[i]->Increment(totals[i]);
      } else {
        series.counters[i]->Increment(increase);
      }
    }
    current.insert(std::move(labels));
  }
  for (auto it = series_.begin(); it != series_.end();) {
    if (current.contains(it->first)) {
      ++it;
      continue;
    }
    for (int i = 0; i < kNumGauges; ++i) gauge_families_[i]->Remove(it->second.gauges[i]);
    for (int i = 0; i < kNumCounters; ++i) counter_families_[i]->Remove(it->second.counters[i]);
    it = series_.erase(it);
  }
}

}  // namespace tessera::worker

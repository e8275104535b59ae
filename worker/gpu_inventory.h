// GPU inventory and metrics for the worker: the node's GPUs and periodic samples of their
// utilisation, memory, power, temperature, clocks and errors, read through NVML, which is loaded
// at run time with dlopen so that one binary runs on GPU and CPU-only nodes alike (no CUDA or NVML
// at build time). DcgmExporter publishes the samples on the worker's Prometheus registry under
// dcgm-exporter's metric and label names, so dashboards and alerts written for dcgm-exporter work
// unchanged.
//
// Indices are NVML's, which follow PCI bus order; CUDA numbers devices the same way only under
// CUDA_DEVICE_ORDER=PCI_BUS_ID, which whoever launches CUDA processes on these indices must set.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/labels.h"
#include "prometheus/registry.h"
#include "tessera/v1/metrics.pb.h"
#include "tessera/v1/node.pb.h"

namespace tessera::worker {

// One sample of one GPU. `metrics.index` names the GPU (GpuDevice::index); fields NVML cannot
// read (an older driver, ECC off) stay 0.
struct GpuSample {
  v1::GpuMetrics metrics;
};

// The NVML calls the worker needs, behind an interface so tests can fake them. Thread safety:
// implementations may be called from any thread (NVML itself is thread-safe).
class GpuBackend {
 public:
  virtual ~GpuBackend() = default;
  // Every GPU NVML can open, in index order: index, uuid, name, memory_bytes, pci_bus_id, compute
  // capability and peak_bf16_flops (PeakBf16Flops of the name). Fields NVML cannot read stay unset.
  virtual std::vector<v1::GpuDevice> Devices() = 0;
  // One sample per GPU, taken now: utilisation, memory used/total, power (W), temperature (C),
  // SM clock (MHz), volatile ECC error counts, the clock throttle reasons and time; the Xid
  // critical errors delivered since the backend was created, and the newest one's Xid.
  virtual std::vector<GpuSample> Sample() = 0;
};

// Dense bf16 peak FLOP/s of a GPU from its NVML product name, for MFU, from the planner's device
// presets (planner/devices.h): e.g. 989e12 for H100 SXM and H200, 835e12 for H100 NVL, 756e12 for
// H100 PCIe, 312e12 for A100; 0 when no preset matches.
double PeakBf16Flops(absl::string_view name);

// Loads NVML: dlopen("libnvidia-ml.so.1"), falling back to "libnvidia-ml.so", resolves the
// functions it needs and calls nvmlInit_v2. Returns nullptr (not an error) when the library is
// absent, a required function is missing or nvmlInit fails, i.e. on a CPU-only node; `error` (may
// be null) then receives why, for a log line. Functions an older driver lacks (ECC counts, clock
// throttle reasons, events) only leave their fields 0. The backend watches for Xid critical-error
// events on a thread of its own (waits of kXidEventWait), and stops it, frees the event set, shuts
// NVML down and unloads the library when destroyed.
std::unique_ptr<GpuBackend> LoadNvml(std::string* error);

// Longest wait of the Xid event thread for an event; also how long destroying the backend may
// wait for that thread.
inline constexpr absl::Duration kXidEventWait = absl::Milliseconds(500);

// Exports GPU samples on a Prometheus registry under dcgm-exporter's names, each series labelled
// gpu="<index>", UUID="<uuid>", Hostname="<host>", modelName="<name>". Gauges:
//   DCGM_FI_DEV_GPU_UTIL                 GPU utilisation, %
//   DCGM_FI_DEV_MEM_COPY_UTIL            memory-controller utilisation, %
//   DCGM_FI_DEV_FB_USED                  framebuffer memory used, MiB (whole MiB, as dcgm-exporter)
//   DCGM_FI_DEV_FB_FREE                  framebuffer memory free (total - used), MiB
//   DCGM_FI_DEV_POWER_USAGE              power draw, W
//   DCGM_FI_DEV_GPU_TEMP                 GPU temperature, C
//   DCGM_FI_DEV_SM_CLOCK                 SM clock, MHz
//   DCGM_FI_DEV_XID_ERRORS               the newest Xid (dcgm-exporter's meaning), 0 when none
//   DCGM_FI_DEV_CLOCK_THROTTLE_REASONS   NVML's clock throttle reasons bitmask
// Counters (each follows the sample's total; a total that went down, the driver reloaded, starts
// the series again from it):
//   DCGM_FI_DEV_ECC_SBE_VOL_TOTAL        corrected (single-bit) volatile ECC errors
//   DCGM_FI_DEV_ECC_DBE_VOL_TOTAL        uncorrected (double-bit) volatile ECC errors
//   tessera_gpu_xid_errors_total         Xid critical-error events
// Thread safety: every method may be called from any thread (one absl::Mutex guards the series);
// the registry must outlive this object.
class DcgmExporter {
 public:
  DcgmExporter(prometheus::Registry& registry, std::string hostname);
  DcgmExporter(const DcgmExporter&) = delete;
  DcgmExporter& operator=(const DcgmExporter&) = delete;

  // Sets every series from `samples`, each matched to the device of the same index for its labels
  // (a sample whose index is in no device is dropped). Series of GPUs absent from this call are
  // removed, so a vanished GPU leaves no stale values.
  void Update(const std::vector<v1::GpuDevice>& devices, const std::vector<GpuSample>& samples)
      ABSL_LOCKS_EXCLUDED(mutex_);

 private:
  static constexpr int kNumGauges = 9;
  static constexpr int kNumCounters = 3;
  // One GPU's series, indexed like kGauges and kCounters in the .cc file; owned by the registry.
  struct Series {
    std::array<prometheus::Gauge*, kNumGauges> gauges;
    std::array<prometheus::Counter*, kNumCounters> counters;
  };

  const std::string hostname_;
  std::array<prometheus::Family<prometheus::Gauge>*, kNumGauges> gauge_families_;
  std::array<prometheus::Family<prometheus::Counter>*, kNumCounters> counter_families_;
  absl::Mutex mutex_;
  // Series of the last Update, by label set.
  std::map<prometheus::Labels, Series> series_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace tessera::worker

// GPU inventory: NVML loading on a machine without NVML, peak FLOP/s by product name, and the
// dcgm-exporter exposition of samples from a fake backend.

#include "worker/gpu_inventory.h"

#include <dlfcn.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"

namespace tessera::worker {
namespace {

using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using ::testing::SizeIs;

constexpr int64_t kMib = 1024 * 1024;
constexpr int64_t kGib = 1024 * kMib;

// A GPU backend with fixed devices whose samples the test sets.
class FakeGpuBackend final : public GpuBackend {
 public:
  explicit FakeGpuBackend(std::vector<v1::GpuDevice> devices) : devices_(std::move(devices)) {}
  std::vector<v1::GpuDevice> Devices() override { return devices_; }
  std::vector<GpuSample> Sample() override { return samples_; }
  void SetSamples(std::vector<GpuSample> samples) { samples_ = std::move(samples); }

 private:
  std::vector<v1::GpuDevice> devices_;
  std::vector<GpuSample> samples_;
};

v1::GpuDevice Device(int index, std::string uuid, std::string name) {
  v1::GpuDevice device;
  device.set_index(index);
  device.set_uuid(std::move(uuid));
  device.set_name(name);
  device.set_memory_bytes(80 * kGib);
  device.set_peak_bf16_flops(PeakBf16Flops(name));
  return device;
}

GpuSample Sample(int index, double utilization, int64_t used_bytes, double power_watts) {
  GpuSample sample;
  sample.metrics.set_index(index);
  sample.metrics.set_utilization_percent(utilization);
  sample.metrics.set_memory_utilization_percent(utilization / 2);
  sample.metrics.set_memory_used_bytes(used_bytes);
  sample.metrics.set_memory_total_bytes(80 * kGib);
  sample.metrics.set_power_watts(power_watts);
  sample.metrics.set_temperature_celsius(61);
  sample.metrics.set_sm_clock_mhz(1980);
  return sample;
}

// Every line of the exposition, so that a test matches whole lines: a substring match would take
// `x{...} 10` for `x{...} 1`.
std::vector<std::string> Lines(prometheus::Registry& registry) {
  return absl::StrSplit(prometheus::TextSerializer().Serialize(registry.Collect()), '\n',
                        absl::SkipEmpty());
}

// The labels dcgm-exporter puts on a GPU's series, in the serializer's (sorted) order.
std::string Labels(int index, const std::string& uuid, const std::string& name) {
  return "{Hostname=\"node-7\",UUID=\"" + uuid + "\",gpu=\"" + std::to_string(index) +
         "\",modelName=\"" + name + "\"}";
}

TEST(GpuInventoryTest, LoadNvmlWithoutNvmlReturnsNullWithReason) {
  void* nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (nvml != nullptr) {
    dlclose(nvml);
    GTEST_SKIP() << "libnvidia-ml.so.1 is present; this test needs a machine without NVML";
  }
  std::string error;
  EXPECT_EQ(LoadNvml(&error), nullptr);
  EXPECT_THAT(error, HasSubstr("libnvidia-ml.so"));
  // A null `error` is allowed.
  EXPECT_EQ(LoadNvml(nullptr), nullptr);
}

TEST(GpuInventoryTest, LoadNvmlWithNvmlListsAndSamplesDevices) {
  std::string error;
  std::unique_ptr<GpuBackend> backend = LoadNvml(&error);
  if (backend == nullptr) GTEST_SKIP() << "no NVML here: " << error;
  const std::vector<v1::GpuDevice> devices = backend->Devices();
  const std::vector<GpuSample> samples = backend->Sample();
  ASSERT_THAT(samples, SizeIs(devices.size()));
  for (size_t i = 0; i < devices.size(); ++i) {
    EXPECT_EQ(devices[i].index(), samples[i].metrics.index());
    EXPECT_THAT(devices[i].uuid(), HasSubstr("GPU-"));
    EXPECT_THAT(devices[i].name(), Not(IsEmpty()));
    EXPECT_GT(devices[i].memory_bytes(), 0);
    EXPECT_GT(devices[i].compute_capability_major(), 0);
    EXPECT_EQ(samples[i].metrics.memory_total_bytes(), devices[i].memory_bytes());
    EXPECT_GT(samples[i].metrics.power_watts(), 0);
    EXPECT_GT(samples[i].metrics.time().seconds(), 0);
    // No Xid is expected on a healthy machine; a count without a newest Xid would be a bug.
    EXPECT_EQ(samples[i].metrics.xid_errors() == 0, samples[i].metrics.last_xid() == 0);
    EXPECT_GE(samples[i].metrics.ecc_corrected_errors(), 0);
    EXPECT_GE(samples[i].metrics.ecc_uncorrected_errors(), 0);
  }
  // Destroying the backend stops its Xid event thread within one wait.
  const absl::Time start = absl::Now();
  backend.reset();
  EXPECT_LT(absl::Now() - start, kXidEventWait + absl::Seconds(2));
}

TEST(GpuInventoryTest, PeakBf16FlopsByName) {
  EXPECT_EQ(PeakBf16Flops("NVIDIA H100 80GB HBM3"), 989e12);
  EXPECT_EQ(PeakBf16Flops("NVIDIA H200"), 989e12);
  EXPECT_EQ(PeakBf16Flops("NVIDIA H100 PCIe"), 756e12);
  EXPECT_EQ(PeakBf16Flops("NVIDIA H100 NVL"), 835e12);
  EXPECT_EQ(PeakBf16Flops("NVIDIA A100-SXM4-80GB"), 312e12);
  EXPECT_EQ(PeakBf16Flops("NVIDIA A100 80GB PCIe"), 312e12);
  EXPECT_EQ(PeakBf16Flops("Tesla V100-SXM2-32GB"), 0);
  EXPECT_EQ(PeakBf16Flops(""), 0);
}

TEST(GpuInventoryTest, ExportsSamplesUnderDcgmNames) {
  FakeGpuBackend backend({Device(0, "GPU-aaaa", "NVIDIA H100 80GB HBM3"),
                          Device(1, "GPU-bbbb", "NVIDIA H100 80GB HBM3")});
  GpuSample first = Sample(0, 97, 70 * kGib + 5 * kMib + 123, 612.5);
  first.metrics.set_xid_errors(2);
  first.metrics.set_last_xid(79);
  first.metrics.set_ecc_uncorrected_errors(1);
  first.metrics.set_ecc_corrected_errors(12);
  // SW power cap (0x4) and HW slowdown (0x8).
  first.metrics.set_clock_throttle_reasons(0xC);
  backend.SetSamples({first, Sample(1, 12, 0, 71.25)});
  prometheus::Registry registry;
  DcgmExporter exporter(registry, "node-7");

  exporter.Update(backend.Devices(), backend.Sample());

  const std::string gpu0 = Labels(0, "GPU-aaaa", "NVIDIA H100 80GB HBM3");
  const std::string gpu1 = Labels(1, "GPU-bbbb", "NVIDIA H100 80GB HBM3");
  const std::vector<std::string> lines = Lines(registry);
  EXPECT_THAT(lines, Contains("# TYPE DCGM_FI_DEV_GPU_UTIL gauge"));
  EXPECT_THAT(lines, Contains("DCGM_FI_DEV_GPU_UTIL" + gpu0 + " 97"));
  EXPECT_THAT(lines, Contains("DCGM_FI_DEV_GPU_UTIL" + gpu1 + " 12"));
  EXPECT_THAT(lines, Contains("DCGM_FI_DEV_MEM_COPY_UTIL" + gpu0 + " 48.5"));
  // 70 GiB + 5 MiB + 123 B used of 80 GiB: whole MiB used, and the rest free.
  EXPECT_THAT(lines, Contains("DCGM_FI_DEV_FB_USED" + gpu0 + " 71685"));
  EXPECT_THAT(lines, Contains("DCGM_FI_DEV_FB_FREE" + gpu0 + " 10234"));
  EXPECT_THAT(lines, Contains("DCGM_FI_DEV_FB_USED" + gpu1 + " 0"));
  EXPECT_THAT(lines, Contains("DCGM_FI_DEV_FB_FREE" + gpu1 + " 81920"));
  EXPECT_THAT(lines, Contains("DCGM_FI_DEV_POWER_USAGE" + gpu0 + " 612.5"));
  EXPECT_THAT(lines, Contains("DCGM_FI_DEV_POWER_USAGE" + gpu1 + " 71.25"));
  EXPECT_THAT(lines, Contains("DCGM_FI_DEV_GPU_TEMP" + gpu0 + " 61"));
  EXPECT_THAT(lines, Contains("DCGM_FI_DEV_SM_CLOCK" + gpu0 + " 1980"));
  // dcgm-exporter's Xid gauge holds the newest Xid; the count is a counter of our own.
  EXPECT_THAT(lines, Contains("# TYPE DCGM_FI_DEV_XID_ERRORS gauge"));
  EXPECT_THAT(lines, Contains("DCGM_FI_DEV_XID_ERRORS" + gpu0 + " 79"));
  EXPECT_THAT(lines, Contains("DCGM_FI_DEV_XID_ERRORS" + gpu1 + " 0"));
  EXPECT_THAT(lines, Contains("# TYPE tessera_gpu_xid_errors_total counter"));
  EXPECT_THAT(lines, Contains("tessera_gpu_xid_errors_total" + gpu0 + " 2"));
  EXPECT_THAT(lines, Contains("tessera_gpu_xid_errors_total" + gpu1 + " 0"));
  EXPECT_THAT(lines, Contains("# TYPE DCGM_FI_DEV_ECC_DBE_VOL_TOTAL counter"));
  EXPECT_THAT(lines, Contains("# TYPE DCGM_FI_DEV_ECC_SBE_VOL_TOTAL counter"));
  EXPECT_THAT(lines, Contains("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL" + gpu0 + " 1"));
  EXPECT_THAT(lines, Contains("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL" + gpu0 + " 12"));
  EXPECT_THAT(lines, Contains("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL" + gpu1 + " 0"));
  EXPECT_THAT(lines, Contains("# TYPE DCGM_FI_DEV_CLOCK_THROTTLE_REASONS gauge"));
  EXPECT_THAT(lines, Contains("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS" + gpu0 + " 12"));
  EXPECT_THAT(lines, Contains("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS" + gpu1 + " 0"));
}

// Counters follow the samples' totals, and a total that went down (the driver reloaded, resetting
// its volatile counts) starts again from the new total rather than sticking at the old one.
TEST(GpuInventoryTest, ErrorCountersFollowTheTotalsAndRestartWhenTheyFall) {
  const std::vector<v1::GpuDevice> devices = {Device(0, "GPU-aaaa", "NVIDIA H200")};
  prometheus::Registry registry;
  DcgmExporter exporter(registry, "node-7");
  auto update = [&](int64_t corrected, int64_t xids, int32_t last_xid) {
    GpuSample sample = Sample(0, 50, kGib, 100);
    sample.metrics.set_ecc_corrected_errors(corrected);
    sample.metrics.set_xid_errors(xids);
    sample.metrics.set_last_xid(last_xid);
    exporter.Update(devices, {sample});
    return Lines(registry);
  };
  const std::string gpu0 = Labels(0, "GPU-aaaa", "NVIDIA H200");
  EXPECT_THAT(update(3, 0, 0), Contains("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL" + gpu0 + " 3"));
  auto lines = update(10, 1, 48);
  EXPECT_THAT(lines, Contains("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL" + gpu0 + " 10"));
  EXPECT_THAT(lines, Contains("tessera_gpu_xid_errors_total" + gpu0 + " 1"));
  EXPECT_THAT(lines, Contains("DCGM_FI_DEV_XID_ERRORS" + gpu0 + " 48"));
  lines = update(10, 3, 63);
  EXPECT_THAT(lines, Contains("tessera_gpu_xid_errors_total" + gpu0 + " 3"));
  EXPECT_THAT(lines, Contains("DCGM_FI_DEV_XID_ERRORS" + gpu0 + " 63"));
  lines = update(2, 3, 63);
  EXPECT_THAT(lines, Contains("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL" + gpu0 + " 2"));
  EXPECT_THAT(lines, Not(Contains("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL" + gpu0 + " 10")));
}

TEST(GpuInventoryTest, SecondUpdateReplacesValuesAndDropsVanishedGpus) {
  FakeGpuBackend backend({Device(0, "GPU-aaaa", "NVIDIA A100-SXM4-80GB"),
                          Device(1, "GPU-bbbb", "NVIDIA A100-SXM4-80GB")});
  prometheus::Registry registry;
  DcgmExporter exporter(registry, "node-7");
  backend.SetSamples({Sample(0, 10, kGib, 100), Sample(1, 20, kGib, 200)});
  exporter.Update(backend.Devices(), backend.Sample());

  backend.SetSamples({Sample(0, 55, 2 * kGib, 300)});
  exporter.Update(backend.Devices(), backend.Sample());

  const std::string gpu0 = Labels(0, "GPU-aaaa", "NVIDIA A100-SXM4-80GB");
  const std::vector<std::string> lines = Lines(registry);
  EXPECT_THAT(lines, Contains("DCGM_FI_DEV_GPU_UTIL" + gpu0 + " 55"));
  EXPECT_THAT(lines, Not(Contains("DCGM_FI_DEV_GPU_UTIL" + gpu0 + " 10")));
  EXPECT_THAT(lines, Contains("DCGM_FI_DEV_FB_USED" + gpu0 + " 2048"));
  EXPECT_THAT(lines, Contains("DCGM_FI_DEV_POWER_USAGE" + gpu0 + " 300"));
  for (const std::string& line : lines) {
    EXPECT_THAT(line, Not(HasSubstr("GPU-bbbb"))) << "GPU 1 sent no sample and must be gone";
  }
}

TEST(GpuInventoryTest, SampleOfUnknownDeviceIsDroppedAndNoGpusExportNothing) {
  prometheus::Registry registry;
  DcgmExporter exporter(registry, "node-7");
  exporter.Update({}, {Sample(3, 50, kGib, 100)});
  exporter.Update({}, {});
  for (const std::string& line : Lines(registry)) {
    EXPECT_EQ(line[0], '#') << "no series expected, got: " << line;
  }
}

}  // namespace
}  // namespace tessera::worker

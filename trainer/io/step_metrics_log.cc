#include "trainer/io/step_metrics_log.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/read_file.h"
#include "common/status_macros.h"
#include "common/xxh3.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "trainer/io/checkpoint.h"

namespace tessera::trainer {

void StepMetricsLog::Add(const v1::StepMetrics& point) {
  // StepMetricsLog.points is field 1, length-delimited.
  constexpr uint32_t kPointsTag = (1 << 3) | 2;
  const size_t size = point.ByteSizeLong();
  std::string entry;
  entry.reserve(1 + google::protobuf::io::CodedOutputStream::VarintSize64(size) + size);
  {
    google::protobuf::io::StringOutputStream stream(&entry);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.WriteTag(kPointsTag);
    coded.WriteVarint64(size);
    point.SerializeWithCachedSizes(&coded);
  }
  points_[point.step()] = std::move(entry);
  while (points_.size() > capacity_) points_.erase(points_.begin());
}

void StepMetricsLog::AddAll(const v1::StepMetricsLog& log, int64_t up_to_step) {
  for (const v1::StepMetrics& point : log.points()) {
    if (point.step() >= 1 && point.step() <= up_to_step) Add(point);
  }
}

std::string StepMetricsLog::EncodedUpTo(int64_t step) const {
  size_t bytes = 0;
  auto end = points_.upper_bound(step);
  for (auto it = points_.begin(); it != end; ++it) bytes += it->second.size();
  std::string encoded;
  encoded.reserve(bytes);
  for (auto it = points_.begin(); it != end; ++it) encoded += it->second;
  return encoded;
}

v1::StepMetricsLog StepMetricsLog::UpTo(int64_t step) const {
  v1::StepMetricsLog log;
  // Bytes this log serialized itself: they parse (were they not, the log would come back empty).
  if (!log.ParseFromString(EncodedUpTo(step))) log.Clear();
  return log;
}

absl::StatusOr<v1::CheckpointFile> WriteEncodedStepMetricsFile(const std::string& dir,
                                                               const std::string& bytes) {
  const std::string path = absl::StrCat(dir, "/", kStepMetricsFileName);
  size_t written = 0;
  ASSIGN_OR_RETURN(std::string digest, WriteHashedFile(path, [&](const ByteSink& sink) {
                     written = sink(bytes.data(), bytes.size());
                   }));
  if (written != bytes.size()) {
    return absl::DataLossError(
        absl::StrCat(path, ": wrote ", written, " of ", bytes.size(), " bytes"));
  }
  v1::CheckpointFile file;
  file.set_file(kStepMetricsFileName);
  file.set_size_bytes(static_cast<int64_t>(bytes.size()));
  file.set_xxh3_128(std::move(digest));
  return file;
}

absl::StatusOr<std::optional<v1::StepMetricsLog>> ReadStepMetricsFile(
    const std::string& dir, const v1::CheckpointManifest& manifest) {
  if (!manifest.has_step_metrics()) return std::nullopt;
  const v1::CheckpointFile& listed = manifest.step_metrics();
  const std::string path = absl::StrCat(dir, "/", listed.file());
  absl::StatusOr<std::string> bytes = ReadWholeFile(path);
  if (!bytes.ok()) {
    return absl::DataLossError(
        absl::StrCat(path, ": cannot read (listed in the manifest): ", bytes.status().message()));
  }
  if (static_cast<int64_t>(bytes->size()) != listed.size_bytes()) {
    return absl::DataLossError(absl::StrCat(path, ": size ", bytes->size(),
                                            " bytes, manifest says ", listed.size_bytes()));
  }
  if (const std::string digest = Xxh3Hex(*bytes); digest != listed.xxh3_128()) {
    return absl::DataLossError(absl::StrCat(path, ": xxh3-128 mismatch (manifest ",
                                            listed.xxh3_128(), ", file ", digest, ")"));
  }
  v1::StepMetricsLog log;
  if (!log.ParseFromString(*bytes)) {
    return absl::DataLossError(absl::StrCat(path, ": cannot parse"));
  }
  return log;
}

Backfill PlanBackfill(const v1::StepMetricsLog* log, int64_t complete_through,
                      int64_t resumed_step) {
  Backfill backfill;
  int64_t next = complete_through + 1;  // the first step not yet supplied
  auto uncovered = [&](int64_t first, int64_t last) {
    if (first <= last) backfill.uncovered.emplace_back(first, last);
  };
  if (log != nullptr) {
    for (const v1::StepMetrics& point : log->points()) {
      if (point.step() < next || point.step() > resumed_step) continue;
      uncovered(next, point.step() - 1);
      backfill.points.push_back(point);
      next = point.step() + 1;
    }
  }
  uncovered(next, resumed_step);
  return backfill;
}

}  // namespace tessera::trainer

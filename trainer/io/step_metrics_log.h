// The step metrics a checkpoint carries, so that metrics survive the loss of the reports that
// carried them. Rank 0 keeps the StepMetrics of the chain of attempts it continues (the resumed
// checkpoint's points, then every step it trains) in a StepMetricsLog, and writes the points up to
// a checkpoint's step into the staging directory as step_metrics.pb before the commit, which lists
// the file in the manifest (CheckpointManifest.step_metrics: size and XXH3-128, verified like a
// shard). A worker killed with reports queued, or an attempt replaced while its worker was cut
// off, loses the reports of steps that the next attempt, resuming from a later checkpoint, never
// trains again; that attempt reports them from the checkpoint's file instead (PlanBackfill), from
// just above the step up to which the coordinator's record is complete
// (TrainerTask.metrics_complete_through_step). No LibTorch here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "tessera/v1/checkpoint.pb.h"
#include "tessera/v1/metrics.pb.h"

namespace tessera::trainer {

// The file's name inside a checkpoint directory.
inline constexpr char kStepMetricsFileName[] = "step_metrics.pb";
// Points a checkpoint carries at most: the last ones. A few MB at most (a point with its step
// breakdown is a few hundred bytes), and far more steps than a coordinator is ever out of touch
// for.
inline constexpr size_t kStepMetricsLogCapacity = 10000;

// The step metrics of a chain of attempts: one point per step (a step reported again, after a
// rollback, replaces its point), the `capacity` highest steps.
//
// Each point is kept serialized, as it appears inside a serialized v1::StepMetricsLog, so that a
// save's snapshot (EncodedUpTo), taken on the training thread, is a copy of bytes rather than of
// 10,000 messages (bench/step_metrics_bench.cc, docs/performance.md).
//
// Thread safety: none; rank 0's training thread owns it and hands copies (EncodedUpTo) to saves.
class StepMetricsLog {
 public:
  explicit StepMetricsLog(size_t capacity = kStepMetricsLogCapacity) : capacity_(capacity) {}

  void Add(const v1::StepMetrics& point);
  // Every point of `log` (a resumed checkpoint's) with step <= `up_to_step`.
  void AddAll(const v1::StepMetricsLog& log, int64_t up_to_step);
  // The points with step <= `step`, ascending, as the serialized v1::StepMetricsLog that the
  // checkpoint of `step` carries (the bytes SerializeToString gives for UpTo(step)).
  std::string EncodedUpTo(int64_t step) const;
  // The same points, parsed.
  v1::StepMetricsLog UpTo(int64_t step) const;
  size_t size() const { return points_.size(); }

 private:
  size_t capacity_;
  // By step: the point's field entry in a serialized v1::StepMetricsLog (tag, length, message).
  std::map<int64_t, std::string> points_;
};

// Writes a serialized v1::StepMetricsLog (StepMetricsLog::EncodedUpTo) to <dir>/step_metrics.pb
// (a staging directory); returns the file as the manifest lists it (name, size, XXH3-128).
// Errors name the path.
absl::StatusOr<v1::CheckpointFile> WriteEncodedStepMetricsFile(const std::string& dir,
                                                               const std::string& encoded);

// The step metrics the checkpoint in `dir` carries, checked against `manifest.step_metrics`
// (size and digest): std::nullopt when the manifest lists none (a checkpoint written before
// checkpoints carried them). DATA_LOSS naming the file when it is missing, of another size, does
// not match its digest or does not parse.
absl::StatusOr<std::optional<v1::StepMetricsLog>> ReadStepMetricsFile(
    const std::string& dir, const v1::CheckpointManifest& manifest);

// What an attempt resuming from the checkpoint of `resumed_step` reports again: the points of
// `log` (null: the checkpoint carries none) with complete_through < step <= resumed_step,
// ascending, and the steps of that range it cannot supply, as inclusive [first, last] ranges.
struct Backfill {
  std::vector<v1::StepMetrics> points;
  std::vector<std::pair<int64_t, int64_t>> uncovered;
};
Backfill PlanBackfill(const v1::StepMetricsLog* log, int64_t complete_through,
                      int64_t resumed_step);

}  // namespace tessera::trainer

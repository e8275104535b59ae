#include "trainer/report/heartbeat.h"

#include <iostream>
#include <utility>

#include "google/protobuf/util/time_util.h"
#include "trainer/report/step_breakdown.h"

namespace tessera::trainer {

absl::Duration HeartbeatInterval(const v1::TrainerTask& task) {
  return task.heartbeat_interval_seconds() > 0 ? absl::Seconds(task.heartbeat_interval_seconds())
                                               : kDefaultHeartbeatInterval;
}

void RankProgress::SetStep(int64_t step) {
  absl::MutexLock lock(&mu_);
  step_ = step;
}

void RankProgress::StepFinished(int64_t step, double wall_seconds, double busy_seconds,
                                const v1::StepTimeBreakdown* breakdown) {
  absl::MutexLock lock(&mu_);
  step_ = step;
  ++steps_in_interval_;
  wall_seconds_ += wall_seconds;
  busy_seconds_ += busy_seconds;
  if (breakdown != nullptr) {
    ++breakdowns_in_interval_;
    AddBreakdown(*breakdown, &breakdown_sum_);
  }
}

v1::RankHeartbeat RankProgress::TakeHeartbeat() {
  absl::MutexLock lock(&mu_);
  v1::RankHeartbeat heartbeat;
  heartbeat.set_step(step_);
  if (steps_in_interval_ > 0) {
    heartbeat.set_step_seconds(wall_seconds_ / static_cast<double>(steps_in_interval_));
    heartbeat.set_busy_seconds(busy_seconds_ / static_cast<double>(steps_in_interval_));
  }
  if (breakdowns_in_interval_ > 0) {
    *heartbeat.mutable_breakdown() = MeanBreakdown(breakdown_sum_, breakdowns_in_interval_);
  }
  breakdowns_in_interval_ = 0;
  breakdown_sum_.Clear();
  steps_in_interval_ = 0;
  wall_seconds_ = 0;
  busy_seconds_ = 0;
  return heartbeat;
}

HeartbeatSender::HeartbeatSender(Reporter& reporter, RankProgress& progress,
                                 HeartbeatOptions options)
    : reporter_(reporter), progress_(progress), options_(std::move(options)) {
  thread_ = std::thread([this] { Loop(); });
}

HeartbeatSender::~HeartbeatSender() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

void HeartbeatSender::Loop() {
  bool logged_failure = false;
  while (true) {
    v1::TrainerReport report;
    report.set_job_id(options_.job_id);
    report.set_attempt(options_.attempt);
    report.set_rank(options_.rank);
    *report.mutable_time() = google::protobuf::util::TimeUtil::NanosecondsToTimestamp(
        absl::ToUnixNanos(options_.clock->Now()));
    *report.mutable_heartbeat() = progress_.TakeHeartbeat();
    // Undeliverable means the worker is gone, which the reporter's socket watch acts on: say so
    // once rather than every interval.
    if (absl::Status status = reporter_.Send(report); !status.ok() && !logged_failure) {
      std::cerr << "tessera-trainer: [rank " << options_.rank
                << "] heartbeat not delivered: " << status << std::endl;
      logged_failure = true;
    }
    // Until the next one is due, or the sender is destroyed.
    absl::MutexLock lock(&mu_);
    const absl::Time next = options_.clock->Now() + options_.interval;
    if (options_.clock->AwaitWithDeadline(&mu_, absl::Condition(&stopping_), next)) return;
  }
}

}  // namespace tessera::trainer

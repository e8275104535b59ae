#include "worker/assignment_watch.h"

#include <algorithm>
#include <iostream>
#include <utility>

#include "absl/random/random.h"

namespace tessera::worker {

AssignmentWatch::AssignmentWatch(
    LeaderChannel* leader, std::function<void(grpc::ClientContext&)> authorize,
    std::function<std::optional<v1::WatchAssignmentsRequest>()> request,
    std::function<void()> on_notice, AssignmentWatchOptions options)
    : leader_(leader),
      authorize_(std::move(authorize)),
      request_(std::move(request)),
      on_notice_(std::move(on_notice)),
      options_(options) {}

AssignmentWatch::~AssignmentWatch() { Stop(); }

void AssignmentWatch::Start() {
  absl::MutexLock lock(&mu_);
  if (thread_.joinable() || stopping_) return;
  thread_ = std::thread([this] { Loop(); });
}

void AssignmentWatch::Kick() {
  absl::MutexLock lock(&mu_);
  kicked_ = true;
}

void AssignmentWatch::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    if (context_ != nullptr) context_->TryCancel();
  }
  if (thread_.joinable()) thread_.join();
}

int AssignmentWatch::streams_opened() const {
  absl::MutexLock lock(&mu_);
  return streams_opened_;
}

int AssignmentWatch::notices() const {
  absl::MutexLock lock(&mu_);
  return notices_;
}

bool AssignmentWatch::RunStream(const v1::WatchAssignmentsRequest& request) {
  bool delivered = false;
  bool lifetime_ended = false;
  const absl::Time deadline = absl::Now() + options_.stream_lifetime;
  // A deadline already past: one stream (or two, when a standby names the leader); the loop's
  // backoff paces the reconnections.
  grpc::Status status = leader_->Call(
      absl::InfinitePast(),
      [&](grpc::ClientContext& context) {
        context.set_deadline(absl::ToChronoTime(deadline));
        authorize_(context);
      },
      [&](grpc::ClientContext& context, const std::shared_ptr<grpc::Channel>& channel,
          const std::string&) {
        {
          absl::MutexLock lock(&mu_);
          if (stopping_) return grpc::Status(grpc::StatusCode::CANCELLED, "stopping");
          context_ = &context;
          ++streams_opened_;
        }
        std::unique_ptr<v1::NodeService::Stub> stub = v1::NodeService::NewStub(channel);
        std::unique_ptr<grpc::ClientReader<v1::AssignmentsNotice>> reader =
            stub->WatchAssignments(&context, request);
        v1::AssignmentsNotice notice;
        while (reader->Read(&notice)) {
          if (!delivered && !connected_before_) {
            std::cerr << "tessera-worker: watching the coordinator for assignments" << std::endl;
          }
          delivered = true;
          {
            absl::MutexLock lock(&mu_);
            ++notices_;
          }
          on_notice_();
        }
        grpc::Status finished = reader->Finish();
        absl::MutexLock lock(&mu_);
        context_ = nullptr;
        // A healthy stream reaching its lifetime is no sign of a hung coordinator: the leader
        // stays where it is (LeaderChannel moves on after a deadline).
        if (delivered && finished.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
          lifetime_ended = true;
          return grpc::Status::OK;
        }
        return finished;
      });
  const bool renewed = lifetime_ended || status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
  connected_before_ = delivered && renewed;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return delivered;
  }
  // A stream that broke may mean a coordinator that restarted or forgot the node: a heartbeat
  // now finds out (and registers again if need be) rather than at the next period.
  if (!status.ok() && !renewed) on_notice_();
  if (status.ok() || renewed || status.error_code() == grpc::StatusCode::UNAVAILABLE) {
    // UNAVAILABLE is a coordinator restarting, which the heartbeat reports.
    last_error_.clear();
  } else if (status.error_message() != last_error_) {
    // Anything else (an older coordinator, a refused key) is worth a line, once.
    last_error_ = status.error_message();
    std::cerr << "tessera-worker: assignment watch ended: " << status.error_message() << " (code "
              << status.error_code() << "); heartbeats still deliver assignments" << std::endl;
  }
  return delivered;
}

void AssignmentWatch::Loop() {
  absl::BitGen random;
  absl::Duration backoff = options_.initial_backoff;
  auto stopping_or_kicked = [this]()
                                ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || kicked_; };
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      kicked_ = false;
    }
    bool delivered = false;
    if (std::optional<v1::WatchAssignmentsRequest> request = request_()) {
      delivered = RunStream(*request);
    }
    if (delivered) backoff = options_.initial_backoff;
    // Jitter (0.5 to 1 times the backoff) keeps a fleet from reconnecting in step after a
    // coordinator restart.
    const absl::Duration wait = backoff * absl::Uniform(random, 0.5, 1.0);
    backoff = std::min(backoff * 2, options_.max_backoff);
    absl::MutexLock lock(&mu_);
    if (options_.clock->AwaitWithDeadline(&mu_, absl::Condition(&stopping_or_kicked),
                                          options_.clock->Now() + wait) &&
        kicked_) {
      backoff = options_.initial_backoff;
    }
  }
}

}  // namespace tessera::worker

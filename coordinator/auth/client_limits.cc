#include "coordinator/auth/client_limits.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tessera::coordinator {

absl::Status ClientLimits::AdmitSubmit(const std::string& user) {
  if (options_.submits_per_minute <= 0) return absl::OkStatus();
  const double capacity = options_.submits_per_minute;
  const double per_second = capacity / 60.0;
  const absl::Time now = options_.clock->Now();
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = buckets_.try_emplace(user, Bucket{capacity, now});
  Bucket& bucket = it->second;
  if (!inserted) {
    const double elapsed = std::max(0.0, absl::ToDoubleSeconds(now - bucket.refilled));
    bucket.tokens = std::min(capacity, bucket.tokens + elapsed * per_second);
    bucket.refilled = now;
  }
  if (bucket.tokens >= 1.0) {
    bucket.tokens -= 1.0;
    return absl::OkStatus();
  }
  const double wait_seconds = (1.0 - bucket.tokens) / per_second;
  const int64_t wait_ms = static_cast<int64_t>(std::ceil(wait_seconds * 1000));
  absl::Status status = absl::ResourceExhaustedError(absl::StrFormat(
      "user %s submitted %d jobs in the last minute (--max_submits_per_minute); retry in %.1f s",
      user, options_.submits_per_minute, wait_ms / 1000.0));
  status.SetPayload(kRetryAfterPayload, absl::Cord(absl::StrCat(wait_ms)));
  return status;
}

absl::StatusOr<std::shared_ptr<void>> ClientLimits::OpenStream(const std::string& user) {
  {
    absl::MutexLock lock(&mu_);
    int& open = streams_[user];
    if (options_.max_streams_per_client > 0 && open >= options_.max_streams_per_client) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "user ", user, " has ", open,
          " watch/log streams open (--max_streams_per_client); close one and retry"));
    }
    ++open;
  }
  // The handle's deleter gives the slot back; `this` outlives every stream
  // (the service, which holds the limits, is destroyed after the server).
  return std::shared_ptr<void>(nullptr, [this, user](void*) { CloseStream(user); });
}

void ClientLimits::CloseStream(const std::string& user) {
  absl::MutexLock lock(&mu_);
  auto it = streams_.find(user);
  if (it == streams_.end()) return;
  if (--it->second <= 0) streams_.erase(it);
}

int ClientLimits::open_streams(const std::string& user) const {
  absl::MutexLock lock(&mu_);
  auto it = streams_.find(user);
  return it == streams_.end() ? 0 : it->second;
}

}  // namespace tessera::coordinator

// ClientLimits: per-user limits that keep one client from starving the
// others: a submit rate (a token bucket per user) and a ceiling on open
// streams (WatchJob, GetLogs) per user. Refusals are RESOURCE_EXHAUSTED and
// say when to retry.
#pragma once

#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/daemon/grpc_status.h"

namespace tessera::coordinator {

struct ClientLimitsOptions {
  // Submissions per user per minute, with bursts up to the same number; 0: unlimited.
  int submits_per_minute = 60;
  // Open WatchJob/GetLogs streams per user; 0: unlimited.
  int max_streams_per_client = 16;
  // Must outlive the limits; tests pass a SimulatedClock.
  Clock* clock = Clock::Real();
};

// RESOURCE_EXHAUSTED statuses carry their retry delay under kRetryAfterPayload
// (common/daemon/grpc_status.h); the service sends it as trailing metadata
// "retry-after-ms".

// Thread safety: all methods may be called from any thread (mu_).
class ClientLimits {
 public:
  explicit ClientLimits(ClientLimitsOptions options) : options_(std::move(options)) {}

  // Takes one submission from `user`'s bucket; RESOURCE_EXHAUSTED with the
  // retry delay in the message and in kRetryAfterPayload when it is empty.
  absl::Status AdmitSubmit(const std::string& user);

  // Holds one of `user`'s stream slots until the returned handle is destroyed.
  // RESOURCE_EXHAUSTED when the user already holds the maximum.
  absl::StatusOr<std::shared_ptr<void>> OpenStream(const std::string& user);

  int open_streams(const std::string& user) const;

 private:
  struct Bucket {
    double tokens = 0;
    absl::Time refilled;
  };
  void CloseStream(const std::string& user);

  const ClientLimitsOptions options_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Bucket> buckets_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, int> streams_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessera::coordinator

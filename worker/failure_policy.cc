#include "worker/failure_policy.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "worker/proc_stat.h"

namespace tessera::worker {

std::optional<v1::TrainerFailure> BlameFailure(const std::vector<v1::TrainerFailure>& failures) {
  const v1::TrainerFailure* earliest = nullptr;
  const v1::TrainerFailure* earliest_cause = nullptr;
  for (const v1::TrainerFailure& failure : failures) {
    const absl::Time time = FromTimestamp(failure.time());
    if (earliest == nullptr || time < FromTimestamp(earliest->time())) earliest = &failure;
    if (failure.kind() != v1::FAILURE_KIND_PEER_FAILED &&
        (earliest_cause == nullptr || time < FromTimestamp(earliest_cause->time()))) {
      earliest_cause = &failure;
    }
  }
  if (earliest_cause != nullptr) return *earliest_cause;
  if (earliest != nullptr) return *earliest;
  return std::nullopt;
}

bool AwaitCause(const std::vector<v1::TrainerFailure>& failures, bool rank_running,
                absl::Time first_seen, absl::Time now, absl::Duration grace) {
  if (failures.empty() || !rank_running || now - first_seen >= grace) return false;
  return std::all_of(failures.begin(), failures.end(), [](const v1::TrainerFailure& failure) {
    return failure.kind() == v1::FAILURE_KIND_PEER_FAILED;
  });
}

absl::Duration HangTimeout(const v1::JobSpec& spec) {
  return spec.hang_timeout_seconds() > 0 ? absl::Seconds(spec.hang_timeout_seconds())
                                         : kDefaultHangTimeout;
}

absl::Duration Silence(absl::Time launched, std::optional<absl::Time> last_heartbeat,
                       absl::Time now) {
  return now - last_heartbeat.value_or(launched);
}

v1::TrainerFailure HungRankFailure(int rank, const std::string& node_id, int64_t step,
                                   absl::Duration silence, char process_state, absl::Time now) {
  v1::TrainerFailure failure;
  failure.set_kind(v1::FAILURE_KIND_COLLECTIVE_TIMEOUT);
  failure.set_rank(rank);
  failure.set_node_id(node_id);
  failure.set_step(step);
  failure.set_message(absl::StrFormat(
      "rank %d on %s hung: no heartbeat for %.1f s (process state: %s)", rank, node_id,
      absl::ToDoubleSeconds(silence), DescribeProcessState(process_state)));
  *failure.mutable_time() = ToTimestamp(now);
  return failure;
}

google::protobuf::Timestamp ToTimestamp(absl::Time time) {
  const int64_t nanos = absl::ToUnixNanos(time);
  google::protobuf::Timestamp timestamp;
  timestamp.set_seconds(nanos / 1000000000);
  timestamp.set_nanos(static_cast<int32_t>(nanos % 1000000000));
  if (timestamp.nanos() < 0) {
    timestamp.set_seconds(timestamp.seconds() - 1);
    timestamp.set_nanos(timestamp.nanos() + 1000000000);
  }
  return timestamp;
}

absl::Time FromTimestamp(const google::protobuf::Timestamp& timestamp) {
  return absl::FromUnixSeconds(timestamp.seconds()) + absl::Nanoseconds(timestamp.nanos());
}

}  // namespace tessera::worker

// How a worker judges the ranks of one task: which of several failures to blame (the first real
// cause, not the ranks that failed because a peer did), how long to wait for that cause to
// surface, and when a rank whose heartbeats have stopped counts as hung. Pure functions of what
// the supervise loop observed and the time it passes in, so tests drive them with made-up times.
// Thread-safe (no state).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "tessera/v1/job.pb.h"
#include "tessera/v1/metrics.pb.h"

namespace tessera::worker {

// How long a task whose failed ranks all blame a peer (FAILURE_KIND_PEER_FAILED) waits, while
// another of its ranks still runs, for that rank to fail with the cause before the task fails.
inline constexpr absl::Duration kPeerFailureGrace = absl::Seconds(1);

// Longest a worker waits, after a rank's non-zero exit, for the typed failure report the rank
// sent just before it (still unread in its report socket) before blaming the bare exit status.
inline constexpr absl::Duration kExitReportGrace = absl::Seconds(1);

// JobSpec.hang_timeout_seconds when it is 0.
inline constexpr absl::Duration kDefaultHangTimeout = absl::Seconds(300);

// The failure a task reports: the earliest (by TrainerFailure.time) whose kind is not
// FAILURE_KIND_PEER_FAILED, else the earliest; ties go to the first in `failures`. nullopt when
// `failures` is empty.
std::optional<v1::TrainerFailure> BlameFailure(const std::vector<v1::TrainerFailure>& failures);

// Whether to hold the task's verdict back: every failure so far is FAILURE_KIND_PEER_FAILED, a
// rank of the task still runs (and may yet report the cause), and less than `grace` has passed
// since the first failure was seen (`first_seen`).
bool AwaitCause(const std::vector<v1::TrainerFailure>& failures, bool rank_running,
                absl::Time first_seen, absl::Time now, absl::Duration grace = kPeerFailureGrace);

// The spec's hang timeout (kDefaultHangTimeout when unset).
absl::Duration HangTimeout(const v1::JobSpec& spec);

// How long a running rank has gone without a heartbeat: since its last one, or since its launch
// before the first.
absl::Duration Silence(absl::Time launched, std::optional<absl::Time> last_heartbeat,
                       absl::Time now);

// The failure of a rank silent for `silence` (at least its hang timeout): kind
// FAILURE_KIND_COLLECTIVE_TIMEOUT, time `now`, and a message naming the rank, node, silence and
// the process state letter read from /proc (T stopped, D uninterruptible I/O, ...; '?' unknown).
v1::TrainerFailure HungRankFailure(int rank, const std::string& node_id, int64_t step,
                                   absl::Duration silence, char process_state, absl::Time now);

// Conversions between absl::Time and TrainerFailure.time.
google::protobuf::Timestamp ToTimestamp(absl::Time time);
absl::Time FromTimestamp(const google::protobuf::Timestamp& timestamp);

}  // namespace tessera::worker

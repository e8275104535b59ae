// The current time as a protobuf Timestamp, to the nanosecond. (Protobuf's
// TimeUtil::GetCurrentTime() in the Debian release has whole-second
// resolution, which made sub-second latencies computed from stored times read
// up to a second off.)
#pragma once

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "google/protobuf/timestamp.pb.h"
#include "google/protobuf/util/time_util.h"

namespace tessera {

inline google::protobuf::Timestamp NowTimestamp() {
  return google::protobuf::util::TimeUtil::NanosecondsToTimestamp(absl::ToUnixNanos(absl::Now()));
}

}  // namespace tessera

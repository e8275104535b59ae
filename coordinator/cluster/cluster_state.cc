#include "coordinator/cluster/cluster_state.h"

#include <iostream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/util/time_util.h"

namespace tessera::coordinator {

google::protobuf::Timestamp ToProto(absl::Time time) {
  return google::protobuf::util::TimeUtil::NanosecondsToTimestamp(absl::ToUnixNanos(time));
}

absl::Time FromProto(const google::protobuf::Timestamp& time) {
  return absl::FromUnixNanos(google::protobuf::util::TimeUtil::TimestampToNanoseconds(time));
}

void LogRetried(const absl::Status& status, const std::string& what) {
  if (!status.ok()) {
    std::cerr << "tessera-coordinator: " << what << ": " << status << " (retried next tick)"
              << std::endl;
  }
}

ClusterState::ClusterState(Store* store, ClusterOptions options)
    : store(store), options(std::move(options)) {}

}  // namespace tessera::coordinator

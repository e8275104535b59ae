#include "coordinator/cluster/cluster_state.h"

#include <iostream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
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
    : store(store),
      options(std::move(options)),
      nodes(store, this->options.heartbeat_timeout, /*write_behind=*/true, this->options.clock,
            &orders) {}

absl::Status ClusterState::WriteNodes(const std::string& node_id) {
  absl::MutexLock write_lock(&node_write_mu);
  std::vector<v1::Node> writes;
  {
    absl::MutexLock lock(&mu);
    writes = nodes.TakeWrites();
  }
  if (writes.empty()) return absl::OkStatus();
  absl::Status result;
  std::vector<std::string> failed;
  for (const v1::Node& record : writes) {
    absl::Status status = store->PutNode(record);
    if (status.ok()) continue;
    failed.push_back(record.node_id());
    if (node_id.empty() || record.node_id() == node_id) result.Update(status);
  }
  if (!failed.empty()) {
    absl::MutexLock lock(&mu);
    for (const auto& id : failed) nodes.WriteFailed(id);
  }
  return result;
}

absl::Status ClusterState::RemoveNode(const std::string& node_id) {
  absl::MutexLock write_lock(&node_write_mu);
  auto removable = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) -> absl::Status {
    if (!nodes.Known(node_id)) {
      return absl::NotFoundError(absl::StrCat("node ", node_id, ": not registered"));
    }
    if (const std::vector<std::string> jobs = allocations.JobsOn(node_id); !jobs.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "node ", node_id, " still holds devices of job(s) ", absl::StrJoin(jobs, ", "),
          ": wait until they end or move (drain with checkpoint)"));
    }
    return nodes.CheckRemovable(node_id);
  };
  {
    absl::MutexLock lock(&mu);
    RETURN_IF_ERROR(removable());
  }
  RETURN_IF_ERROR(store->DeleteNode(node_id));
  absl::MutexLock lock(&mu);
  if (absl::Status still = removable(); !still.ok()) {
    // Undrained (or given work) while its record was deleted: the record is stored again.
    nodes.WriteFailed(node_id);
    return still;
  }
  return nodes.Forget(node_id);
}

}  // namespace tessera::coordinator

#include "worker/worker_service.h"

#include <algorithm>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/daemon/grpc_status.h"
#include "common/security/tls.h"
#include "worker/log_reader.h"

namespace tessera::worker {
namespace {

// Bytes per LogChunk.
constexpr size_t kChunkBytes = 64 << 10;
// Pause of a following reader when no rank wrote anything new.
constexpr absl::Duration kFollowPause = absl::Milliseconds(200);

}  // namespace

grpc::Status WorkerService::CheckCaller(const grpc::ServerContext& context) const {
  return CheckCallerAllowed(context, allowed_callers_, "--tls_allowed_callers");
}

grpc::Status WorkerService::ReadLogs(grpc::ServerContext* context,
                                     const v1::ReadLogsRequest* request,
                                     grpc::ServerWriter<v1::LogChunk>* writer) {
  if (grpc::Status status = CheckCaller(*context); !status.ok()) return status;
  if (request->job_id().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "job_id: required");
  }
  std::vector<int> ranks = agent_->Ranks(request->job_id(), request->attempt(), request->rank());
  if (ranks.empty()) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        absl::StrCat("no logs of ", request->job_id(), " attempt ",
                                     request->attempt(), " on this node"));
  }
  std::vector<std::pair<int, LogReader>> readers;
  for (int rank : ranks) {
    auto path = agent_->LogPath(request->job_id(), request->attempt(), rank);
    if (!path.ok()) return ToGrpcStatus(path.status());
    auto reader = LogReader::Open(*path, request->tail_lines());
    if (!reader.ok()) return ToGrpcStatus(reader.status());
    readers.emplace_back(rank, std::move(*reader));
  }
  while (!context->IsCancelled()) {
    bool wrote = false;
    for (auto& [rank, reader] : readers) {
      while (true) {
        int64_t offset = reader.offset();
        auto data = reader.ReadMore(kChunkBytes);
        if (!data.ok()) return ToGrpcStatus(data.status());
        if (data->empty()) break;
        v1::LogChunk chunk;
        chunk.set_job_id(request->job_id());
        chunk.set_attempt(request->attempt());
        chunk.set_rank(rank);
        chunk.set_offset(offset);
        chunk.set_data(std::move(*data));
        if (!writer->Write(chunk)) return grpc::Status::CANCELLED;
        wrote = true;
      }
    }
    // Without follow one pass is all; with it, until the task ends and its
    // last output has been sent.
    if (!request->follow()) break;
    if (!wrote && !agent_->Running(request->job_id(), request->attempt())) break;
    if (!wrote) absl::SleepFor(kFollowPause);
  }
  return grpc::Status::OK;
}

grpc::Status WorkerService::GetNode(grpc::ServerContext* context, const v1::GetNodeRequest*,
                                    v1::GetNodeResponse* response) {
  if (grpc::Status status = CheckCaller(*context); !status.ok()) return status;
  *response->mutable_node() = agent_->NodeView();
  return grpc::Status::OK;
}

}  // namespace tessera::worker

#include "worker/worker_service.h"

#include <atomic>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/daemon/grpc_status.h"
#include "common/security/tls.h"
#include "grpcpp/alarm.h"
#include "worker/log_reader.h"

namespace tessera::worker {
namespace {

// Bytes per LogChunk.
constexpr size_t kChunkBytes = 64 << 10;
// Pause of a following reader when no rank wrote anything new.
constexpr absl::Duration kFollowPause = absl::Milliseconds(200);

// A stream that fails at once with `status`.
class FailedLogStream final : public grpc::ServerWriteReactor<v1::LogChunk> {
 public:
  explicit FailedLogStream(grpc::Status status) { Finish(std::move(status)); }
  void OnDone() override { delete this; }
};

// One ReadLogs stream: each pass reads every rank's new output, rank by rank, one chunk per write;
// without follow one pass is all; with it, passes go on (a pause between two that found nothing)
// until the task has ended and a pass found nothing more.
//
// Next runs on one thread at a time: from the constructor, then from OnWriteDone or the pause's
// alarm, never both, since a write and a pause are never outstanding together. OnCancel only
// flags the cancellation, which the next write's failure or the end of the pause (at most
// kFollowPause later) acts on: the alarm is never cancelled, so it is never set and cancelled
// from two threads at once, and no alarm is pending once the stream has finished (OnDone deletes
// the reactor).
class LogStream final : public grpc::ServerWriteReactor<v1::LogChunk> {
 public:
  LogStream(WorkerAgent* agent, v1::ReadLogsRequest request,
            std::vector<std::pair<int, LogReader>> readers)
      : agent_(agent), request_(std::move(request)), readers_(std::move(readers)) {
    Next();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return Finish(grpc::Status::CANCELLED);
    Next();
  }

  void OnCancel() override { cancelled_ = true; }

  void OnDone() override { delete this; }

 private:
  void Next() {
    if (cancelled_) return Finish(grpc::Status::CANCELLED);
    for (; next_ < readers_.size(); ++next_) {
      auto& [rank, reader] = readers_[next_];
      const int64_t offset = reader.offset();
      absl::StatusOr<std::string> data = reader.ReadMore(kChunkBytes);
      if (!data.ok()) return Finish(ToGrpcStatus(data.status()));
      if (data->empty()) continue;
      chunk_.Clear();
      chunk_.set_job_id(request_.job_id());
      chunk_.set_attempt(request_.attempt());
      chunk_.set_rank(rank);
      chunk_.set_offset(offset);
      chunk_.set_data(std::move(*data));
      wrote_ = true;
      return StartWrite(&chunk_);  // the same rank again once written
    }
    // A pass is over.
    const bool wrote = wrote_;
    next_ = 0;
    wrote_ = false;
    if (!request_.follow()) return Finish(grpc::Status::OK);
    if (wrote) return Next();
    if (!agent_->Running(request_.job_id(), request_.attempt())) {
      return Finish(grpc::Status::OK);
    }
    alarm_.Set(absl::ToChronoTime(absl::Now() + kFollowPause), [this](bool ok) {
      if (!ok) return Finish(grpc::Status::CANCELLED);
      Next();
    });
  }

  WorkerAgent* const agent_;
  const v1::ReadLogsRequest request_;
  std::vector<std::pair<int, LogReader>> readers_;
  // The reader of the next read in this pass, and whether the pass wrote anything.
  size_t next_ = 0;
  bool wrote_ = false;
  v1::LogChunk chunk_;
  grpc::Alarm alarm_;
  std::atomic<bool> cancelled_{false};
};

}  // namespace

grpc::Status WorkerService::CheckCaller(const grpc::ServerContextBase& context) const {
  return CheckCallerAllowed(context, allowed_callers_, "--tls_allowed_callers");
}

grpc::ServerWriteReactor<v1::LogChunk>* WorkerService::ReadLogs(
    grpc::CallbackServerContext* context, const v1::ReadLogsRequest* request) {
  if (grpc::Status status = CheckCaller(*context); !status.ok()) {
    return new FailedLogStream(std::move(status));
  }
  if (request->job_id().empty()) {
    return new FailedLogStream(
        grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "job_id: required"));
  }
  std::vector<int> ranks = agent_->Ranks(request->job_id(), request->attempt(), request->rank());
  if (ranks.empty()) {
    return new FailedLogStream(grpc::Status(
        grpc::StatusCode::NOT_FOUND, absl::StrCat("no logs of ", request->job_id(), " attempt ",
                                                  request->attempt(), " on this node")));
  }
  std::vector<std::pair<int, LogReader>> readers;
  for (int rank : ranks) {
    auto path = agent_->LogPath(request->job_id(), request->attempt(), rank);
    if (!path.ok()) return new FailedLogStream(ToGrpcStatus(path.status()));
    auto reader = LogReader::Open(*path, request->tail_lines());
    if (!reader.ok()) return new FailedLogStream(ToGrpcStatus(reader.status()));
    readers.emplace_back(rank, std::move(*reader));
  }
  return new LogStream(agent_, *request, std::move(readers));
}

grpc::ServerUnaryReactor* WorkerService::GetNode(grpc::CallbackServerContext* context,
                                                 const v1::GetNodeRequest*,
                                                 v1::GetNodeResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (grpc::Status status = CheckCaller(*context); !status.ok()) {
    reactor->Finish(std::move(status));
    return reactor;
  }
  *response->mutable_node() = agent_->NodeView();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace tessera::worker

#include "coordinator/node_service.h"

#include <memory>
#include <optional>

#include "common/daemon/grpc_status.h"
#include "common/status_macros.h"
#include "coordinator/coordinator_service.h"

namespace tessera::coordinator {
namespace {

// A stream refused before it began.
class RefusedWatch final : public grpc::ServerWriteReactor<v1::AssignmentsNotice> {
 public:
  explicit RefusedWatch(const absl::Status& status) { Finish(ToGrpcStatus(status)); }
  void OnDone() override { delete this; }
};

// One worker's WatchAssignments stream. It sends a notice when it opens (orders may have been
// queued while the worker was not watching) and one after each wake-up from the notifier;
// wake-ups that come while a write is in flight fold into one pending notice, so a slow stream
// holds one message at most. It ends with UNAVAILABLE when the notifier closes (shutdown), and
// when the worker goes away.
//
// Lifetime: gRPC owns the reactor until OnDone. The notifier's callback holds only the shared
// State, whose `reactor` OnDone clears (under State::mu) before the reactor is deleted. Finish is
// called outside State::mu, since it may run OnDone, which takes it.
class AssignmentsReactor final : public grpc::ServerWriteReactor<v1::AssignmentsNotice> {
 public:
  AssignmentsReactor(AssignmentNotifier* notifier, const std::string& node_id)
      : notifier_(notifier), state_(std::make_shared<State>()) {
    std::optional<grpc::Status> finish;
    {
      absl::MutexLock lock(&state_->mu);
      state_->reactor = this;
      std::shared_ptr<State> state = state_;
      // Its callback waits for State::mu, held until the first notice is under way.
      handle_ = notifier_->Subscribe(node_id, [state] { state->Wake(); });
      pending_ = true;
      finish = handle_ == 0 ? FinishLocked(ShutdownStatus()) : PumpLocked();
    }
    if (finish) Finish(*finish);
  }

  void OnWriteDone(bool ok) override {
    std::optional<grpc::Status> finish;
    {
      absl::MutexLock lock(&state_->mu);
      writing_ = false;
      finish = ok ? PumpLocked()
                  : FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "the worker went away"));
    }
    if (finish) Finish(*finish);
  }

  void OnCancel() override {
    std::optional<grpc::Status> finish;
    {
      absl::MutexLock lock(&state_->mu);
      finish = FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "watch cancelled"));
    }
    if (finish) Finish(*finish);
  }

  void OnDone() override {
    {
      absl::MutexLock lock(&state_->mu);
      state_->reactor = nullptr;
    }
    if (handle_ != 0) notifier_->Unsubscribe(handle_);
    delete this;
  }

 private:
  struct State {
    // Called by the notifier's dispatcher.
    void Wake() {
      std::optional<grpc::Status> finish;
      AssignmentsReactor* target = nullptr;
      {
        absl::MutexLock lock(&mu);
        if (reactor == nullptr) return;
        target = reactor;
        finish = reactor->WakeLocked();
      }
      // Only this call may finish the stream (finished_ was set under mu), so the reactor lives
      // until Finish returns control to gRPC.
      if (finish) target->Finish(*finish);
    }
    absl::Mutex mu;
    AssignmentsReactor* reactor ABSL_GUARDED_BY(mu) = nullptr;
  };

  static grpc::Status ShutdownStatus() {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        "the coordinator is shutting down; watch again once it is back");
  }

  // Each returns the status to Finish with, once State::mu is released.
  std::optional<grpc::Status> WakeLocked() {
    if (finished_) return std::nullopt;
    if (notifier_->closed()) return FinishLocked(ShutdownStatus());
    pending_ = true;
    return PumpLocked();
  }
  std::optional<grpc::Status> PumpLocked() {
    if (finished_ || writing_ || !pending_) return std::nullopt;
    pending_ = false;
    writing_ = true;
    StartWrite(&notice_);
    return std::nullopt;
  }
  std::optional<grpc::Status> FinishLocked(grpc::Status status) {
    if (finished_) return std::nullopt;
    finished_ = true;
    return status;
  }

  AssignmentNotifier* const notifier_;
  const std::shared_ptr<State> state_;
  AssignmentNotifier::Handle handle_ = 0;
  // Guarded by state_->mu.
  bool writing_ = false;
  bool pending_ = false;
  bool finished_ = false;
  const v1::AssignmentsNotice notice_;
};

}  // namespace

grpc::ServerWriteReactor<v1::AssignmentsNotice>* NodeService::WatchAssignments(
    grpc::CallbackServerContext* context, const v1::WatchAssignmentsRequest* request) {
  absl::Status admitted = AdmitCall(authenticator_, *context, Action::kNode).status();
  if (admitted.ok()) admitted = cluster_->CheckWatcher(request->node_id(), request->node_key());
  if (admitted.ok() && notifier_ == nullptr) {
    admitted = absl::UnimplementedError("this coordinator does not announce assignments");
  }
  if (!admitted.ok()) return new RefusedWatch(admitted);
  return new AssignmentsReactor(notifier_, request->node_id());
}

template <typename Response, typename Call>
grpc::ServerUnaryReactor* NodeService::Serve(CallExecutor* executor,
                                             grpc::CallbackServerContext* context,
                                             Response* response, Call call) {
  auto handle = [this, context, response, call = std::move(call)]() -> absl::Status {
    RETURN_IF_ERROR(AdmitCall(authenticator_, *context, Action::kNode).status());
    ASSIGN_OR_RETURN(*response, call());
    return absl::OkStatus();
  };
  return HandleOn(executor, context, std::move(handle),
                  [](const absl::Status& status, grpc::ServerUnaryReactor* reactor) {
                    reactor->Finish(ToGrpcStatus(status));
                  });
}

grpc::ServerUnaryReactor* NodeService::RegisterNode(grpc::CallbackServerContext* context,
                                                    const v1::RegisterNodeRequest* request,
                                                    v1::RegisterNodeResponse* response) {
  return Serve(executor_, context, response,
               [this, request] { return cluster_->Register(*request); });
}

grpc::ServerUnaryReactor* NodeService::Heartbeat(grpc::CallbackServerContext* context,
                                                 const v1::HeartbeatRequest* request,
                                                 v1::HeartbeatResponse* response) {
  // On gRPC's thread: a heartbeat holds the cluster lock briefly, never waits for the store (a
  // placement being stored is held back from its nodes until it is), and leaves its store writes
  // to the cluster's follow-up executor (the daemon gives it this service's executor); 10,000
  // heartbeats a second through a queue cost more than they save.
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::Status status = AdmitCall(authenticator_, *context, Action::kNode).status();
  if (status.ok()) {
    absl::StatusOr<v1::HeartbeatResponse> result = cluster_->Heartbeat(*request);
    if (result.ok()) *response = *std::move(result);
    status = result.status();
  }
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

grpc::ServerUnaryReactor* NodeService::Report(grpc::CallbackServerContext* context,
                                              const v1::ReportRequest* request,
                                              v1::ReportResponse* response) {
  return Serve(executor_, context, response,
               [this, request] { return cluster_->Report(*request); });
}

}  // namespace tessera::coordinator

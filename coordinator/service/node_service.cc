#include "coordinator/service/node_service.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <thread>

#include "common/daemon/grpc_status.h"
#include "common/status_macros.h"
#include "coordinator/service/coordinator_service.h"

namespace tessera::coordinator {
namespace {

// WatchAssignments calls requested at once on each of the stream queues.
constexpr int kWatchRequestsPerQueue = 16;

}  // namespace

// One WatchAssignments call on the asynchronous API, from its request to its end. gRPC hands each
// operation's tag back on the call's queue; a Tag names the call and the operation. The call
// deletes itself once gRPC has said the call is over (the done tag) and no write or finish of its
// own is outstanding.
//
// It sends a notice when it opens (orders may have been queued while the worker was not watching)
// and one after each wake-up from the notifier; wake-ups that come while a write is in flight fold
// into one pending notice, so a slow stream holds one message at most. It ends with UNAVAILABLE
// when the notifier closes (shutdown), and when the worker goes away.
//
// Lifetime and locking: every operation is started under State::mu, from the queue's thread or the
// notifier's. The notifier's callback holds only the shared State, whose `call` is cleared (under
// State::mu) before the call is deleted.
class NodeService::WatchCall {
 public:
  WatchCall(NodeService* service, grpc::ServerCompletionQueue* queue)
      : service_(service), queue_(queue), writer_(&context_), state_(std::make_shared<State>()) {
    absl::MutexLock lock(&state_->mu);
    state_->call = this;
    context_.AsyncNotifyWhenDone(&done_tag_);
    service_->RequestWatchAssignments(&context_, &request_, &writer_, queue_, queue_,
                                      &accepted_tag_);
  }

  // On the queue's thread: an operation's tag came back.
  static void Proceed(void* tag, bool ok) {
    const Tag* done = static_cast<const Tag*>(tag);
    done->call->OnEvent(done->event, ok);
  }

 private:
  enum class Event { kAccepted, kWritten, kFinished, kDone };
  struct Tag {
    WatchCall* call;
    Event event;
  };
  struct State {
    absl::Mutex mu;
    WatchCall* call ABSL_GUARDED_BY(mu) = nullptr;
  };

  static grpc::Status ShutdownStatus() {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        "the coordinator is shutting down; watch again once it is back");
  }

  // The notifier's callback.
  static void Wake(const std::shared_ptr<State>& state) {
    absl::MutexLock lock(&state->mu);
    WatchCall* call = state->call;
    if (call == nullptr) return;
    // The same mutex as state->mu, which the analysis cannot see through call->state_.
    call->state_->mu.AssertHeld();
    if (call->finished_) return;
    if (call->service_->notifier_->closed()) {
      call->FinishLocked(ShutdownStatus());
      return;
    }
    call->pending_ = true;
    call->PumpLocked();
  }

  void OnEvent(Event event, bool ok) {
    if (event == Event::kAccepted && !ok) {
      // Never started (the server shuts down): gRPC returns no other tag of it.
      {
        absl::MutexLock lock(&state_->mu);
        state_->call = nullptr;
      }
      delete this;
      return;
    }
    if (event == Event::kAccepted) service_->AcceptWatch(queue_);  // the next call
    const absl::Status admitted =
        event == Event::kAccepted ? service_->AdmitWatch(context_, request_) : absl::OkStatus();
    bool release = false;
    {
      absl::MutexLock lock(&state_->mu);
      switch (event) {
        case Event::kAccepted:
          started_ = true;
          if (!admitted.ok()) {
            FinishLocked(ToGrpcStatus(admitted));
          } else if (!done_) {
            std::shared_ptr<State> state = state_;
            // Its callback waits for State::mu, held until the first notice is under way.
            handle_ = service_->notifier_->Subscribe(request_.node_id(), [state] { Wake(state); });
            if (handle_ == 0) {
              FinishLocked(ShutdownStatus());
            } else {
              pending_ = true;
              PumpLocked();
            }
          }
          break;
        case Event::kWritten:
          writing_ = false;
          if (!ok) {
            // The worker went away; the done tag follows.
            finished_ = true;
          } else if (finish_status_.has_value()) {
            StartFinishLocked();
          } else {
            PumpLocked();
          }
          break;
        case Event::kFinished:
          finishing_ = false;
          break;
        case Event::kDone:
          done_ = true;
          break;
      }
      release = started_ && done_ && !writing_ && !finishing_;
      if (release) state_->call = nullptr;
    }
    if (release) {
      if (handle_ != 0) service_->notifier_->Unsubscribe(handle_);
      delete this;
    }
  }

  void PumpLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) {
    if (finished_ || done_ || writing_ || !pending_) return;
    pending_ = false;
    writing_ = true;
    writer_.Write(notice_, &written_tag_);
  }
  // A write in flight is let finish first: one operation of each kind at a time.
  void FinishLocked(grpc::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) {
    if (finished_) return;
    finished_ = true;
    finish_status_ = std::move(status);
    if (!writing_) StartFinishLocked();
  }
  void StartFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) {
    if (done_) return;  // the call is over: nothing to send
    finishing_ = true;
    writer_.Finish(*finish_status_, &finished_tag_);
    finish_status_.reset();
  }

  NodeService* const service_;
  grpc::ServerCompletionQueue* const queue_;
  grpc::ServerContext context_;
  v1::WatchAssignmentsRequest request_;
  grpc::ServerAsyncWriter<v1::AssignmentsNotice> writer_;
  const std::shared_ptr<State> state_;
  const v1::AssignmentsNotice notice_;
  Tag accepted_tag_{this, Event::kAccepted};
  Tag written_tag_{this, Event::kWritten};
  Tag finished_tag_{this, Event::kFinished};
  Tag done_tag_{this, Event::kDone};
  // Set on the queue's thread before any other thread may see the call.
  AssignmentNotifier::Handle handle_ = 0;
  // Guarded by state_->mu.
  bool started_ = false;    // the accepted tag came back
  bool done_ = false;       // the done tag came back: the call is over
  bool writing_ = false;    // a write is in flight
  bool finishing_ = false;  // Finish is in flight
  bool finished_ = false;   // no more notices: finishing, or the stream broke
  bool pending_ = false;    // a notice waits for the write in flight
  // The status to finish with, set by FinishLocked; held while a write is in flight.
  std::optional<grpc::Status> finish_status_;
};

absl::Status NodeService::AdmitWatch(const grpc::ServerContext& context,
                                     const v1::WatchAssignmentsRequest& request) {
  RETURN_IF_ERROR(AdmitCall(authenticator_, context, Action::kNode).status());
  RETURN_IF_ERROR(cluster_->CheckWatcher(request.node_id(), request.node_key()));
  if (notifier_ == nullptr) {
    return absl::UnimplementedError("this coordinator does not announce assignments");
  }
  return absl::OkStatus();
}

int NodeService::completion_queues() const {
  // A stream costs its queue a tag and wakes it once per notice; a few queues keep each one's
  // list of outstanding tags short.
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  return std::clamp(cores / 4, 1, 4);
}

void NodeService::StartServing(std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> queues) {
  watch_queues_ = std::move(queues);
  for (auto& queue : watch_queues_) {
    grpc::ServerCompletionQueue* raw = queue.get();
    // Several calls requested at once per queue, each taken call requesting the next: a fleet
    // that reconnects together (a coordinator restart) is taken without waiting on one request.
    for (int i = 0; i < kWatchRequestsPerQueue; ++i) AcceptWatch(raw);
    watch_threads_.emplace_back([raw] {
      void* tag;
      bool ok;
      while (raw->Next(&tag, &ok)) WatchCall::Proceed(tag, ok);
    });
  }
}

void NodeService::StopServing() {
  {
    absl::MutexLock lock(&accept_mu_);
    stopping_ = true;
  }
  for (auto& queue : watch_queues_) queue->Shutdown();
  for (auto& thread : watch_threads_) thread.join();
  watch_threads_.clear();
  watch_queues_.clear();
}

void NodeService::AcceptWatch(grpc::ServerCompletionQueue* queue) {
  absl::MutexLock lock(&accept_mu_);
  if (stopping_) return;
  new WatchCall(this, queue);  // deletes itself
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
               [this, request]() -> absl::StatusOr<v1::RegisterNodeResponse> {
                 ASSIGN_OR_RETURN(v1::RegisterNodeResponse registered,
                                  cluster_->Register(*request));
                 registered.set_leader_epoch(leader_epoch_);
                 return registered;
               });
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
    if (result.ok()) {
      *response = *std::move(result);
      response->set_leader_epoch(leader_epoch_);
    }
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

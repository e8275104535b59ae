#include "coordinator/service/coordinator_service.h"

#include <deque>
#include <memory>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "common/daemon/grpc_status.h"
#include "common/status_macros.h"
#include "coordinator/admission/job_validation.h"
#include "coordinator/admission/layout_planning.h"
#include "coordinator/scheduler/topology.h"
#include "coordinator/service/log_relay.h"

namespace tessera::coordinator {
namespace {

// Job ids are short; anything longer is not one of ours.
constexpr size_t kMaxIdLength = 128;
// Events read from the store per batch while a watcher catches up.
constexpr int kWatchBatch = 256;

// Finishes a unary call with `status`; a retry-after hint (ClientLimits) goes out as trailing
// metadata.
void FinishCall(grpc::CallbackServerContext* context, grpc::ServerUnaryReactor* reactor,
                const absl::Status& status) {
  if (auto retry = status.GetPayload(kRetryAfterPayload); retry.has_value()) {
    context->AddTrailingMetadata("retry-after-ms", std::string(*retry));
  }
  reactor->Finish(ToGrpcStatus(status));
}

// A stream refused before it began.
template <typename T>
class RefusedStream final : public grpc::ServerWriteReactor<T> {
 public:
  explicit RefusedStream(const absl::Status& status) { this->Finish(ToGrpcStatus(status)); }
  void OnDone() override { delete this; }
};

absl::Status CheckJobId(const std::string& job_id) {
  if (job_id.empty()) return absl::InvalidArgumentError("job_id: required");
  if (job_id.size() > kMaxIdLength) {
    return absl::InvalidArgumentError(absl::StrCat("job_id: longer than ", kMaxIdLength));
  }
  return absl::OkStatus();
}

// Replays a job's stored events after a sequence number, then follows new
// ones as JobManager announces them, and finishes once the job is terminal
// and everything is sent. Lifetime: gRPC owns the reactor until OnDone; the
// manager's listener holds only the shared State, whose `reactor` is cleared
// (under the same recursive mutex that every entry point takes) before the
// reactor is deleted.
class WatchReactor final : public grpc::ServerWriteReactor<v1::JobEvent> {
 public:
  WatchReactor(JobManager* jobs, const v1::WatchJobRequest& request,
               std::shared_ptr<void> stream_slot)
      : stream_slot_(std::move(stream_slot)),
        jobs_(jobs),
        job_id_(request.job_id()),
        last_sequence_(request.after_sequence()),
        from_step_(request.from_step()),
        state_(std::make_shared<State>()) {
    state_->reactor = this;
    if (auto status = CheckJobId(job_id_); !status.ok()) {
      finished_ = true;
      Finish(ToGrpcStatus(status));
      return;
    }
    if (auto job = jobs_->Get(job_id_); !job.ok()) {
      finished_ = true;
      Finish(ToGrpcStatus(job.status()));
      return;
    }
    std::shared_ptr<State> state = state_;
    handle_ = jobs_->Subscribe(job_id_, [state] {
      std::lock_guard<std::recursive_mutex> lock(state->mu);
      if (state->reactor != nullptr) state->reactor->PumpLocked();
    });
    std::lock_guard<std::recursive_mutex> lock(state->mu);
    PumpLocked();
  }

  void OnWriteDone(bool ok) override {
    std::shared_ptr<State> state = state_;
    std::lock_guard<std::recursive_mutex> lock(state->mu);
    writing_ = false;
    if (!ok) {
      FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "client went away"));
      return;
    }
    PumpLocked();
  }

  void OnCancel() override {
    std::shared_ptr<State> state = state_;
    std::lock_guard<std::recursive_mutex> lock(state->mu);
    FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "watch cancelled"));
  }

  void OnDone() override {
    std::shared_ptr<State> state = state_;
    {
      std::lock_guard<std::recursive_mutex> lock(state->mu);
      state->reactor = nullptr;
    }
    if (handle_ != 0) jobs_->Unsubscribe(handle_);
    delete this;
  }

 private:
  struct State {
    std::recursive_mutex mu;
    WatchReactor* reactor = nullptr;
  };

  void FinishLocked(const grpc::Status& status) {
    if (finished_) return;
    finished_ = true;
    Finish(status);  // may run OnDone inline; touch nothing afterwards
  }

  // Sends the next event, refilling from the store when the buffer is empty.
  // Caller holds state_->mu.
  void PumpLocked() {
    if (writing_ || finished_) return;
    if (jobs_->closed()) {
      return FinishLocked(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                       "the coordinator is shutting down; watch again (from "
                                       "after_sequence) once it is back"));
    }
    if (buffer_.empty()) {
      // The job first, then its events: a terminal state was committed
      // together with its event, so "terminal and nothing newer" is final.
      auto job = jobs_->Get(job_id_);
      if (!job.ok()) return FinishLocked(ToGrpcStatus(job.status()));
      auto events = jobs_->Events(job_id_, last_sequence_, kWatchBatch);
      if (!events.ok()) return FinishLocked(ToGrpcStatus(events.status()));
      for (auto& event : *events) {
        last_sequence_ = event.sequence();
        if (event.has_metrics() && event.metrics().step() < from_step_) continue;
        buffer_.push_back(std::move(event));
      }
      if (buffer_.empty()) {
        if (IsTerminal(job->state()) && events->empty()) FinishLocked(grpc::Status::OK);
        // Caught up with events still to come (or skipped): the listener
        // calls back when there are more.
        if (!events->empty() && !finished_) PumpLocked();
        return;
      }
    }
    current_ = std::move(buffer_.front());
    buffer_.pop_front();
    writing_ = true;
    StartWrite(&current_);
  }

  // Held while the stream is open (ClientLimits' per-user count).
  std::shared_ptr<void> stream_slot_;
  JobManager* jobs_;
  const std::string job_id_;
  int64_t last_sequence_;
  const int64_t from_step_;
  std::shared_ptr<State> state_;
  int64_t handle_ = 0;
  bool writing_ = false;
  bool finished_ = false;
  std::deque<v1::JobEvent> buffer_;
  v1::JobEvent current_;
};

}  // namespace

absl::StatusOr<Principal> AdmitCall(Authenticator* authenticator,
                                    const grpc::ServerContextBase& context, Action action,
                                    absl::string_view job_owner) {
  Principal principal;
  if (authenticator == nullptr) {
    principal.user = "anonymous";
    principal.roles = ~0u;
    principal.method = "open";
  } else {
    ASSIGN_OR_RETURN(principal, authenticator->Authenticate(CredentialsOf(context)));
  }
  RETURN_IF_ERROR(Authorize(principal, action, job_owner));
  return principal;
}

template <typename Handle>
grpc::ServerUnaryReactor* CoordinatorService::Serve(grpc::CallbackServerContext* context,
                                                    Handle handle) {
  return HandleOn(executor_, context, std::move(handle),
                  [context](const absl::Status& status, grpc::ServerUnaryReactor* reactor) {
                    FinishCall(context, reactor, status);
                  });
}

absl::StatusOr<Principal> CoordinatorService::Admit(grpc::CallbackServerContext* context,
                                                    Action action, const std::string& job_id) {
  if (action != Action::kManageJob) return AdmitCall(authenticator_, *context, action);
  // Who may act on a job depends on its owner: authenticate before reading it, so that an
  // unknown caller learns nothing (not even whether the job exists).
  RETURN_IF_ERROR(AdmitCall(authenticator_, *context, Action::kRead).status());
  RETURN_IF_ERROR(CheckJobId(job_id));
  ASSIGN_OR_RETURN(v1::Job job, jobs_->Get(job_id));
  return AdmitCall(authenticator_, *context, action, job.owner());
}

absl::StatusOr<std::shared_ptr<void>> CoordinatorService::AdmitStream(
    grpc::CallbackServerContext* context, Action action, const std::string& job_id) {
  ASSIGN_OR_RETURN(Principal principal, Admit(context, action, job_id));
  if (limits_ == nullptr) return std::shared_ptr<void>();
  return limits_->OpenStream(principal.user);
}

grpc::ServerUnaryReactor* CoordinatorService::SubmitJob(grpc::CallbackServerContext* context,
                                                        const v1::SubmitJobRequest* request,
                                                        v1::SubmitJobResponse* response) {
  return Serve(context, [this, context, request, response]() -> absl::Status {
    ASSIGN_OR_RETURN(Principal principal, Admit(context, Action::kSubmit));
    if (limits_ != nullptr) RETURN_IF_ERROR(limits_->AdmitSubmit(principal.user));
    const v1::PlacementSpec& placement = request->spec().placement();
    RETURN_IF_ERROR(CheckPlacementLevels(placement.required(), placement.preferred(),
                                         cluster_->topology_levels()));
    ASSIGN_OR_RETURN(v1::Job job,
                     jobs_->Submit(request->spec(), request->request_id(), principal.user));
    // The job need not wait for the regular pass; a burst of submissions shares one.
    if (job.state() == v1::JOB_STATE_PENDING) cluster_->RequestPass();
    *response->mutable_job() = std::move(job);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* CoordinatorService::GetJob(grpc::CallbackServerContext* context,
                                                     const v1::GetJobRequest* request,
                                                     v1::GetJobResponse* response) {
  return Serve(context, [this, context, request, response]() -> absl::Status {
    RETURN_IF_ERROR(Admit(context, Action::kRead).status());
    RETURN_IF_ERROR(CheckJobId(request->job_id()));
    ASSIGN_OR_RETURN(v1::Job job, jobs_->Get(request->job_id()));
    if (auto straggler = cluster_->Straggler(job.job_id())) *job.mutable_straggler() = *straggler;
    *response->mutable_job() = std::move(job);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* CoordinatorService::ListJobs(grpc::CallbackServerContext* context,
                                                       const v1::ListJobsRequest* request,
                                                       v1::ListJobsResponse* response) {
  return Serve(context, [this, context, request, response]() -> absl::Status {
    RETURN_IF_ERROR(Admit(context, Action::kRead).status());
    std::vector<v1::JobState> states;
    for (int state : request->states()) states.push_back(static_cast<v1::JobState>(state));
    ASSIGN_OR_RETURN(JobPage page,
                     jobs_->List(states, request->page_size(), request->page_token()));
    for (auto& job : page.jobs) *response->add_jobs() = std::move(job);
    response->set_next_page_token(page.next_page_token);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* CoordinatorService::CancelJob(grpc::CallbackServerContext* context,
                                                        const v1::CancelJobRequest* request,
                                                        v1::CancelJobResponse* response) {
  return Serve(context, [this, context, request, response]() -> absl::Status {
    RETURN_IF_ERROR(Admit(context, Action::kManageJob, request->job_id()).status());
    RETURN_IF_ERROR(CheckJobId(request->job_id()));
    ASSIGN_OR_RETURN(*response->mutable_job(),
                     jobs_->Cancel(request->job_id(), request->reason()));
    return absl::OkStatus();
  });
}

grpc::ServerWriteReactor<v1::JobEvent>* CoordinatorService::WatchJob(
    grpc::CallbackServerContext* context, const v1::WatchJobRequest* request) {
  auto slot = AdmitStream(context, Action::kRead);
  if (!slot.ok()) return new RefusedStream<v1::JobEvent>(slot.status());
  return new WatchReactor(jobs_, *request, std::move(*slot));
}

grpc::ServerUnaryReactor* CoordinatorService::GetMetrics(grpc::CallbackServerContext* context,
                                                         const v1::GetMetricsRequest* request,
                                                         v1::GetMetricsResponse* response) {
  return Serve(context, [this, context, request, response]() -> absl::Status {
    RETURN_IF_ERROR(Admit(context, Action::kRead).status());
    RETURN_IF_ERROR(CheckJobId(request->job_id()));
    ASSIGN_OR_RETURN(*response, jobs_->Metrics(*request));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* CoordinatorService::ListCheckpoints(
    grpc::CallbackServerContext* context, const v1::ListCheckpointsRequest* request,
    v1::ListCheckpointsResponse* response) {
  return Serve(context, [this, context, request, response]() -> absl::Status {
    RETURN_IF_ERROR(Admit(context, Action::kRead).status());
    RETURN_IF_ERROR(CheckJobId(request->job_id()));
    ASSIGN_OR_RETURN(auto checkpoints, jobs_->Checkpoints(request->job_id()));
    for (auto& checkpoint : checkpoints) *response->add_checkpoints() = std::move(checkpoint);
    return absl::OkStatus();
  });
}

namespace {

// ListNodes' topology: the levels with their figures and every domain, over the nodes listed
// (devices: GPUs, or CPU slots when no node listed has a GPU; only READY nodes' count).
void FillTopology(const std::vector<TopologyLevel>& levels, v1::ListNodesResponse* response) {
  if (levels.empty()) return;
  bool gpus = false;
  for (const v1::Node& node : response->nodes()) gpus = gpus || node.resources().gpus_size() > 0;
  std::vector<TopologyNode> nodes;
  nodes.reserve(response->nodes_size());
  for (const v1::Node& node : response->nodes()) {
    TopologyNode& t = nodes.emplace_back();
    t.node_id = node.node_id();
    t.labels.insert(node.topology().begin(), node.topology().end());
    t.free = gpus ? node.free_gpus_size() : node.free_cpu_slots();
    t.total = gpus ? node.resources().gpus_size() : node.resources().cpu_slots();
    t.schedulable = node.state() == v1::NODE_STATE_READY;
  }
  const TopologyView view = BuildTopology(levels, nodes);
  for (size_t i = 0; i < levels.size(); ++i) {
    const TopologyLevelFigures& figures = view.levels[i];
    v1::TopologyLevelStatus* level = response->add_topology_levels();
    level->set_name(levels[i].name);
    level->set_bandwidth_gbps(levels[i].bandwidth_gbps);
    level->set_domains(figures.domains);
    level->set_whole_free_domains(figures.whole_free_domains);
    level->set_largest_free(figures.largest_free);
    level->set_free(figures.free);
    level->set_fragmentation(figures.fragmentation);
  }
  for (const TopologyDomain& domain : view.domains) {
    v1::TopologyDomainStatus* out = response->add_topology_domains();
    out->set_level(static_cast<int32_t>(domain.level));
    out->set_domain(domain.domain);
    out->set_parent(domain.parent);
    out->set_node_only(domain.node_only);
    out->set_free(domain.free);
    out->set_total(domain.total);
    for (const std::string& node_id : domain.nodes) out->add_node_ids(node_id);
  }
}

}  // namespace

grpc::ServerUnaryReactor* CoordinatorService::ListNodes(grpc::CallbackServerContext* context,
                                                        const v1::ListNodesRequest* request,
                                                        v1::ListNodesResponse* response) {
  return Serve(context, [this, context, request, response]() -> absl::Status {
    RETURN_IF_ERROR(Admit(context, Action::kRead).status());
    for (auto& node : cluster_->Nodes(request->include_lost())) {
      node.clear_key_sha256();
      *response->add_nodes() = std::move(node);
    }
    FillTopology(cluster_->topology_levels(), response);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* CoordinatorService::ListQueues(grpc::CallbackServerContext* context,
                                                         const v1::ListQueuesRequest* /*request*/,
                                                         v1::ListQueuesResponse* response) {
  return Serve(context, [this, context, response]() -> absl::Status {
    RETURN_IF_ERROR(Admit(context, Action::kRead).status());
    *response = cluster_->ListQueues();
    return absl::OkStatus();
  });
}

namespace {

absl::Status CheckNodeId(const std::string& node_id) {
  if (node_id.empty()) return absl::InvalidArgumentError("node_id: required");
  if (node_id.size() > 253) return absl::InvalidArgumentError("node_id: longer than 253 bytes");
  return absl::OkStatus();
}

}  // namespace

grpc::ServerUnaryReactor* CoordinatorService::DrainNode(grpc::CallbackServerContext* context,
                                                        const v1::DrainNodeRequest* request,
                                                        v1::DrainNodeResponse* response) {
  return Serve(context, [this, context, request, response]() -> absl::Status {
    RETURN_IF_ERROR(Admit(context, Action::kAdminister).status());
    RETURN_IF_ERROR(CheckNodeId(request->node_id()));
    if (request->reason().size() > 1024) {
      return absl::InvalidArgumentError("reason: longer than 1024 bytes");
    }
    ASSIGN_OR_RETURN(*response, cluster_->DrainNode(request->node_id(), request->checkpoint(),
                                                    request->reason()));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* CoordinatorService::UndrainNode(grpc::CallbackServerContext* context,
                                                          const v1::UndrainNodeRequest* request,
                                                          v1::UndrainNodeResponse* response) {
  return Serve(context, [this, context, request, response]() -> absl::Status {
    RETURN_IF_ERROR(Admit(context, Action::kAdminister).status());
    RETURN_IF_ERROR(CheckNodeId(request->node_id()));
    ASSIGN_OR_RETURN(*response->mutable_node(), cluster_->UndrainNode(request->node_id()));
    // Its devices may let a waiting job start now.
    cluster_->RequestPass();
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* CoordinatorService::RemoveNode(grpc::CallbackServerContext* context,
                                                         const v1::RemoveNodeRequest* request,
                                                         v1::RemoveNodeResponse* response) {
  return Serve(context, [this, context, request]() -> absl::Status {
    RETURN_IF_ERROR(Admit(context, Action::kAdminister).status());
    RETURN_IF_ERROR(CheckNodeId(request->node_id()));
    return cluster_->RemoveNode(request->node_id());
  });
}

grpc::ServerWriteReactor<v1::LogChunk>* CoordinatorService::GetLogs(
    grpc::CallbackServerContext* context, const v1::GetLogsRequest* request) {
  auto slot = AdmitStream(context, Action::kManageJob, request->job_id());
  if (!slot.ok()) return new RefusedStream<v1::LogChunk>(slot.status());
  return StartLogRelay(jobs_, cluster_, *request, worker_security_, std::move(*slot));
}

grpc::ServerUnaryReactor* CoordinatorService::PlanLayout(grpc::CallbackServerContext* context,
                                                         const v1::PlanLayoutRequest* request,
                                                         v1::PlanLayoutResponse* response) {
  return Serve(context, [this, context, request, response]() -> absl::Status {
    RETURN_IF_ERROR(Admit(context, Action::kRead).status());
    ASSIGN_OR_RETURN(*response, PlanLayoutFor(*request, cluster_->Capacity()));
    return absl::OkStatus();
  });
}

}  // namespace tessera::coordinator

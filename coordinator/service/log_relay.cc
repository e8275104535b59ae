#include "coordinator/service/log_relay.h"

#include <deque>
#include <memory>
#include <mutex>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/daemon/grpc_status.h"
#include "common/daemon/server.h"
#include "grpcpp/client_context.h"
#include "tessera/v1/worker_service.grpc.pb.h"

namespace tessera::coordinator {
namespace {

// How long a relay waits for a worker to answer when not following.
constexpr absl::Duration kReadDeadline = absl::Seconds(30);

class LogRelay final : public grpc::ServerWriteReactor<v1::LogChunk> {
 public:
  // Shared with the reader threads, which may outlive the reactor.
  struct State {
    std::mutex mu;
    LogRelay* reactor = nullptr;
    std::deque<v1::LogChunk> queue;
    bool writing = false;
    bool finished = false;
    int active_readers = 0;
    int failed_readers = 0;
    grpc::Status first_error;
    std::vector<std::shared_ptr<grpc::ClientContext>> contexts;
    // Credentials of the calls to the workers (null: plaintext) and the name their certificates
    // carry (empty: their address's host).
    std::shared_ptr<grpc::ChannelCredentials> credentials;
    std::string tls_server_name;
  };

  LogRelay(const WorkerChannelSecurity& security, std::shared_ptr<void> stream_slot)
      : stream_slot_(std::move(stream_slot)), state_(std::make_shared<State>()) {
    state_->reactor = this;
    state_->credentials = security.credentials;
    state_->tls_server_name = security.tls_server_name;
  }

  // Reads from each (node_id, address) on its own thread.
  void Start(const std::vector<std::pair<std::string, std::string>>& workers,
             const v1::ReadLogsRequest& request, bool follow) {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->active_readers = static_cast<int>(workers.size());
    for (const auto& [node_id, address] : workers) {
      auto context = std::make_shared<grpc::ClientContext>();
      if (!follow) context->set_deadline(absl::ToChronoTime(absl::Now() + kReadDeadline));
      state_->contexts.push_back(context);
      std::thread(ReadFrom, state_, context, node_id, address, request).detach();
    }
  }

  void FinishNow(const grpc::Status& status) {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->finished = true;
    Finish(status);
  }

  void OnWriteDone(bool ok) override {
    std::shared_ptr<State> state = state_;
    std::lock_guard<std::mutex> lock(state->mu);
    state->writing = false;
    if (!ok) {
      FinishLocked(*state, grpc::Status(grpc::StatusCode::CANCELLED, "client went away"));
      return;
    }
    PumpLocked(*state);
  }

  void OnCancel() override {
    std::shared_ptr<State> state = state_;
    std::lock_guard<std::mutex> lock(state->mu);
    for (auto& context : state->contexts) context->TryCancel();
    FinishLocked(*state, grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
  }

  void OnDone() override {
    std::shared_ptr<State> state = state_;
    {
      std::lock_guard<std::mutex> lock(state->mu);
      state->reactor = nullptr;
      for (auto& context : state->contexts) context->TryCancel();
    }
    delete this;
  }

 private:
  static void ReadFrom(std::shared_ptr<State> state, std::shared_ptr<grpc::ClientContext> context,
                       std::string node_id, std::string address, v1::ReadLogsRequest request) {
    auto stub = v1::Worker::NewStub(MakeClientChannel(address, state->credentials, state->tls_server_name));
    auto reader = stub->ReadLogs(context.get(), request);
    v1::LogChunk chunk;
    while (reader->Read(&chunk)) {
      if (chunk.node_id().empty()) chunk.set_node_id(node_id);
      std::lock_guard<std::mutex> lock(state->mu);
      if (state->reactor == nullptr || state->finished) return;
      state->queue.push_back(chunk);
      state->reactor->PumpLocked(*state);
    }
    grpc::Status status = reader->Finish();
    std::lock_guard<std::mutex> lock(state->mu);
    --state->active_readers;
    if (!status.ok()) {
      ++state->failed_readers;
      if (state->first_error.ok()) {
        state->first_error = grpc::Status(
            status.error_code(),
            absl::StrCat("worker ", node_id, " at ", address, ": ", status.error_message()));
      }
    }
    if (state->reactor != nullptr) state->reactor->PumpLocked(*state);
  }

  // Caller holds state.mu.
  void PumpLocked(State& state) {
    if (state.writing || state.finished) return;
    if (!state.queue.empty()) {
      current_ = std::move(state.queue.front());
      state.queue.pop_front();
      state.writing = true;
      StartWrite(&current_);
      return;
    }
    if (state.active_readers > 0) return;
    // Every node answered: an error only when none of them could.
    bool all_failed = state.failed_readers == static_cast<int>(state.contexts.size());
    FinishLocked(state, all_failed ? state.first_error : grpc::Status::OK);
  }

  void FinishLocked(State& state, const grpc::Status& status) {
    if (state.finished) return;
    state.finished = true;
    Finish(status);
  }

  // Held while the stream is open (ClientLimits' per-user count).
  std::shared_ptr<void> stream_slot_;
  std::shared_ptr<State> state_;
  v1::LogChunk current_;
};

}  // namespace

grpc::ServerWriteReactor<v1::LogChunk>* StartLogRelay(
    JobManager* jobs, Cluster* cluster, const v1::GetLogsRequest& request,
    const WorkerChannelSecurity& worker_security, std::shared_ptr<void> stream_slot) {
  auto* relay = new LogRelay(worker_security, std::move(stream_slot));
  auto fail = [relay](const absl::Status& status) {
    relay->FinishNow(ToGrpcStatus(status));
    return relay;
  };
  if (request.job_id().empty()) return fail(absl::InvalidArgumentError("job_id: required"));
  auto job = jobs->Get(request.job_id());
  if (!job.ok()) return fail(job.status());
  if (job->placements().empty()) {
    return fail(absl::FailedPreconditionError(
        absl::StrCat("job ", request.job_id(), " is ", v1::JobState_Name(job->state()),
                     ": no trainer has been placed, so there are no logs")));
  }
  std::set<std::string> node_ids;
  for (const auto& rank : job->placements()) {
    if (request.rank() < 0 || rank.rank() == request.rank()) node_ids.insert(rank.node_id());
  }
  if (node_ids.empty()) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("rank: ", request.rank(), " is not a rank of ", request.job_id(),
                     " (world size ", job->placements_size(), ")")));
  }
  std::vector<std::pair<std::string, std::string>> workers;
  for (const auto& node : cluster->Nodes(/*include_lost=*/true)) {
    if (node_ids.contains(node.node_id())) workers.emplace_back(node.node_id(), node.address());
  }
  if (workers.empty()) {
    return fail(absl::UnavailableError(
        absl::StrCat("the nodes of ", request.job_id(), " are no longer registered")));
  }
  v1::ReadLogsRequest read;
  read.set_job_id(request.job_id());
  read.set_attempt(request.attempt() >= 0 ? request.attempt() : job->attempt());
  read.set_rank(request.rank());
  read.set_tail_lines(request.tail_lines());
  read.set_follow(request.follow());
  relay->Start(workers, read, request.follow());
  return relay;
}

}  // namespace tessera::coordinator

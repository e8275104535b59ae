// AssignmentWatch: keeps a NodeService.WatchAssignments stream open to the coordinator and calls
// `on_notice` for each notice, so that the worker heartbeats at once and starts (or stops) the
// tasks the coordinator just decided, instead of at its next heartbeat period. The heartbeat
// response stays the one source of orders: a notice only says "heartbeat now", and while the
// stream is down the periodic heartbeat still delivers everything, only later.
//
// A stream that breaks is opened again after a backoff (doubling from initial_backoff up to
// max_backoff, with jitter); the backoff resets once a stream delivers a notice (the coordinator
// sends one when a stream opens) and on Kick(), which the worker calls after (re)registering.
// A healthy stream is reopened every stream_lifetime: each call carries a deadline. Each stream
// goes to the coordinator that leads (LeaderChannel): a standby's hint is followed at once, any
// other refusal moves the next stream to the next address.
//
// Thread safety: one thread runs the stream; Start, Kick and Stop may be called from any thread.
// `request` and `on_notice` run on the watch thread, without the watch's lock, and must not block.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/daemon/leader_channel.h"
#include "grpcpp/client_context.h"
#include "tessera/v1/node_service.grpc.pb.h"

namespace tessera::worker {

struct AssignmentWatchOptions {
  // Wait before reopening a stream that failed; doubles with each failure in a row.
  absl::Duration initial_backoff = absl::Milliseconds(250);
  absl::Duration max_backoff = absl::Seconds(30);
  // Deadline of each stream: a healthy one is reopened after this long.
  absl::Duration stream_lifetime = absl::Minutes(10);
  // Times the backoff waits (the stream deadline stays on the wall clock, which gRPC measures it
  // on). Not owned; outlives the watch. WorkerAgent sets its own clock here.
  Clock* clock = Clock::Real();
};

class AssignmentWatch {
 public:
  // `leader` must outlive the watch. `authorize` adds the call's credentials (metadata) to a
  // context. `request` gives the node's id and key, or nullopt while the node is not registered
  // (the watch then waits for Kick or a backoff period). `on_notice` is called for each notice.
  AssignmentWatch(LeaderChannel* leader, std::function<void(grpc::ClientContext&)> authorize,
                  std::function<std::optional<v1::WatchAssignmentsRequest>()> request,
                  std::function<void()> on_notice, AssignmentWatchOptions options = {});
  ~AssignmentWatch();

  void Start();
  // Opens the stream now if it is down (e.g. the node just registered), skipping the backoff.
  void Kick();
  // Cancels the open stream and joins the thread; prompt.
  void Stop();

  // Streams opened (each attempt that got as far as the call), for tests.
  int streams_opened() const;
  // Notices received over all streams, for tests.
  int notices() const;

 private:
  void Loop();
  // Runs one stream until it ends; returns whether it delivered a notice.
  bool RunStream(const v1::WatchAssignmentsRequest& request);

  LeaderChannel* const leader_;
  const std::function<void(grpc::ClientContext&)> authorize_;
  const std::function<std::optional<v1::WatchAssignmentsRequest>()> request_;
  const std::function<void()> on_notice_;
  const AssignmentWatchOptions options_;

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool kicked_ ABSL_GUARDED_BY(mu_) = false;
  // The open call's context, for Stop to cancel.
  grpc::ClientContext* context_ ABSL_GUARDED_BY(mu_) = nullptr;
  int streams_opened_ ABSL_GUARDED_BY(mu_) = 0;
  int notices_ ABSL_GUARDED_BY(mu_) = 0;
  // Whether the previous stream delivered a notice and ended only at its deadline: the log says
  // when watching starts (again), not each time a healthy stream is renewed. Watch thread only.
  bool connected_before_ = false;
  // The last error logged, so that a stream refused again and again logs once. Watch thread only.
  std::string last_error_;
  std::thread thread_;
};

}  // namespace tessera::worker

// LeaderChannel: gRPC channels to a set of coordinators of which one leads (docs/coordinator.md,
// the HA contract), and the failover rule every client of the coordinator follows: calls go to the
// address that last answered as leader; a standby's UNAVAILABLE carrying the `tessera-leader`
// trailing metadata sends the next attempt straight to the address it names (even one not in the
// list); an UNAVAILABLE without it (refused, no leader elected yet, a dropped stream) moves to the
// next address of the list; after a whole round of failed attempts the caller backs off (100 ms,
// doubling up to 2 s) until its deadline. Any other status (OK, an error the leader answered with,
// CANCELLED, DEADLINE_EXCEEDED) ends the call; a DEADLINE_EXCEEDED with several addresses also
// moves the next call to the next address (a paused coordinator, or one whose node is gone, hangs
// rather than refusing). The worker (NodeService) and the `tessera` CLI
// (Coordinator) share it; streams reconnect through Call too, with a deadline that moves with their
// progress.
//
// One address behaves as a single coordinator always did: one attempt per call (a leader hint is
// still followed), no backoff; the caller's own retry loop decides when to try again.
//
// Thread safety: every method may be called from any thread; one absl::Mutex guards the channels
// and the leader's index, and is never held during a call or a backoff.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/status.h"

namespace tessera {

// Trailing metadata key of a standby's UNAVAILABLE: the leader's advertise address.
inline constexpr char kLeaderMetadataKey[] = "tessera-leader";

// Splits a comma-separated `--coordinator` value into addresses (spaces trimmed, empty entries
// dropped). INVALID_ARGUMENT naming `field` when no address is left or one has no port.
absl::StatusOr<std::vector<std::string>> ParseCoordinatorAddresses(const std::string& value,
                                                                   const std::string& field);

struct LeaderChannelOptions {
  // Coordinator addresses (host:port), in the order they are tried; at least one.
  std::vector<std::string> addresses;
  // Transport security of every channel; null: plaintext.
  std::shared_ptr<grpc::ChannelCredentials> credentials{};
  // Wait after the first whole round of failed attempts; doubles after each further round.
  absl::Duration initial_backoff = absl::Milliseconds(100);
  absl::Duration max_backoff = absl::Seconds(2);
};

class LeaderChannel {
 public:
  explicit LeaderChannel(LeaderChannelOptions options);

  // One attempt: `context` is fresh, prepared by the caller's `prepare` (deadline, credentials);
  // `channel` leads to `address`. Returns the call's final status.
  using Attempt = std::function<grpc::Status(grpc::ClientContext& context,
                                             const std::shared_ptr<grpc::Channel>& channel,
                                             const std::string& address)>;

  // Runs `attempt` with failover until it returns a status that is not UNAVAILABLE, or until
  // deadline() (read before each attempt and each backoff) has passed. When no address answered
  // as leader, the UNAVAILABLE (or DEADLINE_EXCEEDED) status names every address tried and what
  // each said last. CANCELLED once Shutdown() was called.
  grpc::Status Call(const std::function<absl::Time()>& deadline,
                    const std::function<void(grpc::ClientContext&)>& prepare,
                    const Attempt& attempt);
  grpc::Status Call(absl::Time deadline, const std::function<void(grpc::ClientContext&)>& prepare,
                    const Attempt& attempt);
  // Call for one method of a generated gRPC `Service`: every attempt's context gets `deadline`
  // and then `authorize`'s metadata, and `call` runs on a stub of the attempt's channel.
  template <typename Service>
  grpc::Status CallService(
      absl::Time deadline, const std::function<void(grpc::ClientContext&)>& authorize,
      const std::function<grpc::Status(typename Service::Stub&, grpc::ClientContext&)>& call) {
    return Call(
        deadline,
        [&](grpc::ClientContext& context) {
          context.set_deadline(absl::ToChronoTime(deadline));
          authorize(context);
        },
        [&](grpc::ClientContext& context, const std::shared_ptr<grpc::Channel>& channel,
            const std::string&) {
          std::unique_ptr<typename Service::Stub> stub = Service::NewStub(channel);
          return call(*stub, context);
        });
  }

  // The address calls go to now (the last one that answered as leader, or the next to try).
  std::string leader() const;
  // The addresses as configured, for messages.
  const std::vector<std::string>& addresses() const { return options_.addresses; }
  // Ends every backoff at once and makes later calls return CANCELLED (a daemon stopping).
  void Shutdown();

 private:
  // Learns from an attempt's end: on UNAVAILABLE, moves to the hinted leader or the next address;
  // on DEADLINE_EXCEEDED (several addresses), to the next address.
  void Observe(const std::string& address, const grpc::ClientContext& context,
               const grpc::Status& status);
  std::shared_ptr<grpc::Channel> ChannelLocked(const std::string& address)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const LeaderChannelOptions options_;
  mutable absl::Mutex mu_;
  // Where the next call goes: a list address or a hinted one outside it.
  std::string current_ ABSL_GUARDED_BY(mu_);
  // Index in the list of the address tried last without a hint (the round's position).
  size_t next_index_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_ ABSL_GUARDED_BY(mu_);
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace tessera

// LeaderElection: which of several coordinators sharing one PostgreSQL database leads
// (docs/coordinator.md "High availability"). A lease row (tessera_leader_lease: epoch, holder,
// advertise address, renewed_at, expires_at) decides; every time in it is the database server's
// now(), so the coordinators' clocks never matter. Taking the lease over once it has expired
// increments the epoch; the leader renews it every renew_interval; a renewal that finds another
// epoch fails. The fence (Fence, installed with Store::SetWriteFence) runs at the start of every
// write transaction of the leader's store: it locks the lease row FOR SHARE, which a takeover's
// UPDATE waits for and which waits for a takeover in progress, and refuses the transaction once
// the epoch is not ours, so a deposed leader that wakes up can change nothing.
//
// The table is created here, on the election's own connection, not by the store's migrations:
// a standby takes part in the election before (and without) opening the store, and must not
// migrate the schema under a running leader of another version. Its creation is serialized by
// a transaction-scoped advisory lock, as two coordinators may start at once.
//
// Besides the database's view, the leader keeps its own: it acts only while its last successful
// renewal (timed from before the renewal was sent) is less than the lease ago on its monotonic
// clock (Valid). A leader that was paused for longer than the lease therefore knows it may have
// been deposed the moment it runs again, before asking the database.
//
// Thread safety: every method may be called from any thread. conn_mu_ serializes the election's
// libpq connection (never the store's writer: a renewal must not wait behind a group commit's
// writes, only on the row lock); mu_ guards the epoch, the renewal time and the loss callback.
// The callback is called once, outside mu_, from the renewal thread or from the thread that ran
// the fence.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/store/store_database.h"

struct pg_conn;

namespace tessera::coordinator {

struct LeaderElectionOptions {
  // The coordinators' database (a libpq URI, as --state) and its password (empty: libpq's
  // PGPASSWORD or PGPASSFILE).
  std::string url;
  std::string password;
  // What the others name as the leader's address when this one leads (--advertise_address).
  std::string advertise_address;
  // This process among the candidates; empty: host name, pid and a random number.
  std::string holder;
  // The lease's time to live (--leader_lease_seconds).
  absl::Duration lease = absl::Seconds(5);
  // How often the leader renews; zero: lease / 5.
  absl::Duration renew_interval = absl::ZeroDuration();
  // How long connecting to the server may take.
  int connect_timeout_seconds = 10;
};

// The lease as the database has it.
struct LeaderInfo {
  int64_t epoch = 0;
  std::string holder;
  std::string address;
  // Whether the lease has not expired (by the server's clock).
  bool live = false;
};

class LeaderElection {
 public:
  // Connects and creates the lease table and its row when missing. UNAVAILABLE when the server
  // cannot be reached (the URL named with its password removed).
  static absl::StatusOr<std::unique_ptr<LeaderElection>> Connect(
      const LeaderElectionOptions& options);
  // Stops the renewal thread; unless Release() ran, the lease is left to expire (a successor
  // takes over after the TTL, as after a crash).
  ~LeaderElection();
  LeaderElection(const LeaderElection&) = delete;
  LeaderElection& operator=(const LeaderElection&) = delete;

  // Takes the lease when it has expired (a new epoch, one more than the last), or keeps it when
  // this elector holds it already: true then. False when another holder's lease is live.
  absl::StatusOr<bool> TryAcquire() ABSL_LOCKS_EXCLUDED(conn_mu_, mu_);
  // Extends the lease of our epoch. FAILED_PRECONDITION "leadership epoch N was superseded by M
  // at ADDRESS" when the epoch moved (or we never led); UNAVAILABLE when the server cannot be
  // reached (the lease may still be ours).
  absl::Status Renew() ABSL_LOCKS_EXCLUDED(conn_mu_, mu_);
  // The lease row.
  absl::StatusOr<LeaderInfo> Current() ABSL_LOCKS_EXCLUDED(conn_mu_);

  // Our epoch; 0 before TryAcquire won.
  int64_t epoch() const ABSL_LOCKS_EXCLUDED(mu_);
  const std::string& holder() const { return options_.holder; }
  const std::string& advertise_address() const { return options_.advertise_address; }
  absl::Duration lease() const { return options_.lease; }
  // Whether we lead and our last renewal started less than the lease ago (monotonic clock).
  bool Valid() const ABSL_LOCKS_EXCLUDED(mu_);

  // For Store::SetWriteFence: OK while the lease row's epoch is ours and Valid(); otherwise
  // FAILED_PRECONDITION "store: fenced: ..." (and the loss callback runs). Locks the row FOR SHARE
  // in the writer's transaction.
  absl::Status Fence(DbConnection& writer) ABSL_LOCKS_EXCLUDED(mu_);

  // Ends our leadership now, for a clean shutdown once the store has made its last write: stops
  // renewing (without calling the loss callback) and expires the lease if it is still ours, so
  // that a standby takes over at its next poll instead of after the lease.
  absl::Status Release() ABSL_LOCKS_EXCLUDED(conn_mu_, mu_);

  // Renews every renew_interval on a thread of its own; `on_lost` is called once with
  // "lost leadership (epoch N, now M at ADDRESS)" (or "..., not renewed for D)") when a renewal
  // finds a newer epoch, when no renewal succeeded for the lease, or when the fence refused a
  // write. Call once, after TryAcquire returned true.
  void StartRenewing(std::function<void(const std::string& message)> on_lost)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  explicit LeaderElection(const LeaderElectionOptions& options);

  // Runs `sql` with text parameters; the result's rows as text. Reconnects a broken connection
  // first.
  absl::StatusOr<std::vector<std::vector<std::string>>> Query(
      const std::string& sql, const std::vector<std::string>& parameters)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_mu_);
  absl::StatusOr<LeaderInfo> CurrentLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(conn_mu_);
  // Calls the loss callback (once) with "lost leadership (epoch N, <detail>)".
  void Lose(const std::string& detail) ABSL_LOCKS_EXCLUDED(mu_);
  void RenewLoop();
  // Ends the renewal thread (idempotent).
  void StopRenewing() ABSL_LOCKS_EXCLUDED(mu_);

  const LeaderElectionOptions options_;
  absl::Mutex conn_mu_;
  pg_conn* conn_ ABSL_GUARDED_BY(conn_mu_) = nullptr;

  mutable absl::Mutex mu_;
  int64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  std::chrono::steady_clock::time_point renewed_ ABSL_GUARDED_BY(mu_);
  std::function<void(const std::string&)> on_lost_ ABSL_GUARDED_BY(mu_);
  bool lost_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread renewer_;
};

}  // namespace tessera::coordinator

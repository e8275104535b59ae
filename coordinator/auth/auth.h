// Authentication and authorization of the coordinator's callers.
//
// A caller proves who it is with a bearer token (gRPC metadata
// "authorization: Bearer <token>") or a client certificate verified by the
// TLS layer against --tls_ca, whose Common Name names the user. The auth file
// (YAML, --auth_file) lists users, their roles and the SHA-256 of their tokens;
// it is re-read when it changes, so tokens are added or revoked without a
// restart. Without an auth file the coordinator is open: every caller is an
// administrator (loopback demos and tests).
//
// Roles: viewer reads everything; user also submits and cancels or reads the
// logs of its own jobs; admin may do anything on tessera.v1.Coordinator; node
// is for workers and may only call tessera.v1.NodeService.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "grpcpp/server_context.h"

namespace tessera::coordinator {

enum class Role : uint32_t { kViewer = 1, kUser = 2, kAdmin = 4, kNode = 8 };

// "viewer", "user", "admin", "node"; nullopt for anything else.
std::optional<Role> ParseRole(absl::string_view name);

// Who a call comes from.
struct Principal {
  std::string user{};
  // Bit set of Role values.
  uint32_t roles = 0;
  // How the caller was identified: "token", "certificate" or "open" (no auth file).
  std::string method{};

  bool Has(Role role) const { return (roles & static_cast<uint32_t>(role)) != 0; }
};

// What a call presented, read from its context.
struct CallCredentials {
  // The token of an "authorization: Bearer <token>" header.
  std::optional<std::string> bearer_token{};
  // An authorization header that is not "Bearer <token>".
  bool malformed_authorization = false;
  // Common Name of the client certificate the TLS layer verified; empty without one.
  std::string certificate_common_name{};
};
CallCredentials CredentialsOf(const grpc::ServerContextBase& context);

// One entry of the auth file.
struct AuthUser {
  std::string name;
  uint32_t roles = 0;
  // Lowercase hex SHA-256 of each of the user's tokens.
  std::vector<std::string> token_sha256;
};

// Parses the auth file's text. INVALID_ARGUMENT naming the entry and field at
// fault (unknown keys and roles, malformed hashes, a token or name used twice).
absl::StatusOr<std::vector<AuthUser>> ParseAuthFile(absl::string_view yaml);

// Lowercase hex SHA-256 of `token`.
std::string TokenSha256(absl::string_view token);

struct AuthenticatorOptions {
  // Path of the auth file; empty: open (every caller is an administrator).
  std::string auth_file;
  // How often, at most, calls check whether the file changed.
  absl::Duration reload_check_interval = absl::Seconds(1);
  // Must outlive the authenticator; tests pass a SimulatedClock.
  Clock* clock = Clock::Real();
};

// Thread safety: all methods may be called from any thread (mu_ guards the
// user table and the file's identity).
class Authenticator {
 public:
  // Reads the auth file; its errors are returned (a daemon must not start with a bad one).
  static absl::StatusOr<std::unique_ptr<Authenticator>> Create(AuthenticatorOptions options);

  bool open() const { return options_.auth_file.empty(); }

  // The caller's identity. UNAUTHENTICATED (never data) when the call
  // presented nothing valid: no credentials, an unknown or malformed token,
  // or a certificate whose Common Name is not a user of the file. A token,
  // when presented, wins over the certificate.
  absl::StatusOr<Principal> Authenticate(const CallCredentials& credentials);

  // Re-reads the file when its identity (inode, size, modification time)
  // changed. A file that no longer parses keeps the previous table; the
  // error is returned (and logged once by the caller).
  absl::Status ReloadIfChanged();

  // Reloads performed and failed so far (for logs and tests).
  int reloads() const;

 private:
  explicit Authenticator(AuthenticatorOptions options) : options_(std::move(options)) {}
  absl::Status LoadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const AuthenticatorOptions options_;
  mutable absl::Mutex mu_;
  std::vector<AuthUser> users_ ABSL_GUARDED_BY(mu_);
  // Token hash -> index into users_.
  absl::flat_hash_map<std::string, size_t> by_token_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, size_t> by_name_ ABSL_GUARDED_BY(mu_);
  std::string file_identity_ ABSL_GUARDED_BY(mu_);
  absl::Time last_check_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int reloads_ ABSL_GUARDED_BY(mu_) = 0;
  std::string last_reload_error_ ABSL_GUARDED_BY(mu_);
};

// What a call wants to do.
enum class Action {
  // Read jobs, metrics, checkpoints, nodes, queues; plan layouts.
  kRead,
  // Submit a job.
  kSubmit,
  // Cancel a job or read its logs: its owner or an administrator.
  kManageJob,
  // Worker calls (NodeService).
  kNode,
  // Operate the cluster: drain, undrain and remove nodes. Administrators only.
  kAdminister,
};

// OK when `principal` may do `action` (on a job owned by `job_owner` for
// kManageJob); PERMISSION_DENIED naming the user and what is missing otherwise.
absl::Status Authorize(const Principal& principal, Action action,
                       absl::string_view job_owner = "");

}  // namespace tessera::coordinator

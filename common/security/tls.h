// TLS for every Tessera daemon and client: gRPC server and channel credentials
// built from PEM files (--tls_cert, --tls_key, --tls_ca) that gRPC re-reads
// while the process runs, so rotated certificates (cert-manager) take effect
// without a restart; a start-time check of those files with messages that
// name the flag at fault; and the loopback test daemons use to decide whether
// plaintext is acceptable. See notes/security-spec.md for the contract.
//
// Peer identity: after a TLS handshake in which the peer presented a
// certificate, grpc::AuthContext (ServerContext / CallbackServerContext /
// ClientContext ::auth_context()) carries its subject common name under the
// property "x509_common_name" (GRPC_X509_CN_PROPERTY_NAME, also
// kX509CommonNameProperty below), its SANs under
// "x509_subject_alternative_name", and "transport_security_type" is "tls"
// (GRPC_TLS_TRANSPORT_SECURITY_TYPE; the older SslCredentials say "ssl").
// PeerCommonName() reads the first. tls_test checks both directions: the
// server sees the client certificate's CN and the client sees the server's.
// Do not map users with AuthContext::GetPeerIdentity(): for a certificate with
// SANs (ours carry DNS:localhost, IP:127.0.0.1) the identity property is
// "x509_subject_alternative_name", i.e. host names, not the CN.
//
// Thread safety: all functions are thread-safe; the credentials they return
// may be shared by any number of servers and channels.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpcpp/security/auth_context.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/status.h"

namespace tessera {

// The auth-context property holding the peer certificate's subject CN.
inline constexpr char kX509CommonNameProperty[] = "x509_common_name";

struct TlsOptions {
  // `{}` initializers only keep GCC's -Wmissing-field-initializers quiet
  // about designated initializers such as {.ca_file = ...}.
  std::string cert_file{};  // PEM certificate chain of this process (empty: none)
  std::string key_file{};   // PEM private key matching cert_file
  std::string ca_file{};    // PEM CA bundle verifying peers
  absl::Duration reload_interval = absl::Seconds(10);  // files re-read this often (>= 1 s)
  bool enabled() const { return !cert_file.empty() || !key_file.empty() || !ca_file.empty(); }
};

// What a TLS server asks of its clients when options.ca_file is set.
enum class ClientCertPolicy {
  // Ask for a certificate; verify one if presented, accept clients without
  // one (they authenticate another way, e.g. a bearer token). Coordinator.
  kRequestAndVerify,
  // Refuse the handshake unless a certificate verified by ca_file is
  // presented. Worker.
  kRequireAndVerify,
};

// Checks the files now (exist, readable, parse as PEM, key matches cert,
// every certificate of the chain within its validity dates; a CA bundle needs
// at least one currently valid certificate) so a daemon fails at start with a
// clear message instead of at the first handshake. OK when !options.enabled().
// INVALID_ARGUMENT naming the flag at fault (--tls_cert, --tls_key, --tls_ca,
// --tls_reload_interval) and the file; an expired or not-yet-valid
// certificate's message carries its validity dates.
//   need_identity = true (a server): cert and key are required; ca optional.
//   need_identity = false (a client): ca is required (it verifies the
//   server); cert and key are optional but come together.
absl::Status CheckTlsFiles(const TlsOptions& options, bool need_identity);

// Server credentials. Without options.enabled(): grpc::InsecureServerCredentials().
// Otherwise TLS from the files via grpc::experimental::FileWatcherCertificateProvider
// (re-read every reload_interval); with ca_file, client certificates are
// requested or required per `policy` and verified against the CA; without
// ca_file no client certificate is asked for, and kRequireAndVerify is an
// INVALID_ARGUMENT naming --tls_ca. Runs CheckTlsFiles(options, true) first.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsOptions& options, ClientCertPolicy policy);

// Channel credentials. Without options.enabled(): grpc::InsecureChannelCredentials().
// Otherwise verifies the server's certificate against ca_file (required) and
// its name against the host of the channel's target (gRPC's default hostname
// check: a server reached as 127.0.0.1:PORT needs SAN IP:127.0.0.1); presents
// cert/key as client certificate when given. Files are re-read every
// reload_interval. Runs CheckTlsFiles(options, false) first.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsOptions& options);

// True for listen addresses that only this machine can reach: 127.0.0.0/8,
// [::1] (and ::ffff:127.x), "localhost", and unix: / unix-abstract: sockets.
// False for wildcards (0.0.0.0, [::], ":port") and every other host.
bool IsLoopbackAddress(absl::string_view host_port);

// The peer certificate's subject CN from an auth context (nullptr-safe);
// nullopt when the peer presented no certificate (or the call was plaintext).
std::optional<std::string> PeerCommonName(const grpc::AuthContext* auth_context);

// The subject CN of the first certificate in the PEM file at `cert_file` (a daemon's own
// --tls_cert). INVALID_ARGUMENT naming the file when it holds no certificate, or one without a CN.
absl::StatusOr<std::string> CertificateCommonName(const std::string& cert_file);

// An allow-list of callers by certificate CN: OK when `allowed` is empty (any certificate the
// TLS layer verified) or holds the caller's CN; PERMISSION_DENIED otherwise, saying which CN (or
// that there was no certificate) and naming `flag`, the list's flag.
grpc::Status CheckCallerAllowed(const grpc::ServerContextBase& context,
                                const std::vector<std::string>& allowed, absl::string_view flag);

}  // namespace tessera

// The transport security a daemon serves and calls with: TLS from PEM files
// when --tls_cert/--tls_key/--tls_ca are given, plaintext only on loopback or
// when --insecure explicitly asks for it (with a warning when the port is
// reachable beyond loopback).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/security/tls.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"

namespace tessera {

struct DaemonSecurityOptions {
  // This daemon's certificate, key and the CA that verifies its peers.
  TlsOptions tls;
  // Serve plaintext beyond loopback (--insecure).
  bool insecure = false;
};

// Server credentials for a daemon `binary` listening on `listen_address`.
// INVALID_ARGUMENT when the TLS files are unusable (CheckTlsFiles), or when
// the address is reachable beyond loopback, TLS is off and --insecure was not
// given. Logs a warning to stderr for plaintext beyond loopback.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> DaemonServerCredentials(
    const std::string& binary, const std::string& listen_address,
    const DaemonSecurityOptions& options, ClientCertPolicy policy);

// Credentials of the daemon's own calls to other daemons: TLS verifying the
// server against the CA and presenting this daemon's certificate, or
// plaintext when TLS is off.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> DaemonChannelCredentials(
    const DaemonSecurityOptions& options);

}  // namespace tessera

#include "common/security/daemon_security.h"

#include <iostream>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace tessera {

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> DaemonServerCredentials(
    const std::string& binary, const std::string& listen_address,
    const DaemonSecurityOptions& options, ClientCertPolicy policy) {
  if (options.tls.enabled()) {
    if (options.insecure) {
      return absl::InvalidArgumentError("--insecure contradicts --tls_cert/--tls_key/--tls_ca");
    }
    RETURN_IF_ERROR(CheckTlsFiles(options.tls, /*need_identity=*/true));
    return MakeServerCredentials(options.tls, policy);
  }
  if (!IsLoopbackAddress(listen_address)) {
    if (!options.insecure) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--listen ", listen_address,
          " is reachable beyond loopback and TLS is off: give --tls_cert, --tls_key and "
          "--tls_ca, or --insecure to serve plaintext on purpose"));
    }
    std::cerr << binary << ": WARNING: serving plaintext gRPC on " << listen_address
              << " (--insecure): anyone who can reach it can read and forge its traffic\n";
  }
  return MakeServerCredentials(options.tls, policy);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> DaemonChannelCredentials(
    const DaemonSecurityOptions& options) {
  if (options.tls.enabled()) RETURN_IF_ERROR(CheckTlsFiles(options.tls, /*need_identity=*/false));
  return MakeChannelCredentials(options.tls);
}

}  // namespace tessera

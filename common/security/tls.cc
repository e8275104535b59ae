#include "common/security/tls.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <algorithm>
#include <cstdint>
#include <ctime>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/read_file.h"
#include "grpc/grpc_security_constants.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"

namespace tessera {
namespace {

constexpr absl::string_view kCertFlag = "--tls_cert";
constexpr absl::string_view kKeyFlag = "--tls_key";
constexpr absl::string_view kCaFlag = "--tls_ca";
constexpr absl::string_view kReloadFlag = "--tls_reload_interval";

struct BioDeleter {
  void operator()(BIO* bio) const { BIO_free(bio); }
};
struct X509Deleter {
  void operator()(X509* cert) const { X509_free(cert); }
};
struct PkeyDeleter {
  void operator()(EVP_PKEY* key) const { EVP_PKEY_free(key); }
};
using BioPtr = std::unique_ptr<BIO, BioDeleter>;
using X509Ptr = std::unique_ptr<X509, X509Deleter>;
using PkeyPtr = std::unique_ptr<EVP_PKEY, PkeyDeleter>;

// The oldest queued OpenSSL error as text (empty when none); empties this
// thread's queue so the next check starts clean.
std::string TakeOpenSslError() {
  unsigned long code = ERR_peek_error();
  std::string text;
  if (code != 0) {
    char buffer[256];
    ERR_error_string_n(code, buffer, sizeof(buffer));
    text = buffer;
  }
  ERR_clear_error();
  return text;
}

// Refuses to prompt for a passphrase on the terminal: an encrypted key is an error.
int NoPassphrase(char* buf, int size, int rwflag, void* userdata) { return -1; }

absl::Status FlagError(absl::string_view flag, absl::string_view path, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, ": ", problem));
}

absl::StatusOr<std::string> ReadPemFile(absl::string_view flag, const std::string& path) {
  absl::StatusOr<std::string> contents = ReadWholeFile(path);
  if (!contents.ok()) {
    // ReadWholeFile's message already names the path.
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": cannot read ", contents.status().message()));
  }
  return contents;
}

// Every certificate in PEM `pem`, in order.
std::vector<X509Ptr> ParseCertificates(const std::string& pem) {
  std::vector<X509Ptr> certs;
  BioPtr bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  while (X509* cert = PEM_read_bio_X509(bio.get(), nullptr, NoPassphrase, nullptr)) {
    certs.emplace_back(cert);
  }
  ERR_clear_error();  // The end of the input is reported as an error.
  return certs;
}

std::string FormatAsn1Time(const ASN1_TIME* time) {
  std::tm tm = {};
  if (ASN1_TIME_to_tm(time, &tm) != 1) return "(unreadable date)";
  return absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", absl::FromTimeT(timegm(&tm)),
                          absl::UTCTimeZone());
}

std::string SubjectOf(X509* cert) {
  char buffer[256];
  X509_NAME_oneline(X509_get_subject_name(cert), buffer, sizeof(buffer));
  return buffer;
}

// Empty when `cert` is valid now, else why not, with its dates.
std::string ValidityProblem(X509* cert) {
  const ASN1_TIME* not_before = X509_get0_notBefore(cert);
  const ASN1_TIME* not_after = X509_get0_notAfter(cert);
  const char* problem = nullptr;
  if (X509_cmp_current_time(not_before) >= 0) {
    problem = "is not yet valid";
  } else if (X509_cmp_current_time(not_after) <= 0) {
    problem = "has expired";
  } else {
    return "";
  }
  return absl::StrCat("certificate ", SubjectOf(cert), " ", problem, " (valid from ",
                      FormatAsn1Time(not_before), " to ", FormatAsn1Time(not_after), ")");
}

// The certificate chain in `path`: at least one certificate, each valid now.
absl::StatusOr<std::vector<X509Ptr>> LoadCertificateChain(const std::string& path) {
  absl::StatusOr<std::string> pem = ReadPemFile(kCertFlag, path);
  if (!pem.ok()) return pem.status();
  std::vector<X509Ptr> chain = ParseCertificates(*pem);
  if (chain.empty()) return FlagError(kCertFlag, path, "holds no PEM certificate");
  for (const X509Ptr& cert : chain) {
    if (std::string problem = ValidityProblem(cert.get()); !problem.empty()) {
      return FlagError(kCertFlag, path, problem);
    }
  }
  return chain;
}

absl::StatusOr<PkeyPtr> LoadPrivateKey(const std::string& path) {
  absl::StatusOr<std::string> pem = ReadPemFile(kKeyFlag, path);
  if (!pem.ok()) return pem.status();
  BioPtr bio(BIO_new_mem_buf(pem->data(), static_cast<int>(pem->size())));
  PkeyPtr key(PEM_read_bio_PrivateKey(bio.get(), nullptr, NoPassphrase, nullptr));
  if (key == nullptr) {
    std::string why = TakeOpenSslError();
    return FlagError(kKeyFlag, path,
                     absl::StrCat("holds no unencrypted PEM private key",
                                  why.empty() ? "" : absl::StrCat(" (", why, ")")));
  }
  return key;
}

// A CA bundle needs one certificate valid now; expired ones beside it (an old
// CA kept during rotation) are harmless.
absl::Status CheckCaBundle(const std::string& path) {
  absl::StatusOr<std::string> pem = ReadPemFile(kCaFlag, path);
  if (!pem.ok()) return pem.status();
  std::vector<X509Ptr> certs = ParseCertificates(*pem);
  if (certs.empty()) return FlagError(kCaFlag, path, "holds no PEM certificate");
  std::string first_problem;
  for (const X509Ptr& cert : certs) {
    std::string problem = ValidityProblem(cert.get());
    if (problem.empty()) return absl::OkStatus();
    if (first_problem.empty()) first_problem = std::move(problem);
  }
  return FlagError(kCaFlag, path, absl::StrCat("no certificate valid now: ", first_problem));
}

absl::Status CheckIdentity(const TlsOptions& options) {
  absl::StatusOr<std::vector<X509Ptr>> chain = LoadCertificateChain(options.cert_file);
  if (!chain.ok()) return chain.status();
  absl::StatusOr<PkeyPtr> key = LoadPrivateKey(options.key_file);
  if (!key.ok()) return key.status();
  if (X509_check_private_key(chain->front().get(), key->get()) != 1) {
    ERR_clear_error();
    return FlagError(kKeyFlag, options.key_file,
                     absl::StrCat("private key does not match the certificate in ", kCertFlag, " ",
                                  options.cert_file));
  }
  return absl::OkStatus();
}

unsigned int ReloadSeconds(const TlsOptions& options) {
  return static_cast<unsigned int>(
      std::max<int64_t>(1, absl::ToInt64Seconds(options.reload_interval)));
}

}  // namespace

absl::Status CheckTlsFiles(const TlsOptions& options, bool need_identity) {
  if (!options.enabled()) return absl::OkStatus();
  if (options.reload_interval < absl::Seconds(1)) {
    return absl::InvalidArgumentError(absl::StrCat(kReloadFlag, ": must be at least 1s, got ",
                                                   absl::FormatDuration(options.reload_interval)));
  }
  if (options.cert_file.empty() != options.key_file.empty()) {
    return options.cert_file.empty()
               ? absl::InvalidArgumentError(absl::StrCat(kCertFlag, ": required with ", kKeyFlag))
               : absl::InvalidArgumentError(absl::StrCat(kKeyFlag, ": required with ", kCertFlag));
  }
  if (need_identity && options.cert_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(kCertFlag, " and ", kKeyFlag,
                                                   ": required to serve TLS (", kCaFlag,
                                                   " alone is not enough)"));
  }
  if (!need_identity && options.ca_file.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(kCaFlag, ": required to verify the server when TLS is on"));
  }
  if (!options.cert_file.empty()) {
    if (absl::Status status = CheckIdentity(options); !status.ok()) return status;
  }
  if (!options.ca_file.empty()) {
    if (absl::Status status = CheckCaBundle(options.ca_file); !status.ok()) return status;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsOptions& options, ClientCertPolicy policy) {
  if (!options.enabled()) return grpc::InsecureServerCredentials();
  if (absl::Status status = CheckTlsFiles(options, /*need_identity=*/true); !status.ok()) {
    return status;
  }
  if (options.ca_file.empty() && policy == ClientCertPolicy::kRequireAndVerify) {
    return absl::InvalidArgumentError(
        absl::StrCat(kCaFlag, ": required to verify the client certificates this server requires"));
  }
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      options.key_file, options.cert_file, options.ca_file, ReloadSeconds(options));
  grpc::experimental::TlsServerCredentialsOptions tls(provider);
  tls.watch_identity_key_cert_pairs();
  if (options.ca_file.empty()) {
    tls.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  } else {
    tls.watch_root_certs();
    tls.set_cert_request_type(policy == ClientCertPolicy::kRequireAndVerify
                                  ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                  : GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
  }
  std::shared_ptr<grpc::ServerCredentials> credentials =
      grpc::experimental::TlsServerCredentials(tls);
  if (credentials == nullptr) {
    return absl::InternalError("gRPC refused the TLS server credentials options");
  }
  return credentials;
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsOptions& options) {
  if (!options.enabled()) return grpc::InsecureChannelCredentials();
  if (absl::Status status = CheckTlsFiles(options, /*need_identity=*/false); !status.ok()) {
    return status;
  }
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      options.key_file, options.cert_file, options.ca_file, ReloadSeconds(options));
  grpc::experimental::TlsChannelCredentialsOptions tls;
  tls.set_certificate_provider(provider);
  tls.watch_root_certs();
  if (!options.cert_file.empty()) tls.watch_identity_key_cert_pairs();
  tls.set_verify_server_certs(true);
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::experimental::TlsCredentials(tls);
  if (credentials == nullptr) {
    return absl::InternalError("gRPC refused the TLS channel credentials options");
  }
  return credentials;
}

bool IsLoopbackAddress(absl::string_view host_port) {
  if (absl::StartsWith(host_port, "unix:") || absl::StartsWith(host_port, "unix-abstract:")) {
    return true;
  }
  absl::string_view host = host_port;
  if (absl::StartsWith(host, "[")) {
    size_t close = host.find(']');
    if (close == absl::string_view::npos) return false;
    host = host.substr(1, close - 1);
  } else if (std::count(host.begin(), host.end(), ':') == 1) {
    host = host.substr(0, host.find(':'));
  }
  if (host.empty()) return false;
  if (absl::EqualsIgnoreCase(host, "localhost")) return true;
  const std::string host_string(host);
  in_addr v4;
  if (inet_pton(AF_INET, host_string.c_str(), &v4) == 1) {
    return (ntohl(v4.s_addr) >> 24) == 127;
  }
  in6_addr v6;
  if (inet_pton(AF_INET6, host_string.c_str(), &v6) == 1) {
    if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
    return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;
  }
  return false;
}

std::optional<std::string> PeerCommonName(const grpc::AuthContext* auth_context) {
  if (auth_context == nullptr) return std::nullopt;
  std::vector<grpc::string_ref> names = auth_context->FindPropertyValues(kX509CommonNameProperty);
  if (names.empty()) return std::nullopt;
  return std::string(names.front().data(), names.front().size());
}

absl::StatusOr<std::string> CertificateCommonName(const std::string& cert_file) {
  absl::StatusOr<std::string> pem = ReadPemFile(kCertFlag, cert_file);
  if (!pem.ok()) return pem.status();
  std::vector<X509Ptr> chain = ParseCertificates(*pem);
  if (chain.empty()) return FlagError(kCertFlag, cert_file, "holds no PEM certificate");
  X509_NAME* subject = X509_get_subject_name(chain.front().get());
  const int length = subject == nullptr
                         ? -1
                         : X509_NAME_get_text_by_NID(subject, NID_commonName, nullptr, 0);
  if (length <= 0) return FlagError(kCertFlag, cert_file, "its certificate has no subject CN");
  std::string name(static_cast<size_t>(length) + 1, '\0');
  X509_NAME_get_text_by_NID(subject, NID_commonName, name.data(), length + 1);
  name.resize(static_cast<size_t>(length));
  return name;
}

grpc::Status CheckCallerAllowed(const grpc::ServerContextBase& context,
                                const std::vector<std::string>& allowed, absl::string_view flag) {
  if (allowed.empty()) return grpc::Status::OK;
  std::optional<std::string> name = PeerCommonName(context.auth_context().get());
  if (name && std::find(allowed.begin(), allowed.end(), *name) != allowed.end()) {
    return grpc::Status::OK;
  }
  return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                      absl::StrCat("caller ", name.value_or("without a certificate"),
                                   " is not in ", flag));
}

}  // namespace tessera

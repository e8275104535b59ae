// A throwaway PKI for TLS tests: one CA (EC P-256, self-signed) that issues
// leaf certificates usable as both server and client certificates on
// loopback, written as PEM files the daemons' --tls_* flags can point at.
// Built with OpenSSL 3's C API, so tests need no `openssl` binary.
//
// Thread safety: Issue() may not run concurrently on one TestPki; copies
// share the CA key and are otherwise independent.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

typedef struct evp_pkey_st EVP_PKEY;
typedef struct x509_st X509;

namespace tessera::testing {

struct PemFiles {
  std::string cert_file, key_file;
};

class TestPki {
 public:
  // Makes `dir` if needed and writes the CA there as <ca_name>.crt (and its
  // key as <ca_name>.key). Valid from now-1h to now+30d.
  static absl::StatusOr<TestPki> Create(const std::string& dir,
                                        const std::string& ca_name = "tessera-test-ca");

  // The PEM file holding the CA certificate (for --tls_ca).
  const std::string& ca_file() const { return ca_file_; }

  // A leaf signed by this CA, written to <dir>/<name>.crt and <dir>/<name>.key
  // (0600), replacing files of that name. Subject CN = common_name; SAN
  // DNS:localhost, IP:127.0.0.1, IP:::1; EKU serverAuth and clientAuth; valid
  // from not_before to not_after (an expired certificate:
  // Issue("x", "x", now - 2d, now - 1d)).
  absl::StatusOr<PemFiles> Issue(const std::string& name, const std::string& common_name,
                                 absl::Time not_before = absl::Now() - absl::Hours(1),
                                 absl::Time not_after = absl::Now() + absl::Hours(24));

 private:
  TestPki(std::string dir, std::string ca_file, std::shared_ptr<EVP_PKEY> ca_key,
          std::shared_ptr<X509> ca_cert);

  std::string dir_;
  std::string ca_file_;
  std::shared_ptr<EVP_PKEY> ca_key_;
  std::shared_ptr<X509> ca_cert_;
};

}  // namespace tessera::testing

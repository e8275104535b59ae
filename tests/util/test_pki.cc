#include "tests/util/test_pki.h"

#include <openssl/bn.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>

#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tessera::testing {
namespace {

struct BioDeleter {
  void operator()(BIO* bio) const { BIO_free(bio); }
};
using BioPtr = std::unique_ptr<BIO, BioDeleter>;

absl::Status OpenSslError(absl::string_view what) {
  unsigned long code = ERR_get_error();
  char buffer[256] = "unknown error";
  if (code != 0) ERR_error_string_n(code, buffer, sizeof(buffer));
  ERR_clear_error();
  return absl::InternalError(absl::StrCat(what, ": ", buffer));
}

std::shared_ptr<EVP_PKEY> NewKey() {
  return std::shared_ptr<EVP_PKEY>(EVP_EC_gen("P-256"), EVP_PKEY_free);
}

absl::Status AddExtension(X509* cert, X509V3_CTX* ctx, int nid, const char* value) {
  X509_EXTENSION* extension = X509V3_EXT_conf_nid(nullptr, ctx, nid, value);
  if (extension == nullptr) return OpenSslError(absl::StrCat("extension ", OBJ_nid2sn(nid)));
  int added = X509_add_ext(cert, extension, -1);
  X509_EXTENSION_free(extension);
  if (added != 1) return OpenSslError(absl::StrCat("adding extension ", OBJ_nid2sn(nid)));
  return absl::OkStatus();
}

// A certificate for `key` named `common_name`, signed by `issuer_key`
// (issuer == nullptr: self-signed), with `extensions` (nid, value) in order.
absl::StatusOr<std::shared_ptr<X509>> MakeCertificate(
    EVP_PKEY* key, const std::string& common_name, X509* issuer, EVP_PKEY* issuer_key,
    absl::Time not_before, absl::Time not_after,
    const std::vector<std::pair<int, const char*>>& extensions) {
  std::shared_ptr<X509> cert(X509_new(), X509_free);
  if (cert == nullptr) return OpenSslError("X509_new");
  X509* x = cert.get();
  X509_set_version(x, X509_VERSION_3);

  unsigned char serial_bytes[16];
  if (RAND_bytes(serial_bytes, sizeof(serial_bytes)) != 1) return OpenSslError("RAND_bytes");
  serial_bytes[0] &= 0x7f;  // Positive.
  BIGNUM* serial = BN_bin2bn(serial_bytes, sizeof(serial_bytes), nullptr);
  BN_to_ASN1_INTEGER(serial, X509_get_serialNumber(x));
  BN_free(serial);

  ASN1_TIME_set(X509_getm_notBefore(x), absl::ToTimeT(not_before));
  ASN1_TIME_set(X509_getm_notAfter(x), absl::ToTimeT(not_after));

  X509_NAME* name = X509_get_subject_name(x);
  X509_NAME_add_entry_by_txt(name, "O", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>("Tessera tests"), -1, -1, 0);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_UTF8,
                             reinterpret_cast<const unsigned char*>(common_name.c_str()), -1, -1,
                             0);
  X509_set_issuer_name(x, issuer != nullptr ? X509_get_subject_name(issuer) : name);
  if (X509_set_pubkey(x, key) != 1) return OpenSslError("X509_set_pubkey");

  X509V3_CTX ctx;
  X509V3_set_ctx(&ctx, issuer != nullptr ? issuer : x, x, nullptr, nullptr, 0);
  for (const auto& [nid, value] : extensions) {
    if (absl::Status status = AddExtension(x, &ctx, nid, value); !status.ok()) return status;
  }
  if (X509_sign(x, issuer_key, EVP_sha256()) == 0) return OpenSslError("X509_sign");
  return cert;
}

// Writes `path` whole (0600 for keys), through a temporary file and a rename,
// so a process watching `path` never reads half of it.
absl::Status WritePem(const std::string& path, bool secret, const std::function<int(BIO*)>& write) {
  BioPtr bio(BIO_new(BIO_s_mem()));
  if (write(bio.get()) != 1) return OpenSslError(absl::StrCat("PEM for ", path));
  char* data = nullptr;
  long size = BIO_get_mem_data(bio.get(), &data);
  const std::string temp = absl::StrCat(path, ".tmp");
  FILE* file = std::fopen(temp.c_str(), "wb");
  if (file == nullptr) return absl::InternalError(absl::StrCat("cannot create ", temp));
  if (secret) ::fchmod(fileno(file), 0600);
  bool written = std::fwrite(data, 1, static_cast<size_t>(size), file) == static_cast<size_t>(size);
  written = std::fclose(file) == 0 && written;
  if (!written) return absl::InternalError(absl::StrCat("cannot write ", temp));
  std::error_code error;
  std::filesystem::rename(temp, path, error);
  if (error) return absl::InternalError(absl::StrCat("rename ", temp, ": ", error.message()));
  return absl::OkStatus();
}

absl::Status WriteCertificate(const std::string& path, X509* cert) {
  return WritePem(path, false, [cert](BIO* bio) { return PEM_write_bio_X509(bio, cert); });
}

absl::Status WriteKey(const std::string& path, EVP_PKEY* key) {
  return WritePem(path, true, [key](BIO* bio) {
    return PEM_write_bio_PrivateKey(bio, key, nullptr, nullptr, 0, nullptr, nullptr);
  });
}

}  // namespace

TestPki::TestPki(std::string dir, std::string ca_file, std::shared_ptr<EVP_PKEY> ca_key,
                 std::shared_ptr<X509> ca_cert)
    : dir_(std::move(dir)),
      ca_file_(std::move(ca_file)),
      ca_key_(std::move(ca_key)),
      ca_cert_(std::move(ca_cert)) {}

absl::StatusOr<TestPki> TestPki::Create(const std::string& dir, const std::string& ca_name) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) return absl::InternalError(absl::StrCat("mkdir ", dir, ": ", error.message()));
  std::shared_ptr<EVP_PKEY> key = NewKey();
  if (key == nullptr) return OpenSslError("EC P-256 key");
  const absl::Time now = absl::Now();
  absl::StatusOr<std::shared_ptr<X509>> cert =
      MakeCertificate(key.get(), ca_name, /*issuer=*/nullptr, key.get(), now - absl::Hours(1),
                      now + absl::Hours(24 * 30),
                      {{NID_basic_constraints, "critical,CA:TRUE"},
                       {NID_key_usage, "critical,keyCertSign,cRLSign"},
                       {NID_subject_key_identifier, "hash"},
                       {NID_authority_key_identifier, "keyid:always"}});
  if (!cert.ok()) return cert.status();
  const std::string base = (std::filesystem::path(dir) / ca_name).string();
  const std::string ca_file = base + ".crt";
  if (absl::Status status = WriteCertificate(ca_file, cert->get()); !status.ok()) return status;
  if (absl::Status status = WriteKey(base + ".key", key.get()); !status.ok()) return status;
  return TestPki(dir, ca_file, std::move(key), *std::move(cert));
}

absl::StatusOr<PemFiles> TestPki::Issue(const std::string& name, const std::string& common_name,
                                        absl::Time not_before, absl::Time not_after) {
  std::shared_ptr<EVP_PKEY> key = NewKey();
  if (key == nullptr) return OpenSslError("EC P-256 key");
  absl::StatusOr<std::shared_ptr<X509>> cert =
      MakeCertificate(key.get(), common_name, ca_cert_.get(), ca_key_.get(), not_before, not_after,
                      {{NID_basic_constraints, "critical,CA:FALSE"},
                       {NID_key_usage, "critical,digitalSignature"},
                       {NID_ext_key_usage, "serverAuth,clientAuth"},
                       {NID_subject_alt_name, "DNS:localhost,IP:127.0.0.1,IP:::1"},
                       {NID_subject_key_identifier, "hash"},
                       {NID_authority_key_identifier, "keyid:always"}});
  if (!cert.ok()) return cert.status();
  const std::string base = (std::filesystem::path(dir_) / name).string();
  PemFiles files{.cert_file = base + ".crt", .key_file = base + ".key"};
  if (absl::Status status = WriteCertificate(files.cert_file, cert->get()); !status.ok()) {
    return status;
  }
  if (absl::Status status = WriteKey(files.key_file, key.get()); !status.ok()) return status;
  return files;
}

}  // namespace tessera::testing

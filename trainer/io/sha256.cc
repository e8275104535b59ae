#include "trainer/io/sha256.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <openssl/sha.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/read_file.h"

namespace tessera::trainer {
namespace {

constexpr size_t kReadChunkBytes = 1 << 20;

struct EvpMdCtxDeleter {
  void operator()(EVP_MD_CTX* ctx) const { EVP_MD_CTX_free(ctx); }
};
using EvpMdCtxPtr = std::unique_ptr<EVP_MD_CTX, EvpMdCtxDeleter>;

EvpMdCtxPtr NewSha256Context() {
  EvpMdCtxPtr ctx(EVP_MD_CTX_new());
  // Allocation or initialization of a built-in digest fails only when the
  // process is out of memory.
  if (ctx == nullptr || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1) {
    return nullptr;
  }
  return ctx;
}

std::string FinishHex(EVP_MD_CTX* ctx) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_DigestFinal_ex(ctx, digest, &length);
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(digest), length));
}

}  // namespace

absl::StatusOr<std::string> Sha256File(const std::string& path) {
  EvpMdCtxPtr ctx = NewSha256Context();
  if (ctx == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat(path, ": cannot create a SHA-256 context"));
  }
  absl::Status read = ReadFileChunks(path, kReadChunkBytes, [&](const char* data, size_t size) {
    EVP_DigestUpdate(ctx.get(), data, size);
  });
  if (!read.ok()) return read;
  return FinishHex(ctx.get());
}

std::string Sha256Hex(std::string_view bytes) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), digest);
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(digest), sizeof(digest)));
}

absl::StatusOr<Sha256Hasher> Sha256Hasher::Create() {
  EvpMdCtxPtr ctx = NewSha256Context();
  if (ctx == nullptr) return absl::ResourceExhaustedError("cannot create a SHA-256 context");
  return Sha256Hasher(ctx.release());
}

Sha256Hasher::Sha256Hasher(Sha256Hasher&& other) noexcept : ctx_(other.ctx_) {
  other.ctx_ = nullptr;
}

Sha256Hasher& Sha256Hasher::operator=(Sha256Hasher&& other) noexcept {
  if (this != &other) {
    EVP_MD_CTX_free(static_cast<EVP_MD_CTX*>(ctx_));
    ctx_ = other.ctx_;
    other.ctx_ = nullptr;
  }
  return *this;
}

Sha256Hasher::~Sha256Hasher() { EVP_MD_CTX_free(static_cast<EVP_MD_CTX*>(ctx_)); }

void Sha256Hasher::Update(const void* data, size_t size) {
  EVP_DigestUpdate(static_cast<EVP_MD_CTX*>(ctx_), data, size);
}

std::string Sha256Hasher::HexDigest() { return FinishHex(static_cast<EVP_MD_CTX*>(ctx_)); }

}  // namespace tessera::trainer

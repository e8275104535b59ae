// SHA-256 digests of checkpoint shard files and byte strings, as lower-case
// hex. The manifest of every checkpoint records one per shard so that a
// resuming trainer can tell a complete checkpoint from a torn or corrupted one.
// Files are hashed in bounded chunks: shards can be many gigabytes.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace tessera::trainer {

// Lower-case hex SHA-256 of the contents of the file at `path`, read in chunks.
// NOT_FOUND when the file does not exist, other codes for read errors; the
// message names the path.
absl::StatusOr<std::string> Sha256File(const std::string& path);

// Lower-case hex SHA-256 of `bytes`.
std::string Sha256Hex(std::string_view bytes);

// Incremental SHA-256, for hashing bytes as they are written.
class Sha256Hasher {
 public:
  // RESOURCE_EXHAUSTED when OpenSSL cannot allocate a context.
  static absl::StatusOr<Sha256Hasher> Create();
  Sha256Hasher(Sha256Hasher&&) noexcept;
  Sha256Hasher& operator=(Sha256Hasher&&) noexcept;
  ~Sha256Hasher();

  void Update(const void* data, size_t size);
  // Lower-case hex digest of everything passed to Update; the hasher is spent.
  std::string HexDigest();

 private:
  explicit Sha256Hasher(void* ctx) : ctx_(ctx) {}
  void* ctx_;  // EVP_MD_CTX*
};

}  // namespace tessera::trainer

// XXH3-128 digests (libxxhash) of checkpoint shard files and byte strings, as 32 lower-case hex
// characters (the canonical big-endian form xxhsum prints). Checkpoint manifests record one per
// shard so that a resuming trainer tells a complete checkpoint from a torn or corrupted one:
// XXH3 is not cryptographic, but any change of a file's bytes (a flipped bit, a torn or
// truncated write) changes its 128-bit digest, and it runs at memory speed (tens of GB/s on one
// core, where SHA-256 managed about 2), so hashing while writing and verifying while reading
// no longer bound checkpoint I/O. Manifests written before it hold SHA-256 (trainer/io/sha256.h)
// instead. The worker's shard cache (worker/shard_cache.h) checks the copies it keeps with it.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

struct XXH3_state_s;

namespace tessera {

// Hex XXH3-128 of the contents of the file at `path`, read in chunks. NOT_FOUND when the file
// does not exist, other codes for read errors; the message names the path.
absl::StatusOr<std::string> Xxh3File(const std::string& path);

// Hex XXH3-128 of `bytes`.
std::string Xxh3Hex(std::string_view bytes);

// Incremental XXH3-128, for hashing bytes as they are written.
class Xxh3Hasher {
 public:
  // RESOURCE_EXHAUSTED when the state cannot be allocated.
  static absl::StatusOr<Xxh3Hasher> Create();
  Xxh3Hasher(Xxh3Hasher&&) noexcept;
  Xxh3Hasher& operator=(Xxh3Hasher&&) noexcept;
  ~Xxh3Hasher();

  void Update(const void* data, size_t size);
  // Hex digest of everything passed to Update so far.
  std::string HexDigest() const;

 private:
  explicit Xxh3Hasher(XXH3_state_s* state) : state_(state) {}
  XXH3_state_s* state_;
};

}  // namespace tessera

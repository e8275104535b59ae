// SHA-256 digests of checkpoint shard files and byte strings, as lower-case
// hex. The manifest of every checkpoint records one per shard so that a
// resuming trainer can tell a complete checkpoint from a torn or corrupted one.
// Files are hashed in bounded chunks: shards can be many gigabytes.
#pragma once

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

}  // namespace tessera::trainer

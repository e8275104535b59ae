// Reading whole files in chunks, and telling when a file changed, with errors that name the file.
#pragma once

#include <cstddef>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tessera {

// Calls `consume` with successive chunks (at most `chunk_bytes` each) of the
// file at `path` until its end. NOT_FOUND and friends name the path
// (ErrnoToStatus).
absl::Status ReadFileChunks(const std::string& path, size_t chunk_bytes,
                            const std::function<void(const char* data, size_t size)>& consume);

// The whole file at `path` (errors as ReadFileChunks).
absl::StatusOr<std::string> ReadWholeFile(const std::string& path);

// The identity of the file at `path` as it is now: inode, size and modification time. A
// Kubernetes Secret or ConfigMap update swaps a symlink, an editor rewrites in place; either
// changes it, so a daemon re-reads a configuration file only when its identity changed. Errors
// as ErrnoToStatus, naming the path.
absl::StatusOr<std::string> FileIdentity(const std::string& path);

}  // namespace tessera

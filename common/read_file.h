// Reading whole files in chunks, with errors that name the file.
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

}  // namespace tessera

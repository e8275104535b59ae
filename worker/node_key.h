// The node key: a random secret a worker keeps in its work directory
// (node.key, mode 0600) and presents with every call to the coordinator. The
// coordinator binds the node id to the first key it sees, so that while the
// node is alive no other worker can register under its name or speak for it;
// a worker restarted on the same node (same work directory) keeps its key.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace tessera::worker {

// File name of the key inside the work directory.
inline constexpr char kNodeKeyFile[] = "node.key";

// Reads `<work_dir>/node.key`, creating it (32 random bytes as hex, 0600,
// created exclusively so two workers racing agree) when missing.
// FAILED_PRECONDITION when the file exists but is not a key, or is readable
// by others.
absl::StatusOr<std::string> LoadOrCreateNodeKey(const std::string& work_dir);

}  // namespace tessera::worker

// The trainer's end of its worker's local shard cache socket (worker/shard_cache.h,
// proto/tessera/v1/shard_cache.proto): hands a checkpoint shard to the worker's memory and asks
// for one on resume. Frames (common/socket_frames.h) hold the serialized messages; a sealed memory
// file (common/sealed_memory.h) holding the shard is passed beside a put's request and beside a
// found get's response, so neither end copies the bytes through the socket: the worker keeps the
// trainer's file, and the trainer maps the worker's. One
// connection per call, so calls from several threads never interleave. Plain C++: no gRPC, no
// LibTorch.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/sealed_memory.h"
#include "tessera/v1/shard_cache.pb.h"

namespace tessera::trainer {

// Default limit of one call (a get may wait for a peer worker's copy to cross the network).
inline constexpr absl::Duration kShardCacheCallTimeout = absl::Seconds(60);

// Stores `bytes` under `header` in the worker's cache (the worker keeps the memory file itself),
// which copies it to `replica_address` (empty: no copy) in the background. The worker's error
// (its code and message), or UNAVAILABLE naming the socket when the worker cannot be reached.
absl::Status PutShardInCache(const std::string& socket_path, const v1::ShardHeader& header,
                             const SealedMemory& bytes, const std::string& replica_address,
                             absl::Duration timeout = kShardCacheCallTimeout);

struct CachedShardCopy {
  v1::ShardHeader header;
  // The worker's memory file, mapped read-only (its pages are the worker's, shared).
  SealedMemory bytes;
  v1::ShardSource source = v1::SHARD_SOURCE_UNSPECIFIED;
  // The worker checked that the bytes hash to header.xxh3_128 (ShardCacheResponse.verified).
  bool verified = false;
};

// Fetches the shard `key` with digest `xxh3_128` (empty: any) from the worker's memory, or from
// the workers in `peers` through it. NOT_FOUND when none holds it; the worker's other errors as
// it gives them (DATA_LOSS when its copy does not hash to its digest); UNAVAILABLE naming the
// socket when the worker cannot be reached. The bytes are not hashed here: `verified` says
// whether the worker did.
absl::StatusOr<CachedShardCopy> GetShardFromCache(const std::string& socket_path,
                                                  const v1::ShardKey& key,
                                                  const std::string& xxh3_128,
                                                  const std::vector<std::string>& peers,
                                                  absl::Duration timeout = kShardCacheCallTimeout);

}  // namespace tessera::trainer

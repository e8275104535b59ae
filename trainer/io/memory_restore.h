// Recovery from peers' memory, the trainer's part (worker/shard_cache.h holds the worker's): after
// a checkpoint's shard is written, the rank reads it once into a sealed memory file and hands
// that file to its worker (which keeps it, and copies it to a peer node's worker); on resume,
// before reading the checkpoint from storage, every rank asks its worker for every shard of it,
// from memory (the worker passes its sealed memory file, so the rank maps the bytes without
// copying them), and keeps a shard only when its XXH3-128 is the manifest's on storage (the
// checkpoint of record). The worker hashes each copy it serves once, for all of its node's
// ranks (its files are sealed, so the answer holds); the rank takes the worker's word for it
// (the worker launched it and holds its shards anyway) and hashes only copies the worker did not
// check. The ranks agree (trainer/engine/checkpointing.cc) to load from memory only when every
// rank got every shard.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/sealed_memory.h"
#include "tessera/v1/checkpoint.pb.h"
#include "tessera/v1/shard_cache.pb.h"
#include "tessera/v1/trainer.pb.h"

namespace tessera::trainer {

// The bytes of the shard this rank just wrote at `path` (in the page cache), read once into a
// sealed memory file before the commit renames the staging directory. Empty (no descriptor) when
// the task has no shard cache.
absl::StatusOr<SealedMemory> ReadShardForCache(const v1::TrainerTask& task,
                                               const std::string& path);

// Hands the shard of `rank` at `step` (file `file_name`, digest `xxh3_128`) to the worker's cache
// (TrainerTask.shard_cache_socket), to be copied to shard_replica_address. A no-op without a
// cache or with empty `bytes`.
absl::Status HandShardToCache(const v1::TrainerTask& task, int64_t step, int rank,
                              const std::string& file_name, const std::string& xxh3_128,
                              const SealedMemory& bytes);

// A checkpoint's shards fetched from memory: the workers' sealed memory files, mapped read-only
// into this process (common/sealed_memory.h), so nothing was copied to get them here.
struct MemoryCheckpointCopy {
  // One per shard of the manifest, in its order.
  std::vector<SealedMemory> shards;
  int shards_from_peers = 0;
  // Wall time of all the fetches (checks included), and the time this rank's own digest checks
  // took, summed over the shards (they run several at once, beside other fetches; 0 when the
  // worker had checked every copy).
  double fetch_seconds = 0;
  double verify_seconds = 0;

  // Paths that open each shard in this process (/proc/self/fd/<fd>), in the manifest's order:
  // what ShardedCheckpointReader::OpenShardPaths reads, as long as this copy lives.
  std::vector<std::string> ShardPaths() const;
};

// Fetches every shard `manifest` lists through the task's shard cache (this worker's memory,
// else the workers of shard_cache_peers), several at once, checking each against the manifest's
// size and XXH3-128 (the worker's check counts). NOT_FOUND (the worker's message) when some shard
// is held by no one;
// DATA_LOSS naming the shard when a copy does not match the manifest; UNAVAILABLE when the worker
// cannot be reached; FAILED_PRECONDITION when the manifest has no XXH3-128 digests (written
// before them) or the task has no cache. The first error in the manifest's order wins.
absl::StatusOr<MemoryCheckpointCopy> FetchCheckpointFromMemory(
    const v1::TrainerTask& task, const v1::CheckpointManifest& manifest);

}  // namespace tessera::trainer

#include "trainer/io/memory_restore.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/read_file.h"
#include "common/status_macros.h"
#include "trainer/io/shard_cache_client.h"
#include "trainer/io/xxh3.h"

namespace tessera::trainer {

absl::StatusOr<std::string> ReadShardForCache(const v1::TrainerTask& task,
                                              const std::string& path) {
  if (task.shard_cache_socket().empty()) return std::string();
  return ReadWholeFile(path);
}

absl::Status HandShardToCache(const v1::TrainerTask& task, int64_t step, int rank,
                              const std::string& file_name, const std::string& xxh3_128,
                              const std::string& bytes) {
  if (task.shard_cache_socket().empty() || bytes.empty()) return absl::OkStatus();
  v1::ShardHeader header;
  header.mutable_key()->set_job_id(task.job_id());
  header.mutable_key()->set_step(step);
  header.mutable_key()->set_rank(rank);
  header.set_attempt(task.attempt());
  header.set_file_name(file_name);
  header.set_xxh3_128(xxh3_128);
  header.set_size_bytes(static_cast<int64_t>(bytes.size()));
  return PutShardInCache(task.shard_cache_socket(), header, bytes, task.shard_replica_address());
}

MemoryCheckpointCopy::MemoryCheckpointCopy(MemoryCheckpointCopy&& other) noexcept
    : shards_from_peers(other.shards_from_peers), dir_(std::exchange(other.dir_, "")) {}

MemoryCheckpointCopy& MemoryCheckpointCopy::operator=(MemoryCheckpointCopy&& other) noexcept {
  if (this != &other) {
    MemoryCheckpointCopy old(std::move(*this));
    dir_ = std::exchange(other.dir_, "");
    shards_from_peers = other.shards_from_peers;
  }
  return *this;
}

MemoryCheckpointCopy::~MemoryCheckpointCopy() {
  if (dir_.empty()) return;
  std::error_code ignored;  // a leftover directory in tmpfs is harmless; nothing to report to
  std::filesystem::remove_all(dir_, ignored);
}

absl::StatusOr<MemoryCheckpointCopy> FetchCheckpointFromMemory(
    const v1::TrainerTask& task, const v1::CheckpointManifest& manifest, int rank) {
  if (task.shard_cache_socket().empty()) {
    return absl::FailedPreconditionError("no shard cache (TrainerTask.shard_cache_socket)");
  }
  std::filesystem::path root = kMemoryRestoreRoot;
  std::error_code error;
  if (!std::filesystem::is_directory(root, error)) root = std::filesystem::temp_directory_path();
  MemoryCheckpointCopy copy((root / absl::StrCat("tessera-restore-", task.job_id(), "-rank", rank,
                                                 "-pid", getpid()))
                                .string());
  std::filesystem::remove_all(copy.dir(), error);
  if (!std::filesystem::create_directories(copy.dir(), error)) {
    return absl::InternalError(absl::StrCat(copy.dir(), ": ", error.message()));
  }
  const std::vector<std::string> peers(task.shard_cache_peers().begin(),
                                       task.shard_cache_peers().end());
  for (const v1::CheckpointShard& shard : manifest.shards()) {
    if (shard.xxh3_128().empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat(shard.file(), ": the manifest records no xxh3-128 digest"));
    }
    v1::ShardKey key;
    key.set_job_id(task.job_id());
    key.set_step(manifest.step());
    key.set_rank(shard.rank());
    ASSIGN_OR_RETURN(CachedShardCopy fetched,
                     GetShardFromCache(task.shard_cache_socket(), key, shard.xxh3_128(), peers));
    // The worker's word is not enough: the bytes must be those the manifest on storage lists.
    if (static_cast<int64_t>(fetched.bytes.size()) != shard.size_bytes() ||
        Xxh3Hex(fetched.bytes) != shard.xxh3_128() || fetched.header.file_name() != shard.file()) {
      return absl::DataLossError(absl::StrCat(
          "memory copy of ", shard.file(), " (step ", manifest.step(), ", ",
          fetched.bytes.size(), " bytes, file ", fetched.header.file_name(),
          ") does not match the manifest (", shard.size_bytes(), " bytes, xxh3-128 ",
          shard.xxh3_128(), ")"));
    }
    if (fetched.source == v1::SHARD_SOURCE_PEER) ++copy.shards_from_peers;
    const std::string path = absl::StrCat(copy.dir(), "/", shard.file());
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(fetched.bytes.data(), static_cast<std::streamsize>(fetched.bytes.size()));
    out.close();
    if (!out) return absl::InternalError(absl::StrCat(path, ": cannot write"));
  }
  return copy;
}

}  // namespace tessera::trainer

#include "trainer/io/memory_restore.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/errno_status.h"
#include "common/scoped_fd.h"
#include "common/status_macros.h"
#include "common/xxh3.h"
#include "trainer/io/shard_cache_client.h"

namespace tessera::trainer {

absl::StatusOr<SealedMemory> ReadShardForCache(const v1::TrainerTask& task,
                                               const std::string& path) {
  if (task.shard_cache_socket().empty()) return SealedMemory();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoToStatus(errno, path);
  ScopedFd file(fd);
  struct stat info {};
  if (::fstat(file.get(), &info) != 0) return ErrnoToStatus(errno, path);
  absl::StatusOr<SealedMemory> copy =
      SealedMemory::CopyOfFile("tessera-shard", file.get(), static_cast<size_t>(info.st_size));
  if (!copy.ok()) {
    return absl::Status(copy.status().code(), absl::StrCat(path, ": ", copy.status().message()));
  }
  return copy;
}

absl::Status HandShardToCache(const v1::TrainerTask& task, int64_t step, int rank,
                              const std::string& file_name, const std::string& xxh3_128,
                              const SealedMemory& bytes) {
  if (task.shard_cache_socket().empty() || bytes.size() == 0) return absl::OkStatus();
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

std::vector<std::string> MemoryCheckpointCopy::ShardPaths() const {
  std::vector<std::string> paths;
  paths.reserve(shards.size());
  for (const SealedMemory& shard : shards) paths.push_back(shard.ProcPath());
  return paths;
}

namespace {

// Shards fetched and checked at once: each fetch waits on the worker (and for a peer's copy on
// the network) and each check hashes at memory speed, so a few in flight hide both.
int FetchParallelism(int shards) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::clamp(cores, 1, std::max(1, std::min(shards, 8)));
}

struct FetchedShard {
  absl::Status status;
  SealedMemory bytes;
  bool from_peer = false;
  double verify_seconds = 0;
};

// Fetches one shard and checks it against the manifest's record of it.
FetchedShard FetchOne(const v1::TrainerTask& task, const v1::CheckpointShard& shard, int64_t step,
                      const std::vector<std::string>& peers) {
  FetchedShard out;
  v1::ShardKey key;
  key.set_job_id(task.job_id());
  key.set_step(step);
  key.set_rank(shard.rank());
  absl::StatusOr<CachedShardCopy> fetched =
      GetShardFromCache(task.shard_cache_socket(), key, shard.xxh3_128(), peers);
  if (!fetched.ok()) {
    out.status = fetched.status();
    return out;
  }
  // The bytes must be those the manifest on storage lists. The worker hashed them when it says so
  // (once for all of the node's ranks; its memory files are sealed); otherwise this rank does.
  bool hash_matches = fetched->verified && fetched->header.xxh3_128() == shard.xxh3_128();
  if (!hash_matches) {
    const auto verify_start = std::chrono::steady_clock::now();
    hash_matches = Xxh3Hex(fetched->bytes.view()) == shard.xxh3_128();
    out.verify_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - verify_start).count();
  }
  if (static_cast<int64_t>(fetched->bytes.size()) != shard.size_bytes() ||
      fetched->header.file_name() != shard.file() || !hash_matches) {
    out.status = absl::DataLossError(absl::StrCat(
        "memory copy of ", shard.file(), " (step ", step, ", ", fetched->bytes.size(),
        " bytes, file ", fetched->header.file_name(), ") does not match the manifest (",
        shard.size_bytes(), " bytes, xxh3-128 ", shard.xxh3_128(), ")"));
    return out;
  }
  out.from_peer = fetched->source == v1::SHARD_SOURCE_PEER;
  out.bytes = std::move(fetched->bytes);
  return out;
}

}  // namespace

absl::StatusOr<MemoryCheckpointCopy> FetchCheckpointFromMemory(
    const v1::TrainerTask& task, const v1::CheckpointManifest& manifest) {
  if (task.shard_cache_socket().empty()) {
    return absl::FailedPreconditionError("no shard cache (TrainerTask.shard_cache_socket)");
  }
  for (const v1::CheckpointShard& shard : manifest.shards()) {
    if (shard.xxh3_128().empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat(shard.file(), ": the manifest records no xxh3-128 digest"));
    }
  }
  const auto start = std::chrono::steady_clock::now();
  const std::vector<std::string> peers(task.shard_cache_peers().begin(),
                                       task.shard_cache_peers().end());
  const int count = manifest.shards_size();
  std::vector<FetchedShard> fetched(static_cast<size_t>(count));
  std::atomic<int> next{0};
  std::atomic<bool> failed{false};
  auto work = [&] {
    // After a failure the copy is useless: the rest are not fetched.
    for (int i = next++; i < count && !failed.load(); i = next++) {
      fetched[i] = FetchOne(task, manifest.shards(i), manifest.step(), peers);
      if (!fetched[i].status.ok()) failed = true;
    }
  };
  std::vector<std::thread> threads;
  for (int t = 1; t < FetchParallelism(count); ++t) threads.emplace_back(work);
  work();
  for (std::thread& thread : threads) thread.join();

  MemoryCheckpointCopy copy;
  copy.fetch_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (FetchedShard& shard : fetched) {
    RETURN_IF_ERROR(shard.status);
    if (shard.from_peer) ++copy.shards_from_peers;
    copy.verify_seconds += shard.verify_seconds;
    copy.shards.push_back(std::move(shard.bytes));
  }
  return copy;
}

}  // namespace tessera::trainer

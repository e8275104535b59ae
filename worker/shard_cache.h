// The worker's checkpoint shard cache (recovery from peers' memory, proto/tessera/v1/
// shard_cache.proto). Trainer processes die on a restart; their worker does not, so it keeps in
// its memory the shards its trainers wrote last and a copy of the shards of a peer node's
// trainers. A restarted attempt asks its worker for every shard of the checkpoint it resumes;
// the worker answers from its memory or from the peers the trainer names. The worker serves a
// copy only after hashing it (once per copy: its memory files are sealed, so the answer holds),
// and the trainer uses what it gets only when that digest is the manifest's on storage, which
// stays the checkpoint of record: nothing here is trusted beyond being a fast copy.
//
//   ShardCacheStore      the shards in memory: per job the two newest steps (a step's shards
//                        arrive before its manifest is committed, so the previous, committed step
//                        is kept until the next one is), under a byte cap that evicts the jobs
//                        put into least recently.
//   ShardCacheService    the ShardCache gRPC service over a store, for peer workers.
//   ShardCachePeers      the client side: replicates puts to a peer (a thread of its own, a
//                        bounded queue) and fetches from peers, each call with a deadline.
//   LocalShardCacheServer the Unix socket the worker's trainers use (they link no gRPC): one
//                        length-prefixed ShardCacheRequest and one ShardCacheResponse; the sealed
//                        memory file holding the shard (common/sealed_memory.h) passes beside a
//                        put's request (the worker keeps the trainer's file) and beside a found
//                        get's response (the trainer maps the worker's pages): nothing is copied
//                        through the socket. A shard a get fetched from a peer is kept too, so the
//                        node's other ranks find it here.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/call_once.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/sealed_memory.h"
#include "grpcpp/grpcpp.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"
#include "tessera/v1/shard_cache.grpc.pb.h"
#include "tessera/v1/trainer.pb.h"

namespace tessera::worker {

// One shard in memory, in a sealed memory file. Immutable once stored, so readers share it
// without the store's lock.
struct CachedShard {
  // OK when the bytes' XXH3-128 is header.xxh3_128, else DATA_LOSS naming the shard. Hashes on
  // the first call only (the bytes are sealed, so the answer holds for the shard's life); callers
  // meanwhile, such as a node's ranks asking for the same shard at once, wait for that one hash.
  absl::Status Verify() const;
  // Verify's answer from a digest computed elsewhere (the bytes hashed as they arrived), unless
  // Verify already gave one.
  void SetDigest(const std::string& xxh3_128) const;

  v1::ShardHeader header;
  SealedMemory bytes;

  struct DigestCheck {
    absl::once_flag once;
    absl::Status status;
  };
  // Verify's answer, once there is one.
  std::unique_ptr<DigestCheck> digest_check = std::make_unique<DigestCheck>();

 private:
  // OK when `digest` is header.xxh3_128, else DATA_LOSS naming the shard and both digests.
  absl::Status DigestStatus(const std::string& digest) const;
};

// Thread safety: every method may be called from any thread (one absl::Mutex).
class ShardCacheStore {
 public:
  // `capacity_bytes`: the most shard bytes held over all jobs.
  explicit ShardCacheStore(int64_t capacity_bytes) : capacity_bytes_(capacity_bytes) {}

  // Stores a shard, replacing one with the same key. Steps of the job older than the two newest
  // are dropped; then, while over the cap, whole other jobs (least recently put into first) and
  // then this job's older step. INVALID_ARGUMENT naming the header field that is missing
  // (key.job_id, key.step < 0, key.rank < 0, xxh3_128), or when size_bytes is not the bytes'
  // size; RESOURCE_EXHAUSTED when the shard alone exceeds the cap.
  absl::Status Put(v1::ShardHeader header, SealedMemory bytes);
  // Put of a copy of `bytes`.
  absl::Status Put(v1::ShardHeader header, std::string_view bytes);
  // Put of a shard made elsewhere (one whose digest may have been checked already).
  absl::Status Put(std::shared_ptr<const CachedShard> shard);
  // The shard. NOT_FOUND when the job or shard is not held; FAILED_PRECONDITION when
  // `want_xxh3_128` is set and the held copy's digest differs (a copy of another checkpoint).
  absl::StatusOr<std::shared_ptr<const CachedShard>> Get(const v1::ShardKey& key,
                                                         const std::string& want_xxh3_128) const;
  // Forgets a job; the shards dropped.
  int DropJob(const std::string& job_id);

  int64_t bytes() const;
  int64_t capacity_bytes() const { return capacity_bytes_; }
  // Shards held, over all jobs.
  int shards() const;

 private:
  struct Job {
    // step -> rank -> shard.
    std::map<int64_t, std::map<int, std::shared_ptr<const CachedShard>>> steps;
    uint64_t last_put = 0;
  };
  void DropStepLocked(Job& job, int64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int64_t capacity_bytes_;
  mutable absl::Mutex mu_;
  std::map<std::string, Job> jobs_ ABSL_GUARDED_BY(mu_);
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t puts_ ABSL_GUARDED_BY(mu_) = 0;
};

// The default cap: a quarter of the node's physical memory (trainers need the rest), or 1 GiB
// when it cannot be read.
int64_t DefaultShardCacheBytes();

// Chunk of a Put or Get stream.
inline constexpr size_t kShardChunkBytes = 1 << 20;

// The ShardCache gRPC service over `store` (not owned), on the callback API: a stream holds no
// thread while it waits for the network. Put writes each chunk into the memory file the shard
// will live in and hashes it as it comes; Get writes one chunk at a time as the previous one is
// taken. Under mutual TLS only callers whose certificate CN is in `allowed_callers` (the peer
// workers') are served; others get PERMISSION_DENIED. Empty: every caller the TLS layer admitted.
class ShardCacheService final : public v1::ShardCache::CallbackService {
 public:
  explicit ShardCacheService(ShardCacheStore* store,
                             std::vector<std::string> allowed_callers = {})
      : store_(store), allowed_callers_(std::move(allowed_callers)) {}

  grpc::ServerReadReactor<v1::PutShardChunk>* Put(grpc::CallbackServerContext* context,
                                                  v1::PutShardResponse* response) override;
  grpc::ServerWriteReactor<v1::GetShardChunk>* Get(grpc::CallbackServerContext* context,
                                                   const v1::GetShardRequest* request) override;
  grpc::ServerUnaryReactor* DropJob(grpc::CallbackServerContext* context,
                                    const v1::DropJobRequest* request,
                                    v1::DropJobResponse* response) override;

 private:
  grpc::Status CheckCaller(const grpc::ServerContextBase& context) const;

  ShardCacheStore* const store_;
  const std::vector<std::string> allowed_callers_;
};

struct ShardCachePeersOptions {
  // Credentials of calls to peer workers (the worker's own: its node certificate under TLS).
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  // Deadline of one Get or Put to a peer, per MiB of shard plus this base.
  absl::Duration call_timeout = absl::Seconds(10);
  // Replications waiting beyond this many are dropped (the oldest first): a slow peer never
  // holds more than this many shards of this worker's memory.
  int max_queued = 8;
};

// Calls to peer workers. Thread safety: any thread; Replicate's sends run on a thread of its own.
class ShardCachePeers {
 public:
  explicit ShardCachePeers(ShardCachePeersOptions options);
  // Stops the replication thread (queued sends are dropped).
  ~ShardCachePeers();
  ShardCachePeers(const ShardCachePeers&) = delete;
  ShardCachePeers& operator=(const ShardCachePeers&) = delete;

  // Queues a copy of `shard` to the worker at `address`; failures are logged, never retried
  // (the next checkpoint replaces the shard anyway).
  void Replicate(const std::string& address, std::shared_ptr<const CachedShard> shard);
  // Sends now; the peer's status.
  absl::Status Put(const std::string& address, const CachedShard& shard);
  // Fetches a shard from the worker at `address` (GetShardRequest semantics).
  absl::StatusOr<CachedShard> Get(const std::string& address, const v1::ShardKey& key,
                                  const std::string& want_xxh3_128);
  // Asks the worker at `address` to forget a job.
  absl::Status DropJob(const std::string& address, const std::string& job_id);
  // Replications sent (ok) and failed so far.
  int64_t replicated() const;
  int64_t replication_failures() const;

 private:
  std::shared_ptr<grpc::Channel> ChannelTo(const std::string& address);
  void SendLoop();

  const ShardCachePeersOptions options_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_ ABSL_GUARDED_BY(mu_);
  std::deque<std::pair<std::string, std::shared_ptr<const CachedShard>>> queue_
      ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t replicated_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t replication_failures_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread sender_;
};

// Prometheus figures of the cache and of the restores the worker's trainers report. Thread
// safety: prometheus-cpp's metrics are atomic.
class ShardCacheMetrics {
 public:
  explicit ShardCacheMetrics(prometheus::Registry& registry);
  // Counts a TrainerStarted's restore: tessera_checkpoint_restores_total{source=memory|storage}.
  void RecordReport(const v1::TrainerReport& report);
  void SetCacheBytes(int64_t bytes) { cache_bytes_->Set(static_cast<double>(bytes)); }

 private:
  prometheus::Counter* memory_;
  prometheus::Counter* storage_;
  prometheus::Gauge* cache_bytes_;
};

// The trainers' local socket. Thread safety: Start and destruction from one thread; a thread
// accepts, and each connection (one call of a trainer) is served on a detached thread of its own,
// which the destructor waits for (a node runs a few trainers, each with a call or two at a time).
class LocalShardCacheServer {
 public:
  // Listens on `socket_path` (replacing a stale socket there). `store` and `peers` are not owned
  // and outlive the server; `metrics` may be null.
  static absl::StatusOr<std::unique_ptr<LocalShardCacheServer>> Start(
      const std::string& socket_path, ShardCacheStore* store, ShardCachePeers* peers,
      ShardCacheMetrics* metrics);
  // Stops accepting, shuts the open connections down and joins their threads.
  ~LocalShardCacheServer();

  const std::string& socket_path() const { return socket_path_; }
  // Where puts report the cache's size from now on (null: nowhere); the daemon's registry exists
  // only after its servers, which start after this socket.
  void SetMetrics(ShardCacheMetrics* metrics) { metrics_.store(metrics); }

 private:
  LocalShardCacheServer(std::string socket_path, int listen_fd, ShardCacheStore* store,
                        ShardCachePeers* peers, ShardCacheMetrics* metrics);
  void AcceptLoop();
  void Serve(int fd);
  // One request on `fd`; false when the connection is done (closed or broken).
  bool ServeOne(int fd);

  const std::string socket_path_;
  const int listen_fd_;
  ShardCacheStore* const store_;
  ShardCachePeers* const peers_;
  std::atomic<ShardCacheMetrics*> metrics_;
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Open connections; each one's thread removes it when done.
  std::vector<int> connections_ ABSL_GUARDED_BY(mu_);
  std::thread acceptor_;
};

}  // namespace tessera::worker

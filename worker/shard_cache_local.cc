// LocalShardCacheServer (shard_cache.h): the Unix socket of the worker's trainers. Frames
// (common/socket_frames.h) hold the serialized messages; a sealed memory file holding the shard
// is passed beside a put's request and beside a found get's response
// (trainer/io/shard_cache_client.h is the other end).
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "common/sealed_memory.h"
#include "common/socket_frames.h"
#include "worker/shard_cache.h"

namespace tessera::worker {
namespace {

// A request larger than this is not a ShardCacheRequest (peer lists are short).
constexpr uint32_t kMaxFrameBytes = 1 << 20;

bool Answer(int fd, const absl::Status& status) {
  v1::ShardCacheResponse response;
  response.set_code(static_cast<int>(status.code()));
  response.set_message(std::string(status.message()));
  return WriteMessage(fd, response);
}

}  // namespace

absl::StatusOr<std::unique_ptr<LocalShardCacheServer>> LocalShardCacheServer::Start(
    const std::string& socket_path, ShardCacheStore* store, ShardCachePeers* peers,
    ShardCacheMetrics* metrics) {
  sockaddr_un address{};
  if (socket_path.size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard cache socket path too long for a Unix socket: ", socket_path));
  }
  std::error_code ignored;
  std::filesystem::remove(socket_path, ignored);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, socket_path.data(), socket_path.size());
  // Owner only: the worker's trainers run as its user; no other local user reads shards.
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      ::chmod(socket_path.c_str(), 0600) != 0 || ::listen(fd, 64) != 0) {
    const int error = errno;
    ::close(fd);
    return absl::InternalError(
        absl::StrCat("shard cache socket ", socket_path, ": ", std::strerror(error)));
  }
  return std::unique_ptr<LocalShardCacheServer>(
      new LocalShardCacheServer(socket_path, fd, store, peers, metrics));
}

LocalShardCacheServer::LocalShardCacheServer(std::string socket_path, int listen_fd,
                                             ShardCacheStore* store, ShardCachePeers* peers,
                                             ShardCacheMetrics* metrics)
    : socket_path_(std::move(socket_path)),
      listen_fd_(listen_fd),
      store_(store),
      peers_(peers),
      metrics_(metrics),
      acceptor_([this] { AcceptLoop(); }) {}

LocalShardCacheServer::~LocalShardCacheServer() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    // Wakes accept() and every connection's read.
    ::shutdown(listen_fd_, SHUT_RDWR);
    for (int fd : connections_) ::shutdown(fd, SHUT_RDWR);
  }
  acceptor_.join();
  {
    absl::MutexLock lock(&mu_);
    auto all_done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return connections_.empty(); };
    mu_.Await(absl::Condition(&all_done));
  }
  ::close(listen_fd_);
  std::error_code ignored;
  std::filesystem::remove(socket_path_, ignored);
}

void LocalShardCacheServer::AcceptLoop() {
  while (true) {
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    const int error = errno;
    absl::MutexLock lock(&mu_);
    if (stopping_) {
      if (fd >= 0) ::close(fd);
      return;
    }
    if (fd < 0) {
      if (error == EINTR || error == ECONNABORTED) continue;
      std::cerr << "tessera-worker: shard cache socket: accept: " << std::strerror(error)
                << std::endl;
      return;
    }
    connections_.push_back(fd);
    std::thread([this, fd] { Serve(fd); }).detach();
  }
}

void LocalShardCacheServer::Serve(int fd) {
  while (ServeOne(fd)) {
  }
  absl::MutexLock lock(&mu_);
  connections_.erase(std::find(connections_.begin(), connections_.end(), fd));
  ::close(fd);
}

bool LocalShardCacheServer::ServeOne(int fd) {
  v1::ShardCacheRequest request;
  if (!ReadMessage(fd, kMaxFrameBytes, &request)) return false;
  switch (request.op()) {
    case v1::SHARD_CACHE_OP_PUT: {
      // The trainer's sealed memory file comes beside the request; the worker keeps it.
      absl::StatusOr<int> received = ReceiveDescriptor(fd);
      if (!received.ok()) {
        Answer(fd, absl::Status(received.status().code(),
                                absl::StrCat("put's memory file: ", received.status().message())));
        return false;
      }
      absl::StatusOr<SealedMemory> bytes = SealedMemory::Adopt(*received);
      if (!bytes.ok()) return Answer(fd, bytes.status());
      auto shard = std::make_shared<CachedShard>();
      shard->header = request.header();
      shard->bytes = *std::move(bytes);
      std::shared_ptr<const CachedShard> stored = std::move(shard);
      absl::Status status = store_->Put(stored);
      if (ShardCacheMetrics* metrics = metrics_.load(); metrics != nullptr) {
        metrics->SetCacheBytes(store_->bytes());
      }
      if (status.ok() && !request.replica_address().empty()) {
        peers_->Replicate(request.replica_address(), stored);
      }
      const bool answered = Answer(fd, status);
      // Hashed now, after the answer (the trainer's checkpoint does not wait for it), so that a
      // restore finds the check done. A copy that does not match is never served.
      if (status.ok()) {
        if (absl::Status verified = stored->Verify(); !verified.ok()) {
          std::cerr << "tessera-worker: " << verified << std::endl;
        }
      }
      return answered;
    }
    case v1::SHARD_CACHE_OP_GET: {
      std::shared_ptr<const CachedShard> shard;
      v1::ShardSource source = v1::SHARD_SOURCE_LOCAL;
      absl::StatusOr<std::shared_ptr<const CachedShard>> local =
          store_->Get(request.key(), request.xxh3_128());
      absl::Status last = local.status();
      if (local.ok()) {
        last = (*local)->Verify();
        if (last.ok()) shard = *std::move(local);
      }
      if (shard == nullptr) {
        for (const std::string& peer : request.peer_addresses()) {
          absl::StatusOr<CachedShard> fetched =
              peers_->Get(peer, request.key(), request.xxh3_128());
          if (!fetched.ok()) {
            last = fetched.status();
            continue;
          }
          auto copy = std::make_shared<const CachedShard>(*std::move(fetched));
          last = copy->Verify();
          if (!last.ok()) continue;
          // Kept here too: the node's other ranks ask for the same shard.
          if (absl::Status kept = store_->Put(copy); !kept.ok()) {
            std::cerr << "tessera-worker: shard cache: a peer's copy not kept: " << kept
                      << std::endl;
          }
          shard = std::move(copy);
          source = v1::SHARD_SOURCE_PEER;
          break;
        }
      }
      if (shard == nullptr) return Answer(fd, last);
      v1::ShardCacheResponse response;
      *response.mutable_header() = shard->header;
      response.set_source(source);
      response.set_verified(true);
      // The trainer maps the sealed memory file: no bytes cross the socket.
      return WriteMessage(fd, response) && SendDescriptor(fd, shard->bytes.fd());
    }
    default:
      Answer(fd, absl::InvalidArgumentError(
                     absl::StrCat("op: ", static_cast<int>(request.op()), " is not PUT or GET")));
      return false;
  }
}

}  // namespace tessera::worker

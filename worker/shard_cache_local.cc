// LocalShardCacheServer (shard_cache.h): the Unix socket of the worker's trainers. Frames: a
// 4-byte little-endian length, then the serialized message; a put's or a found get's shard bytes
// follow their message raw (trainer/io/shard_cache_client.h is the other end).
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "worker/shard_cache.h"

namespace tessera::worker {
namespace {

// A request larger than this is not a ShardCacheRequest (peer lists are short).
constexpr uint32_t kMaxFrameBytes = 1 << 20;

bool ReadFull(int fd, void* data, size_t size) {
  char* p = static_cast<char*>(data);
  while (size > 0) {
    const ssize_t n = ::read(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

bool WriteFull(int fd, const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::send(fd, p, size, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

bool WriteFrame(int fd, const google::protobuf::MessageLite& message) {
  const std::string body = message.SerializeAsString();
  const uint32_t size = static_cast<uint32_t>(body.size());
  const unsigned char prefix[4] = {static_cast<unsigned char>(size),
                                   static_cast<unsigned char>(size >> 8),
                                   static_cast<unsigned char>(size >> 16),
                                   static_cast<unsigned char>(size >> 24)};
  return WriteFull(fd, prefix, 4) && WriteFull(fd, body.data(), body.size());
}

bool ReadFrame(int fd, google::protobuf::MessageLite* message) {
  unsigned char prefix[4];
  if (!ReadFull(fd, prefix, 4)) return false;
  const uint32_t size = prefix[0] | (prefix[1] << 8) | (prefix[2] << 16) |
                        (static_cast<uint32_t>(prefix[3]) << 24);
  if (size > kMaxFrameBytes) return false;
  std::string body(size, '\0');
  return ReadFull(fd, body.data(), size) && message->ParseFromString(body);
}

bool Answer(int fd, const absl::Status& status) {
  v1::ShardCacheResponse response;
  response.set_code(static_cast<int>(status.code()));
  response.set_message(std::string(status.message()));
  return WriteFrame(fd, response);
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
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      ::listen(fd, 64) != 0) {
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
  if (!ReadFrame(fd, &request)) return false;
  switch (request.op()) {
    case v1::SHARD_CACHE_OP_PUT: {
      const int64_t size = request.header().size_bytes();
      if (size < 0 || size > store_->capacity_bytes()) {
        // The bytes that follow cannot be skipped cheaply: the connection ends after the answer.
        Answer(fd, absl::ResourceExhaustedError(
                       absl::StrCat("header.size_bytes: ", size, " does not fit the cache (",
                                    store_->capacity_bytes(), " bytes)")));
        return false;
      }
      std::string bytes(static_cast<size_t>(size), '\0');
      if (!ReadFull(fd, bytes.data(), bytes.size())) return false;
      v1::ShardHeader header = request.header();
      const v1::ShardKey key = header.key();
      absl::Status status = store_->Put(std::move(header), std::move(bytes));
      if (ShardCacheMetrics* metrics = metrics_.load(); metrics != nullptr) {
        metrics->SetCacheBytes(store_->bytes());
      }
      if (status.ok() && !request.replica_address().empty()) {
        absl::StatusOr<std::shared_ptr<const CachedShard>> stored = store_->Get(key, "");
        if (stored.ok()) peers_->Replicate(request.replica_address(), *std::move(stored));
      }
      return Answer(fd, status);
    }
    case v1::SHARD_CACHE_OP_GET: {
      std::shared_ptr<const CachedShard> shard;
      v1::ShardSource source = v1::SHARD_SOURCE_LOCAL;
      absl::StatusOr<std::shared_ptr<const CachedShard>> local =
          store_->Get(request.key(), request.xxh3_128());
      absl::Status last = local.status();
      if (local.ok()) {
        shard = *std::move(local);
      } else {
        for (const std::string& peer : request.peer_addresses()) {
          absl::StatusOr<CachedShard> fetched =
              peers_->Get(peer, request.key(), request.xxh3_128());
          if (fetched.ok()) {
            shard = std::make_shared<const CachedShard>(*std::move(fetched));
            source = v1::SHARD_SOURCE_PEER;
            break;
          }
          last = fetched.status();
        }
      }
      if (shard == nullptr) return Answer(fd, last);
      v1::ShardCacheResponse response;
      *response.mutable_header() = shard->header;
      response.set_source(source);
      return WriteFrame(fd, response) && WriteFull(fd, shard->bytes.data(), shard->bytes.size());
    }
    default:
      Answer(fd, absl::InvalidArgumentError(
                     absl::StrCat("op: ", static_cast<int>(request.op()), " is not PUT or GET")));
      return false;
  }
}

}  // namespace tessera::worker

#include "trainer/io/shard_cache_client.h"

#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/scoped_fd.h"

namespace tessera::trainer {
namespace {

// A response larger than this is not a ShardCacheResponse.
constexpr uint32_t kMaxFrameBytes = 1 << 20;

absl::Status Broken(const std::string& socket_path, const char* what) {
  return absl::UnavailableError(absl::StrCat("shard cache ", socket_path, ": ", what, ": ",
                                             errno != 0 ? std::strerror(errno) : "closed"));
}

bool ReadFull(int fd, void* data, size_t size) {
  char* p = static_cast<char*>(data);
  while (size > 0) {
    const ssize_t n = ::read(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (n == 0) errno = 0;
      return false;
    }
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

// The connected socket's descriptor, which the caller owns.
absl::StatusOr<int> Connect(const std::string& socket_path, absl::Duration timeout) {
  sockaddr_un address{};
  if (socket_path.size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard_cache_socket: too long for a Unix socket: ", socket_path));
  }
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Broken(socket_path, "socket");
  // Every read and write gives up after `timeout`: a worker that hangs never holds a resume.
  timeval limit{};
  limit.tv_sec = static_cast<time_t>(absl::ToInt64Seconds(timeout));
  limit.tv_usec = static_cast<suseconds_t>(
      absl::ToInt64Microseconds(timeout - absl::Seconds(limit.tv_sec)));
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof(limit));
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, socket_path.data(), socket_path.size());
  if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    absl::Status status = Broken(socket_path, "connect");
    ::close(fd);
    return status;
  }
  return fd;
}

absl::Status StatusOf(const v1::ShardCacheResponse& response) {
  return absl::Status(static_cast<absl::StatusCode>(response.code()), response.message());
}

}  // namespace

absl::Status PutShardInCache(const std::string& socket_path, const v1::ShardHeader& header,
                             const std::string& bytes, const std::string& replica_address,
                             absl::Duration timeout) {
  absl::StatusOr<int> connected = Connect(socket_path, timeout);
  if (!connected.ok()) return connected.status();
  ScopedFd fd(*connected);
  v1::ShardCacheRequest request;
  request.set_op(v1::SHARD_CACHE_OP_PUT);
  *request.mutable_header() = header;
  request.mutable_header()->set_size_bytes(static_cast<int64_t>(bytes.size()));
  request.set_replica_address(replica_address);
  if (!WriteFrame(fd.get(), request) || !WriteFull(fd.get(), bytes.data(), bytes.size())) {
    return Broken(socket_path, "put");
  }
  v1::ShardCacheResponse response;
  if (!ReadFrame(fd.get(), &response)) return Broken(socket_path, "put's answer");
  return StatusOf(response);
}

absl::StatusOr<CachedShardCopy> GetShardFromCache(const std::string& socket_path,
                                                  const v1::ShardKey& key,
                                                  const std::string& xxh3_128,
                                                  const std::vector<std::string>& peers,
                                                  absl::Duration timeout) {
  absl::StatusOr<int> connected = Connect(socket_path, timeout);
  if (!connected.ok()) return connected.status();
  ScopedFd fd(*connected);
  v1::ShardCacheRequest request;
  request.set_op(v1::SHARD_CACHE_OP_GET);
  *request.mutable_key() = key;
  request.set_xxh3_128(xxh3_128);
  for (const std::string& peer : peers) request.add_peer_addresses(peer);
  if (!WriteFrame(fd.get(), request)) return Broken(socket_path, "get");
  v1::ShardCacheResponse response;
  if (!ReadFrame(fd.get(), &response)) return Broken(socket_path, "get's answer");
  if (response.code() != 0) return StatusOf(response);
  CachedShardCopy copy;
  copy.header = response.header();
  copy.source = response.source();
  if (copy.header.size_bytes() < 0) {
    return absl::DataLossError(absl::StrCat("shard cache ", socket_path, ": negative size"));
  }
  copy.bytes.resize(static_cast<size_t>(copy.header.size_bytes()));
  if (!ReadFull(fd.get(), copy.bytes.data(), copy.bytes.size())) {
    return Broken(socket_path, "get's bytes");
  }
  return copy;
}

}  // namespace tessera::trainer

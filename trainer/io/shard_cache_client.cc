#include "trainer/io/shard_cache_client.h"

#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/scoped_fd.h"
#include "common/socket_frames.h"

namespace tessera::trainer {
namespace {

// A response larger than this is not a ShardCacheResponse.
constexpr uint32_t kMaxFrameBytes = 1 << 20;

absl::Status Broken(const std::string& socket_path, const char* what) {
  return absl::UnavailableError(absl::StrCat("shard cache ", socket_path, ": ", what, ": ",
                                             errno != 0 ? std::strerror(errno) : "closed"));
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
                             const SealedMemory& bytes, const std::string& replica_address,
                             absl::Duration timeout) {
  absl::StatusOr<int> connected = Connect(socket_path, timeout);
  if (!connected.ok()) return connected.status();
  ScopedFd fd(*connected);
  v1::ShardCacheRequest request;
  request.set_op(v1::SHARD_CACHE_OP_PUT);
  *request.mutable_header() = header;
  request.mutable_header()->set_size_bytes(static_cast<int64_t>(bytes.size()));
  request.set_replica_address(replica_address);
  if (!WriteMessage(fd.get(), request) || !SendDescriptor(fd.get(), bytes.fd())) {
    return Broken(socket_path, "put");
  }
  v1::ShardCacheResponse response;
  if (!ReadMessage(fd.get(), kMaxFrameBytes, &response)) return Broken(socket_path, "put's answer");
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
  if (!WriteMessage(fd.get(), request)) return Broken(socket_path, "get");
  v1::ShardCacheResponse response;
  if (!ReadMessage(fd.get(), kMaxFrameBytes, &response)) return Broken(socket_path, "get's answer");
  if (response.code() != 0) return StatusOf(response);
  CachedShardCopy copy;
  copy.header = response.header();
  copy.source = response.source();
  copy.verified = response.verified();
  if (copy.header.size_bytes() < 0) {
    return absl::DataLossError(absl::StrCat("shard cache ", socket_path, ": negative size"));
  }
  absl::StatusOr<int> received = ReceiveDescriptor(fd.get());
  if (!received.ok()) {
    return absl::Status(received.status().code(), absl::StrCat("shard cache ", socket_path,
                                                               ": get's memory file: ",
                                                               received.status().message()));
  }
  absl::StatusOr<SealedMemory> bytes = SealedMemory::Adopt(*received);
  if (!bytes.ok()) {
    return absl::Status(bytes.status().code(),
                        absl::StrCat("shard cache ", socket_path, ": ", bytes.status().message()));
  }
  copy.bytes = *std::move(bytes);
  if (static_cast<int64_t>(copy.bytes.size()) != copy.header.size_bytes()) {
    return absl::DataLossError(absl::StrCat("shard cache ", socket_path, ": the memory file has ",
                                            copy.bytes.size(), " bytes, the header says ",
                                            copy.header.size_bytes()));
  }
  return copy;
}

}  // namespace tessera::trainer

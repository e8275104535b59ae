#include "common/socket_frames.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace tessera {

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

bool WriteFrame(int fd, std::string_view body) {
  if (body.size() > UINT32_MAX) {
    errno = EMSGSIZE;
    return false;
  }
  const uint32_t size = static_cast<uint32_t>(body.size());
  const unsigned char prefix[4] = {
      static_cast<unsigned char>(size), static_cast<unsigned char>(size >> 8),
      static_cast<unsigned char>(size >> 16), static_cast<unsigned char>(size >> 24)};
  return WriteFull(fd, prefix, 4) && WriteFull(fd, body.data(), body.size());
}

bool ReadFrame(int fd, uint32_t max_bytes, std::string* body) {
  unsigned char prefix[4];
  if (!ReadFull(fd, prefix, 4)) return false;
  const uint32_t size = prefix[0] | (prefix[1] << 8) | (prefix[2] << 16) |
                        (static_cast<uint32_t>(prefix[3]) << 24);
  if (size > max_bytes) {
    errno = EMSGSIZE;
    return false;
  }
  body->resize(size);
  return ReadFull(fd, body->data(), size);
}

bool SendDescriptor(int fd, int passed) {
  char byte = 0;
  iovec io{.iov_base = &byte, .iov_len = 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr message{};
  message.msg_iov = &io;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = sizeof(control);
  cmsghdr* header = CMSG_FIRSTHDR(&message);
  header->cmsg_level = SOL_SOCKET;
  header->cmsg_type = SCM_RIGHTS;
  header->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(header), &passed, sizeof(int));
  while (true) {
    const ssize_t n = ::sendmsg(fd, &message, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    return n == 1;
  }
}

absl::StatusOr<int> ReceiveDescriptor(int fd) {
  char byte = 0;
  iovec io{.iov_base = &byte, .iov_len = 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr message{};
  message.msg_iov = &io;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = sizeof(control);
  ssize_t n;
  do {
    n = ::recvmsg(fd, &message, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n != 1) {
    return absl::UnavailableError(absl::StrCat(
        "receiving a descriptor: ", n == 0 ? "end of stream" : std::strerror(errno)));
  }
  int received = -1;
  for (cmsghdr* header = CMSG_FIRSTHDR(&message); header != nullptr;
       header = CMSG_NXTHDR(&message, header)) {
    if (header->cmsg_level != SOL_SOCKET || header->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (header->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int one;
      std::memcpy(&one, CMSG_DATA(header) + i * sizeof(int), sizeof(int));
      if (received < 0) {
        received = one;
      } else {
        ::close(one);  // more than one: only the first is kept
      }
    }
  }
  if ((message.msg_flags & MSG_CTRUNC) != 0 && received < 0) {
    return absl::DataLossError("receiving a descriptor: the control message was truncated");
  }
  if (received < 0) return absl::DataLossError("receiving a descriptor: none came");
  return received;
}

}  // namespace tessera

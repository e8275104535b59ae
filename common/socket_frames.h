// Length-prefixed frames on a stream socket (the worker's local shard cache socket,
// worker/shard_cache.h, and its trainers' end, trainer/io/shard_cache_client.h): a 4-byte
// little-endian length, then the body. Raw bytes may follow a frame, and a descriptor may be
// passed beside one byte (SCM_RIGHTS). Every call blocks until done or the socket's own timeouts
// (SO_RCVTIMEO / SO_SNDTIMEO) expire; writes never raise SIGPIPE. Abseil only, no protobuf: the
// callers serialize and parse.
#pragma once

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace tessera {

// Reads exactly `size` bytes. False on an error or end of stream; errno is then the error, or 0
// at end of stream.
bool ReadFull(int fd, void* data, size_t size);
// Writes all of `data` (send with MSG_NOSIGNAL). False on an error, errno set.
bool WriteFull(int fd, const void* data, size_t size);

// Writes one frame holding `body` (at most 4 GiB - 1 bytes).
bool WriteFrame(int fd, std::string_view body);
// Reads one frame into `body`. False on an error, at end of stream, or when the frame announces
// more than `max_bytes` (errno then EMSGSIZE): the stream is out of step and must be closed.
bool ReadFrame(int fd, uint32_t max_bytes, std::string* body);

// A frame holding a serialized protobuf message (templates, so this library links no protobuf).
template <typename Message>
bool WriteMessage(int fd, const Message& message) {
  return WriteFrame(fd, message.SerializeAsString());
}
// Reads a frame of at most `max_bytes` and parses it into `message`; false as ReadFrame, or when
// the body does not parse (errno then EBADMSG).
template <typename Message>
bool ReadMessage(int fd, uint32_t max_bytes, Message* message) {
  std::string body;
  if (!ReadFrame(fd, max_bytes, &body)) return false;
  if (message->ParseFromString(body)) return true;
  errno = EBADMSG;
  return false;
}

// Sends the descriptor `passed` (a duplicate arrives) beside one byte.
bool SendDescriptor(int fd, int passed);
// Receives a descriptor sent by SendDescriptor; the caller owns it (close-on-exec set).
// UNAVAILABLE when the stream ended or failed, DATA_LOSS when the byte came without one.
absl::StatusOr<int> ReceiveDescriptor(int fd);

}  // namespace tessera

#include "common/socket_frames.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <thread>

#include "common/scoped_fd.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::StatusIs;
using ::testing::HasSubstr;

struct SocketPair {
  SocketPair() {
    int fds[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
    a = fds[0];
    b = fds[1];
  }
  ~SocketPair() {
    if (a >= 0) ::close(a);
    if (b >= 0) ::close(b);
  }
  int a = -1;
  int b = -1;
};

TEST(SocketFramesTest, FramesAndRawBytesArriveInOrder) {
  SocketPair pair;
  // Larger than a socket buffer: the writer blocks until the reader drains it.
  const std::string big(3 << 20, 'x');
  std::thread writer([&] {
    EXPECT_TRUE(WriteFrame(pair.a, "first"));
    EXPECT_TRUE(WriteFrame(pair.a, ""));
    EXPECT_TRUE(WriteFrame(pair.a, big));
    EXPECT_TRUE(WriteFull(pair.a, "raw", 3));
  });
  std::string body;
  ASSERT_TRUE(ReadFrame(pair.b, 1 << 30, &body));
  EXPECT_EQ(body, "first");
  ASSERT_TRUE(ReadFrame(pair.b, 1 << 30, &body));
  EXPECT_EQ(body, "");
  ASSERT_TRUE(ReadFrame(pair.b, 1 << 30, &body));
  EXPECT_EQ(body, big);
  char raw[3];
  ASSERT_TRUE(ReadFull(pair.b, raw, 3));
  EXPECT_EQ(std::string(raw, 3), "raw");
  writer.join();
}

TEST(SocketFramesTest, LengthIsLittleEndian) {
  SocketPair pair;
  ASSERT_TRUE(WriteFrame(pair.a, std::string(0x0102, 'y')));
  unsigned char prefix[4];
  ASSERT_TRUE(ReadFull(pair.b, prefix, 4));
  EXPECT_EQ(prefix[0], 0x02);
  EXPECT_EQ(prefix[1], 0x01);
  EXPECT_EQ(prefix[2], 0);
  EXPECT_EQ(prefix[3], 0);
}

TEST(SocketFramesTest, RefusesFramesOverTheLimit) {
  SocketPair pair;
  ASSERT_TRUE(WriteFrame(pair.a, std::string(101, 'z')));
  std::string body;
  EXPECT_FALSE(ReadFrame(pair.b, 100, &body));
  EXPECT_EQ(errno, EMSGSIZE);
}

TEST(SocketFramesTest, EndOfStreamIsNotAnError) {
  SocketPair pair;
  ASSERT_TRUE(WriteFull(pair.a, "ab", 2));
  ::close(pair.a);
  pair.a = -1;
  char buffer[4];
  EXPECT_FALSE(ReadFull(pair.b, buffer, 4));  // two of four bytes, then the end
  EXPECT_EQ(errno, 0);
}

TEST(SocketFramesTest, WritingToAClosedPeerFailsWithoutSignal) {
  SocketPair pair;
  ::close(pair.b);
  pair.b = -1;
  EXPECT_FALSE(WriteFrame(pair.a, "nobody reads this"));
  EXPECT_EQ(errno, EPIPE);
}

TEST(SocketFramesTest, PassesADescriptorBesideTheFrames) {
  SocketPair pair;
  int pipe_fds[2];
  ASSERT_EQ(::pipe2(pipe_fds, O_CLOEXEC), 0);
  ScopedFd pipe_read(pipe_fds[0]);
  ScopedFd pipe_write(pipe_fds[1]);
  ASSERT_TRUE(WriteFrame(pair.a, "here it comes"));
  ASSERT_TRUE(SendDescriptor(pair.a, pipe_write.get()));
  ASSERT_TRUE(WriteFrame(pair.a, "after"));
  std::string body;
  ASSERT_TRUE(ReadFrame(pair.b, 1 << 20, &body));
  EXPECT_EQ(body, "here it comes");
  absl::StatusOr<int> received = ReceiveDescriptor(pair.b);
  ASSERT_THAT(received, IsOk());
  ScopedFd copy(*received);
  EXPECT_NE(copy.get(), pipe_write.get());
  EXPECT_EQ(::fcntl(copy.get(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
  // The received descriptor is the same pipe: what goes in there comes out of our end.
  ASSERT_EQ(::write(copy.get(), "p", 1), 1);
  char out = 0;
  ASSERT_EQ(::read(pipe_read.get(), &out, 1), 1);
  EXPECT_EQ(out, 'p');
  ASSERT_TRUE(ReadFrame(pair.b, 1 << 20, &body));
  EXPECT_EQ(body, "after");
}

TEST(SocketFramesTest, ReceivingWhereNoDescriptorWasSentIsDataLoss) {
  SocketPair pair;
  ASSERT_TRUE(WriteFull(pair.a, "x", 1));
  EXPECT_THAT(ReceiveDescriptor(pair.b), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("none")));
  ::close(pair.a);
  pair.a = -1;
  EXPECT_THAT(ReceiveDescriptor(pair.b),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("end of stream")));
}

}  // namespace
}  // namespace tessera

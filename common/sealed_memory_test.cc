#include "common/sealed_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "common/status_matchers.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::StatusIs;
using ::testing::HasSubstr;

TEST(SealedMemoryTest, HoldsWhatWasFilledIn) {
  absl::StatusOr<SealedMemory> memory =
      SealedMemory::Create("test", 5, [](char* data) {
        std::memcpy(data, "hello", 5);
        return absl::OkStatus();
      });
  ASSERT_THAT(memory, IsOk());
  EXPECT_EQ(memory->view(), "hello");
  EXPECT_GE(memory->fd(), 0);
  // The same bytes through the path, as a reader that opens files sees them.
  std::ifstream in(memory->ProcPath(), std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_EQ(text.str(), "hello");
}

TEST(SealedMemoryTest, NobodyCanChangeTheBytes) {
  absl::StatusOr<SealedMemory> memory = SealedMemory::Copy("test", "fixed");
  ASSERT_THAT(memory, IsOk());
  EXPECT_LT(::pwrite(memory->fd(), "X", 1, 0), 0);
  EXPECT_EQ(errno, EPERM);
  EXPECT_NE(::ftruncate(memory->fd(), 1), 0);
  EXPECT_EQ(::mmap(nullptr, 5, PROT_READ | PROT_WRITE, MAP_SHARED, memory->fd(), 0), MAP_FAILED);
  // Nor through a descriptor opened anew.
  const int reopened = ::open(memory->ProcPath().c_str(), O_RDWR | O_CLOEXEC);
  if (reopened >= 0) {
    EXPECT_LT(::pwrite(reopened, "X", 1, 0), 0);
    ::close(reopened);
  }
  EXPECT_EQ(memory->view(), "fixed");
}

// A writer's pieces, written one after the other, are the sealed bytes; writers of no bytes and
// writers dropped unsealed are fine too.
TEST(SealedMemoryTest, AWriterFillsPieceByPieceThenSeals) {
  absl::StatusOr<SealedMemory::Writer> writer = SealedMemory::Writer::Start("test", 11);
  ASSERT_THAT(writer, IsOk());
  ASSERT_EQ(writer->size(), 11u);
  std::memcpy(writer->data(), "piece ", 6);
  std::memcpy(writer->data() + 6, "by pc", 5);
  SealedMemory::Writer moved = *std::move(writer);
  absl::StatusOr<SealedMemory> memory = std::move(moved).Seal();
  ASSERT_THAT(memory, IsOk());
  EXPECT_EQ(memory->view(), "piece by pc");
  EXPECT_LT(::pwrite(memory->fd(), "X", 1, 0), 0) << "sealed like any other";
  EXPECT_EQ(moved.data(), nullptr);

  absl::StatusOr<SealedMemory::Writer> empty = SealedMemory::Writer::Start("test", 0);
  ASSERT_THAT(empty, IsOk());
  EXPECT_EQ(empty->data(), nullptr);
  absl::StatusOr<SealedMemory> none = std::move(*empty).Seal();
  ASSERT_THAT(none, IsOk());
  EXPECT_EQ(none->view(), "");

  absl::StatusOr<SealedMemory::Writer> dropped = SealedMemory::Writer::Start("test", 4096);
  ASSERT_THAT(dropped, IsOk());
  dropped->data()[0] = 'x';
}

TEST(SealedMemoryTest, AdoptsASealedDuplicate) {
  absl::StatusOr<SealedMemory> memory = SealedMemory::Copy("test", "shared bytes");
  ASSERT_THAT(memory, IsOk());
  absl::StatusOr<SealedMemory> adopted = SealedMemory::Adopt(::fcntl(memory->fd(), F_DUPFD_CLOEXEC, 0));
  ASSERT_THAT(adopted, IsOk());
  EXPECT_EQ(adopted->view(), "shared bytes");
  // Both map the same pages, not copies.
  *memory = SealedMemory();
  EXPECT_EQ(adopted->view(), "shared bytes");
}

// A file's bytes copied in by the kernel: the same bytes, sealed like any other.
TEST(SealedMemoryTest, CopiesAFileSealed) {
  std::string bytes(3 << 20, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 31 + 3);
  FILE* file = std::tmpfile();
  ASSERT_NE(file, nullptr);
  ASSERT_EQ(std::fwrite(bytes.data(), 1, bytes.size(), file), bytes.size());
  ASSERT_EQ(std::fflush(file), 0);
  absl::StatusOr<SealedMemory> memory =
      SealedMemory::CopyOfFile("test", ::fileno(file), bytes.size());
  ASSERT_THAT(memory, IsOk());
  EXPECT_TRUE(memory->view() == bytes);
  EXPECT_LT(::pwrite(memory->fd(), "X", 1, 0), 0);
  absl::StatusOr<SealedMemory> adopted =
      SealedMemory::Adopt(::fcntl(memory->fd(), F_DUPFD_CLOEXEC, 0));
  ASSERT_THAT(adopted, IsOk());
  EXPECT_TRUE(adopted->view() == bytes);
  // A file shorter than asked for is not taken as whole.
  EXPECT_THAT(SealedMemory::CopyOfFile("test", ::fileno(file), bytes.size() + 1),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("ended after")));
  std::fclose(file);
}

TEST(SealedMemoryTest, RefusesWhatIsNotSealed) {
  const int unsealed = ::memfd_create("unsealed", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(unsealed, 0);
  ASSERT_EQ(::ftruncate(unsealed, 4), 0);
  EXPECT_THAT(SealedMemory::Adopt(unsealed),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not sealed")));
  int pipe_fds[2];
  ASSERT_EQ(::pipe2(pipe_fds, O_CLOEXEC), 0);
  ::close(pipe_fds[1]);
  EXPECT_THAT(SealedMemory::Adopt(pipe_fds[0]),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not a memory file")));
}

TEST(SealedMemoryTest, FillErrorsAreReturnedAndEmptyIsFine) {
  EXPECT_THAT(SealedMemory::Create("test", 8,
                                   [](char*) { return absl::DataLossError("stream broke"); }),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("stream broke")));
  absl::StatusOr<SealedMemory> empty = SealedMemory::Copy("test", "");
  ASSERT_THAT(empty, IsOk());
  EXPECT_EQ(empty->size(), 0u);
  EXPECT_THAT(SealedMemory::Adopt(::fcntl(empty->fd(), F_DUPFD_CLOEXEC, 0)), IsOk());
}

TEST(SealedMemoryTest, MovesOwnership) {
  absl::StatusOr<SealedMemory> memory = SealedMemory::Copy("test", "abc");
  ASSERT_THAT(memory, IsOk());
  const int fd = memory->fd();
  SealedMemory moved = *std::move(memory);
  EXPECT_EQ(moved.fd(), fd);
  EXPECT_EQ(moved.view(), "abc");
  EXPECT_EQ(memory->fd(), -1);
  EXPECT_TRUE(memory->view().empty());
}

}  // namespace
}  // namespace tessera

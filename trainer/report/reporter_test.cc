#include "trainer/report/reporter.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <sstream>
#include <string>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl.h"
#include "gtest/gtest.h"

namespace tessera::trainer {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::StatusIs;
using ::testing::HasSubstr;

v1::TrainerReport MetricsReport(int64_t step, double loss) {
  v1::TrainerReport report;
  report.set_job_id("job-1");
  report.set_rank(0);
  report.mutable_metrics()->set_step(step);
  report.mutable_metrics()->set_loss(loss);
  return report;
}

TEST(ReporterTest, JsonLinesUsesProtoFieldNames) {
  std::ostringstream out;
  JsonLinesReporter reporter(out);
  ASSERT_THAT(reporter.Send(MetricsReport(3, 2.5)), IsOk());
  ASSERT_THAT(reporter.Send(MetricsReport(4, 2.25)), IsOk());
  std::string text = out.str();
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 2);
  EXPECT_THAT(text, HasSubstr(R"("job_id":"job-1")"));
  EXPECT_THAT(text, HasSubstr(R"("step":"4")"));
  EXPECT_THAT(text, HasSubstr(R"("loss":2.25)"));
}

TEST(ReporterTest, SocketCarriesLengthDelimitedReports) {
  std::string path = ::testing::TempDir() + "tessera-reporter-" + std::to_string(getpid());
  unlink(path.c_str());
  int listener = socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(listener, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(listener, 1), 0);

  auto reporter = SocketReporter::Connect(path);
  ASSERT_THAT(reporter, IsOk());
  int connection = accept(listener, nullptr, nullptr);
  ASSERT_GE(connection, 0);
  for (int step = 1; step <= 3; ++step) {
    ASSERT_THAT((*reporter)->Send(MetricsReport(step, 1.0 / step)), IsOk());
  }
  reporter->reset();  // closes the socket: the reader sees end of stream

  google::protobuf::io::FileInputStream stream(connection);
  google::protobuf::io::CodedInputStream coded(&stream);
  for (int step = 1; step <= 3; ++step) {
    uint32_t size = 0;
    ASSERT_TRUE(coded.ReadVarint32(&size));
    auto limit = coded.PushLimit(static_cast<int>(size));
    v1::TrainerReport report;
    ASSERT_TRUE(report.ParseFromCodedStream(&coded));
    coded.PopLimit(limit);
    EXPECT_EQ(report.metrics().step(), step);
    EXPECT_DOUBLE_EQ(report.metrics().loss(), 1.0 / step);
  }
  uint32_t extra = 0;
  EXPECT_FALSE(coded.ReadVarint32(&extra)) << "nothing after the third report";
  close(connection);
  close(listener);
  unlink(path.c_str());
}

// A listening Unix socket at a fresh path, removed by the destructor.
class Listener {
 public:
  Listener() {
    path_ = ::testing::TempDir() + "tessera-reporter-watch-" + std::to_string(getpid());
    unlink(path_.c_str());
    fd_ = socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path_.c_str(), sizeof(addr.sun_path) - 1);
    ok_ = fd_ >= 0 && bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
          listen(fd_, 1) == 0;
  }
  ~Listener() {
    if (fd_ >= 0) close(fd_);
    unlink(path_.c_str());
  }
  bool ok() const { return ok_; }
  const std::string& path() const { return path_; }
  int Accept() { return accept(fd_, nullptr, nullptr); }

 private:
  std::string path_;
  int fd_ = -1;
  bool ok_ = false;
};

TEST(ReporterTest, WorkerClosingTheSocketRunsOnWorkerGone) {
  Listener listener;
  ASSERT_TRUE(listener.ok());
  absl::Notification gone;
  auto reporter =
      SocketReporter::Connect(listener.path(), {.on_worker_gone = [&] { gone.Notify(); }});
  ASSERT_THAT(reporter, IsOk());
  const int connection = listener.Accept();
  ASSERT_GE(connection, 0);
  ASSERT_THAT((*reporter)->Send(MetricsReport(1, 1.0)), IsOk());
  EXPECT_FALSE(gone.WaitForNotificationWithTimeout(absl::Milliseconds(200)))
      << "fired while the worker was still connected";
  close(connection);  // the worker goes away
  EXPECT_TRUE(gone.WaitForNotificationWithTimeout(absl::Seconds(10)));
}

TEST(ReporterTest, DestroyingTheReporterDoesNotRunOnWorkerGone) {
  Listener listener;
  ASSERT_TRUE(listener.ok());
  std::atomic<bool> fired{false};
  auto reporter =
      SocketReporter::Connect(listener.path(), {.on_worker_gone = [&] { fired = true; }});
  ASSERT_THAT(reporter, IsOk());
  const int connection = listener.Accept();
  ASSERT_GE(connection, 0);
  reporter->reset();  // joins the watch thread
  close(connection);
  EXPECT_FALSE(fired.load());
}

TEST(ReporterTest, ConnectingToNothingNamesThePath) {
  EXPECT_THAT(SocketReporter::Connect("/nonexistent/tessera.sock"),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("/nonexistent/tessera.sock")));
}

}  // namespace
}  // namespace tessera::trainer

// Test-only base fixture for WorkerAgent in-process on simulated time (worker_agent_sim_test.cc,
// worker_failover_test.cc): the stepped clock, the fake launcher, the agent's options every such
// test shares, moving time until a condition holds, and the trainers' report socket.
//
// Thread safety: used from the test's thread; the agent's threads only see the clock and launcher.
#pragma once

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "common/status_matchers.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "gtest/gtest.h"
#include "tests/util/temp_dir.h"
#include "worker/sim_fake.h"
#include "worker/worker_agent.h"

namespace tessera::worker::agent_test {

class AgentSimFixture : public ::testing::Test {
 protected:
  // The agent's poll interval and the step the tests move time by.
  static constexpr absl::Duration kStep = absl::Seconds(1);
  // Threads of the agent that wait on its clock: the heartbeat, supervise and relay loops.
  static constexpr int kClockedThreads = 3;

  // Starts the agent as node n1 with two CPU slots, fake trainers and the stepped clock; the
  // caller has set the coordinator address(es) and whatever else its test varies.
  void StartAgent(WorkerAgentOptions options) {
    options.node_id = "n1";
    options.work_dir = work_dir_;
    options.cpu_slots = 2;
    options.trainer_path = "fake-trainer";
    options.poll_interval = kStep;
    options.watch_assignments = false;
    options.clock = &clock_;
    options.launcher = &launcher_;
    agent_ = std::make_unique<WorkerAgent>(options, nullptr);
    ASSERT_THAT(agent_->Start("127.0.0.1:1"), ::tessera::testing::IsOk());
  }

  // Ends the fake ranks (the agent's Stop would wait for a stop grace on a clock nobody moves),
  // stops the agent and closes the report connections. Subclasses shut their servers after.
  void StopAgent() {
    launcher_.ExitAll();
    if (agent_) agent_->Stop();
    for (const auto& [rank, fd] : report_fds_) close(fd);
    report_fds_.clear();
  }

  // Moves time a step at a time, letting the agent's loops settle after each and running
  // `each_step` (e.g. the ranks' heartbeats), until `done` holds (true) or `limit` of simulated
  // time has passed (false).
  bool RunUntil(const std::function<bool()>& done, absl::Duration limit,
                const std::function<void()>& each_step = nullptr) {
    const absl::Time end = clock_.Now() + limit;
    while (true) {
      if (!clock_.Settle(kClockedThreads, absl::Seconds(30))) {
        ADD_FAILURE() << "the agent's loops did not settle";
        return false;
      }
      if (done()) return true;
      if (clock_.Now() >= end) return false;
      if (each_step) each_step();
      clock_.Advance(kStep);
    }
  }

  // Sends `report` as rank `rank` of job-1 attempt 0 on that rank's own connection to the
  // worker's report socket, framed as a trainer frames it (varint length, message).
  void SendReport(int rank, v1::TrainerReport report) {
    auto [it, added] = report_fds_.try_emplace(rank, -1);
    if (added) {
      it->second = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_un addr{};
      addr.sun_family = AF_UNIX;
      const std::string path = work_dir_ + "/reports.sock";
      std::memcpy(addr.sun_path, path.data(), path.size());
      ASSERT_EQ(connect(it->second, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0)
          << std::strerror(errno);
    }
    report.set_job_id("job-1");
    report.set_attempt(0);
    report.set_rank(rank);
    std::string frame;
    {
      google::protobuf::io::StringOutputStream stream(&frame);
      google::protobuf::io::CodedOutputStream out(&stream);
      out.WriteVarint32(static_cast<uint32_t>(report.ByteSizeLong()));
      report.SerializeWithCachedSizes(&out);
    }
    ASSERT_EQ(write(it->second, frame.data(), frame.size()), static_cast<ssize_t>(frame.size()));
  }
  // A RankHeartbeat of `rank` at `step` (half a second a step), as its trainer sends it.
  void SendHeartbeat(int rank, int64_t step) {
    v1::TrainerReport report;
    report.mutable_heartbeat()->set_step(step);
    report.mutable_heartbeat()->set_step_seconds(0.5);
    SendReport(rank, std::move(report));
  }

  const std::string work_dir_ = ::tessera::testing::TestDir() + "/w";
  SteppedClock clock_;
  FakeLauncher launcher_{&clock_};
  std::unique_ptr<WorkerAgent> agent_;

 private:
  std::map<int, int> report_fds_;
};

}  // namespace tessera::worker::agent_test

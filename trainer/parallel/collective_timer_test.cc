// The collective table on real Gloo groups, ranks as processes: a tensor-parallel all-reduce issued
// by the model's own code path lands in all_reduce/tp with its bytes, a dp all-reduce in
// all_reduce/dp, and nothing elsewhere; a dp-only job's dp group, which is also the world group,
// reads "dp"; timing switched off records nothing; the probe puts a late peer's wait in the barrier
// and leaves the transfer, and never barriers a pipeline's point-to-point. On a GPU (skipped
// without one): a collective on CUDA tensors is timed by events read a step later, never by
// waiting.
#include "trainer/parallel/collective_timer.h"

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <utility>
#include <vector>

#if TESSERA_WITH_CUDA
#include <ATen/cuda/Sleep.h>
#include <torch/cuda.h>
#endif

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "trainer/parallel/distributed.h"
#include "trainer/parallel/mesh.h"
#include "trainer/parallel/peer_wait.h"
#include "trainer/parallel/tensor_parallel.h"

namespace tessera::trainer {
namespace {

// The table's growth since `before`.
CollectiveTable Since(const CollectiveTable& before) {
  CollectiveTable now = CollectiveSnapshot();
  for (size_t i = 0; i < now.size(); ++i) {
    now[i].nanos -= before[i].nanos;
    now[i].calls -= before[i].calls;
    now[i].bytes -= before[i].bytes;
    now[i].peer_wait_nanos -= before[i].peer_wait_nanos;
  }
  return now;
}

int Dim(MeshDim dim) { return static_cast<int>(dim); }

// Ranks as processes, as trainers run: each forked child joins a Gloo group over a FileStore,
// builds its mesh, runs `body` and writes back the growth of the collective table during it;
// returns the sum over the ranks (nullopt, with a test failure, when a child failed or one of
// its expectations did). Every test here that builds groups runs this way: with ranks as threads
// of one process (mesh_threads.h) the process now and then crashed as a rank thread exited,
// glibc finding its heap corrupted (rarely alone; 3 runs in 8 with a rank asleep while its peer
// waited in Gloo, with or without the probe), which a trainer, one rank per process, never is.
std::optional<CollectiveTable> SumOverRankProcesses(
    const MeshShape& shape,
    const std::function<void(int rank, const JoinedGroup& world, const DeviceMesh&)>& body) {
  char pattern[] = "/tmp/collective-timer-test.XXXXXX";
  const char* dir = mkdtemp(pattern);
  if (dir == nullptr) {
    ADD_FAILURE() << "mkdtemp failed";
    return std::nullopt;
  }
  const std::string store_path = std::string(dir) + "/store";
  std::vector<std::pair<pid_t, int>> children;
  for (int rank = 0; rank < shape.world(); ++rank) {
    int fds[2];
    if (pipe(fds) != 0) {
      ADD_FAILURE() << "pipe failed";
      return std::nullopt;
    }
    const pid_t pid = fork();
    if (pid == 0) {
      close(fds[0]);
      at::set_num_threads(1);
      JoinedGroup world;
      world.store = c10::make_intrusive<c10d::FileStore>(store_path, shape.world());
      world.backend = "gloo";
      world.hostname = "127.0.0.1";
      auto group = NewProcessGroup(world.store, rank, shape.world(), v1::DEVICE_TYPE_CPU,
                                   "127.0.0.1", ProcessGroupOptions{});
      if (!group.ok()) _exit(3);
      world.group = *group;
      auto mesh = DeviceMesh::Create(shape, rank, &world, ProcessGroupOptions{});
      if (!mesh.ok() || !Barrier(world).ok()) _exit(4);
      const CollectiveTable before = CollectiveSnapshot();
      body(rank, world, *mesh);
      const CollectiveTable grown = Since(before);
      if (!Barrier(world).ok()) _exit(5);
      const bool written = write(fds[1], &grown, sizeof grown) == sizeof grown;
      _exit(::testing::Test::HasFailure() ? 6 : (written ? 0 : 7));
    }
    close(fds[1]);
    children.emplace_back(pid, fds[0]);
  }
  CollectiveTable sum{};
  bool ok = true;
  for (auto& [pid, fd] : children) {
    CollectiveTable grown;
    const bool read_all = read(fd, &grown, sizeof grown) == sizeof grown;
    close(fd);
    int status = 0;
    waitpid(pid, &status, 0);
    if (!read_all || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      ADD_FAILURE() << "rank process " << pid << " failed (wait status " << status << ")";
      ok = false;
      continue;
    }
    for (size_t i = 0; i < sum.size(); ++i) {
      sum[i].nanos += grown[i].nanos;
      sum[i].calls += grown[i].calls;
      sum[i].bytes += grown[i].bytes;
      sum[i].peer_wait_nanos += grown[i].peer_wait_nanos;
    }
  }
  std::filesystem::remove_all(dir);
  if (!ok) return std::nullopt;
  return sum;
}

TEST(CollectiveTimerTest, NamesKindsAndDimensions) {
  EXPECT_STREQ(CollectiveKindName(CollectiveKind::kAllReduce), "all_reduce");
  EXPECT_STREQ(CollectiveKindName(CollectiveKind::kReduceScatter), "reduce_scatter");
  EXPECT_STREQ(CollectiveKindName(CollectiveKind::kSendRecv), "send_recv");
  EXPECT_STREQ(CollectiveDimName(Dim(MeshDim::kTensor)), "tp");
  EXPECT_STREQ(CollectiveDimName(Dim(MeshDim::kDataContext)), "dcp");
  EXPECT_STREQ(CollectiveDimName(kWorldCollectiveDim), "world");
}

TEST(CollectiveTimerTest, AttributesAllReducesToTheirMeshDimension) {
  constexpr int64_t kBatch = 2, kSeq = 3, kHidden = 8, kDpElements = 16;
  const std::optional<CollectiveTable> summed_table = SumOverRankProcesses(
      MeshShape{.dp = 2, .tp = 2}, [&](int rank, const JoinedGroup&, const DeviceMesh& mesh) {
        SetCollectiveTimingEnabled(true);
        // The row-parallel exit of a tensor-parallel region: one all-reduce over tp.
        TensorParallel tp{
            .group = mesh.group(MeshDim::kTensor), .rank = mesh.coord(MeshDim::kTensor), .size = 2};
        at::Tensor x = torch::full({kBatch, kSeq, kHidden}, static_cast<float>(rank + 1));
        at::Tensor summed = ExitTensorParallel(x, tp);
        // The tp partner holds rank ^ 1 (tp is the innermost dimension).
        EXPECT_FLOAT_EQ(summed[0][0][0].item<float>(),
                        static_cast<float>(rank + 1 + (rank ^ 1) + 1));
        // A dp all-reduce through the same seam as the engine's.
        std::vector<at::Tensor> tensors{torch::ones({kDpElements}, torch::kFloat64)};
        const auto& dp = mesh.group(MeshDim::kData);
        const CollectiveIssue issue =
            IssueCollective(CollectiveKind::kAllReduce, dp.get(), TensorBytes(tensors), false);
        WaitForPeers(dp->allreduce(tensors), issue);
        EXPECT_DOUBLE_EQ(tensors[0][0].item<double>(), 2.0);
      });
  ASSERT_TRUE(summed_table.has_value());
  const CollectiveTable& grown = *summed_table;
  // Summed over the four ranks.
  const CollectiveTotals& tp =
      grown[CollectiveIndex(CollectiveKind::kAllReduce, Dim(MeshDim::kTensor))];
  EXPECT_EQ(tp.calls, 4);
  EXPECT_EQ(tp.bytes, 4 * kBatch * kSeq * kHidden * 4);
  EXPECT_GT(tp.nanos, 0);
  const CollectiveTotals& dp =
      grown[CollectiveIndex(CollectiveKind::kAllReduce, Dim(MeshDim::kData))];
  EXPECT_EQ(dp.calls, 4);
  EXPECT_EQ(dp.bytes, 4 * kDpElements * 8);
  EXPECT_GT(dp.nanos, 0);
  int64_t other_calls = 0;
  for (size_t i = 0; i < grown.size(); ++i) other_calls += grown[i].calls;
  EXPECT_EQ(other_calls, tp.calls + dp.calls) << "collectives recorded under another kind or dim";
}

TEST(CollectiveTimerTest, AWorldSizedDataParallelGroupReadsDp) {
  EXPECT_TRUE(SumOverRankProcesses(MeshShape{.dp = 2}, [&](int, const JoinedGroup& world,
                                                           const DeviceMesh& mesh) {
                EXPECT_EQ(mesh.group(MeshDim::kData).get(), world.group.get());
                EXPECT_EQ(CollectiveDimOf(world.group.get()), Dim(MeshDim::kData));
              }).has_value());
  EXPECT_TRUE(SumOverRankProcesses(MeshShape{.pp = 2, .dp = 2}, [&](int, const JoinedGroup& world,
                                                                    const DeviceMesh& mesh) {
                EXPECT_EQ(CollectiveDimOf(mesh.group(MeshDim::kPipeline).get()),
                          Dim(MeshDim::kPipeline));
                EXPECT_EQ(CollectiveDimOf(mesh.group(MeshDim::kData).get()), Dim(MeshDim::kData));
                EXPECT_EQ(CollectiveDimOf(world.group.get()), kWorldCollectiveDim);
              }).has_value());
}

TEST(CollectiveTimerTest, TimesFromIssueToTheEndOfTheWait) {
  SetCollectiveTimingEnabled(true);
  const CollectiveTable before = CollectiveSnapshot();
  const CollectiveIssue issue = IssueCollective(CollectiveKind::kBroadcast, nullptr, 100, false);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  RecordCollective(issue);
  const CollectiveTotals grown =
      Since(before)[CollectiveIndex(CollectiveKind::kBroadcast, kWorldCollectiveDim)];
  EXPECT_EQ(grown.calls, 1);
  EXPECT_EQ(grown.bytes, 100);
  EXPECT_GE(grown.nanos, 20'000'000);
  EXPECT_LT(grown.nanos, 2'000'000'000);
}

TEST(CollectiveTimerTest, SwitchedOffRecordsNothing) {
  SetCollectiveTimingEnabled(false);
  const CollectiveTable before = CollectiveSnapshot();
  const CollectiveIssue issue = IssueCollective(CollectiveKind::kAllToAll, nullptr, 64, false);
  EXPECT_LT(issue.kind, 0);
  RecordCollective(issue);
  SetCollectiveTimingEnabled(true);
  const CollectiveTable grown = Since(before);
  for (const CollectiveTotals& totals : grown) EXPECT_EQ(totals.calls, 0);
}

// Rank 1 arrives 400 ms late at a dp all-reduce. Unprobed, rank 0's time for it holds that wait;
// probed, the wait lands in the barrier (peer wait) and the all-reduce's own time is its
// transfer, far below the delay. A collective its caller would overlap with 400 ms of compute
// (WaitNowWhenProbing) is likewise timed without that compute. Ranks are processes.
TEST(CollectiveTimerTest, TheProbeSeparatesTheWaitForALatePeerFromTheTransfer) {
  constexpr auto kDelay = std::chrono::milliseconds(400);
  constexpr int64_t kDelayNanos = 400'000'000;
  // Rank 0 may reach the collective a little after rank 1 began its delay (they leave the
  // mesh's barrier within milliseconds of each other): the wait it sees is most of the delay.
  constexpr int64_t kMostOfTheDelay = kDelayNanos * 3 / 4;
  // Far below the delay: a 512-byte all-reduce over loopback, on a loaded machine.
  constexpr int64_t kATransfer = kDelayNanos / 4;
  const int index = CollectiveIndex(CollectiveKind::kAllReduce, Dim(MeshDim::kData));
  auto run = [&](bool probe, bool overlap) -> std::optional<CollectiveTotals> {
    const std::optional<CollectiveTable> table = SumOverRankProcesses(
        MeshShape{.dp = 2}, [&](int rank, const JoinedGroup&, const DeviceMesh& mesh) {
          SetCollectiveTimingEnabled(true);
          SetCollectiveProbeEnabled(probe);
          const auto& dp = mesh.group(MeshDim::kData);
          if (!overlap && rank == 1) std::this_thread::sleep_for(kDelay);
          std::vector<at::Tensor> tensors{torch::ones({64}, torch::kFloat64)};
          CollectiveIssue issue =
              IssueCollective(CollectiveKind::kAllReduce, dp.get(), TensorBytes(tensors), false);
          EXPECT_EQ(issue.probed, probe);
          auto work = dp->allreduce(tensors);
          WaitNowWhenProbing(work, &issue);
          if (overlap) std::this_thread::sleep_for(kDelay);  // compute the collective overlaps
          WaitForPeers(work, issue);
          EXPECT_DOUBLE_EQ(tensors[0][0].item<double>(), 2.0);
          SetCollectiveProbeEnabled(false);
        });
    if (!table.has_value()) return std::nullopt;
    return (*table)[index];
  };
  const std::optional<CollectiveTotals> late = run(/*probe=*/false, /*overlap=*/false);
  ASSERT_TRUE(late.has_value());
  EXPECT_EQ(late->calls, 2);
  EXPECT_GE(late->nanos, kMostOfTheDelay) << "rank 0's issue-to-wait time holds the wait";
  EXPECT_EQ(late->peer_wait_nanos, 0);

  const std::optional<CollectiveTotals> probed = run(/*probe=*/true, /*overlap=*/false);
  ASSERT_TRUE(probed.has_value());
  EXPECT_EQ(probed->calls, 2);
  EXPECT_GE(probed->peer_wait_nanos, kMostOfTheDelay);
  EXPECT_LT(probed->nanos, kATransfer) << "the transfer still holds the wait for the peer";

  const std::optional<CollectiveTotals> overlapped = run(/*probe=*/false, /*overlap=*/true);
  ASSERT_TRUE(overlapped.has_value());
  EXPECT_GE(overlapped->nanos, 2 * kDelayNanos) << "both ranks count the overlapped compute";
  const std::optional<CollectiveTotals> waited_at_once = run(/*probe=*/true, /*overlap=*/true);
  ASSERT_TRUE(waited_at_once.has_value());
  EXPECT_EQ(waited_at_once->calls, 2) << "recorded once, at the early wait";
  EXPECT_LT(waited_at_once->nanos, kATransfer);
}

// Pipeline sends and receives (CollectivePeers::kSome) are issued by some of the group's members
// only: the probe never puts a barrier before them (one would deadlock), and they stay timed from
// issue to wait. Here rank 0 sends twice while rank 1 receives twice and issues nothing else.
TEST(CollectiveTimerTest, TheProbeLeavesPointToPointOfSomeMembersUnbarriered) {
  const std::optional<CollectiveTable> table = SumOverRankProcesses(
      MeshShape{.pp = 2}, [&](int rank, const JoinedGroup&, const DeviceMesh& mesh) {
        SetCollectiveTimingEnabled(true);
        SetCollectiveProbeEnabled(true);
        const auto& pp = mesh.group(MeshDim::kPipeline);
        for (int message = 0; message < 2; ++message) {
          std::vector<at::Tensor> tensors{torch::full({8}, static_cast<float>(message))};
          const CollectiveIssue issue =
              IssueCollective(CollectiveKind::kSendRecv, pp.get(), TensorBytes(tensors), false,
                              CollectivePeers::kSome);
          EXPECT_FALSE(issue.probed);
          WaitForPeers(rank == 0 ? pp->send(tensors, 1, message) : pp->recv(tensors, 0, message),
                       issue);
          if (rank == 1) {
            EXPECT_FLOAT_EQ(tensors[0][0].item<float>(), static_cast<float>(message));
          }
        }
      });
  ASSERT_TRUE(table.has_value());
  const CollectiveTotals& grown =
      (*table)[CollectiveIndex(CollectiveKind::kSendRecv, Dim(MeshDim::kPipeline))];
  EXPECT_EQ(grown.calls, 4);
  EXPECT_EQ(grown.peer_wait_nanos, 0);
}

// The stream is held busy (a spinning kernel) across the collective's window: recording and
// polling return at once and add nothing while the events have not completed; once the stream
// has drained, a poll adds the call with the GPU time between the events.
TEST(CollectiveTimerTest, GpuTimesWithEventsReadAStepLaterWithoutWaiting) {
#if TESSERA_WITH_CUDA
  if (torch::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device visible";
  SetCollectiveTimingEnabled(true);
  PollCollectiveEvents();
  const CollectiveTable before = CollectiveSnapshot();
  const auto host_start = std::chrono::steady_clock::now();
  const CollectiveIssue issue = IssueCollective(CollectiveKind::kAllReduce, nullptr, 4096, true);
  EXPECT_GE(issue.cuda_event, 0);
  at::cuda::sleep(int64_t{1} << 30);  // about half a second on a recent GPU
  RecordCollective(issue);
  PollCollectiveEvents();
  const double host_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - host_start).count();
  const int index = CollectiveIndex(CollectiveKind::kAllReduce, kWorldCollectiveDim);
  EXPECT_EQ(Since(before)[index].calls, 0) << "polled before the stream drained";
  torch::cuda::synchronize();
  PollCollectiveEvents();
  const CollectiveTotals grown = Since(before)[index];
  EXPECT_EQ(grown.calls, 1);
  EXPECT_EQ(grown.bytes, 4096);
  const double gpu_seconds = static_cast<double>(grown.nanos) * 1e-9;
  EXPECT_GT(gpu_seconds, 0.05);
  EXPECT_LT(host_seconds, gpu_seconds / 2) << "recording or polling waited for the GPU";
#else
  GTEST_SKIP() << "built without CUDA";
#endif
}

// WaitForPeers counts the time a collective's wait() blocks.
struct FakeWork {
  absl::Duration blocks;
  void wait() const { absl::SleepFor(blocks); }
};

TEST(PeerWaitTest, CountsTimeBlockedInWait) {
  const double before = PeerWaitSeconds();
  FakeWork work{absl::Milliseconds(60)};
  WaitForPeers(&work);
  const double waited = PeerWaitSeconds() - before;
  EXPECT_GE(waited, 0.055);
  EXPECT_LT(waited, 5.0);
}

}  // namespace
}  // namespace tessera::trainer

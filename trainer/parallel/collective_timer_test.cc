// The collective table on real Gloo groups, ranks as threads (mesh_threads.h): a tensor-parallel
// all-reduce issued by the model's own code path lands in all_reduce/tp with its bytes, a dp
// all-reduce in all_reduce/dp, and nothing elsewhere; a dp-only job's dp group, which is also
// the world group, reads "dp"; timing switched off records nothing. On a GPU (skipped without
// one): a collective on CUDA tensors is timed by events read a step later, never by waiting.
#include "trainer/parallel/collective_timer.h"

#include <chrono>
#include <thread>
#include <vector>

#if TESSERA_WITH_CUDA
#include <ATen/cuda/Sleep.h>
#include <torch/cuda.h>
#endif

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "trainer/parallel/mesh_threads.h"
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
  }
  return now;
}

int Dim(MeshDim dim) { return static_cast<int>(dim); }

TEST(CollectiveTimerTest, NamesKindsAndDimensions) {
  EXPECT_STREQ(CollectiveKindName(CollectiveKind::kAllReduce), "all_reduce");
  EXPECT_STREQ(CollectiveKindName(CollectiveKind::kReduceScatter), "reduce_scatter");
  EXPECT_STREQ(CollectiveKindName(CollectiveKind::kSendRecv), "send_recv");
  EXPECT_STREQ(CollectiveDimName(Dim(MeshDim::kTensor)), "tp");
  EXPECT_STREQ(CollectiveDimName(Dim(MeshDim::kDataContext)), "dcp");
  EXPECT_STREQ(CollectiveDimName(kWorldCollectiveDim), "world");
}

TEST(CollectiveTimerTest, AttributesAllReducesToTheirMeshDimension) {
  SetCollectiveTimingEnabled(true);
  const CollectiveTable before = CollectiveSnapshot();
  constexpr int64_t kBatch = 2, kSeq = 3, kHidden = 8, kDpElements = 16;
  testing::RunMeshThreads(MeshShape{.dp = 2, .tp = 2}, [&](int rank, const JoinedGroup&,
                                                           const DeviceMesh& mesh) {
    // The row-parallel exit of a tensor-parallel region: one all-reduce over tp.
    TensorParallel tp{
        .group = mesh.group(MeshDim::kTensor), .rank = mesh.coord(MeshDim::kTensor), .size = 2};
    at::Tensor x = torch::full({kBatch, kSeq, kHidden}, static_cast<float>(rank + 1));
    at::Tensor summed = ExitTensorParallel(x, tp);
    // The tp partner holds rank ^ 1 (tp is the innermost dimension).
    EXPECT_FLOAT_EQ(summed[0][0][0].item<float>(), static_cast<float>(rank + 1 + (rank ^ 1) + 1));
    // A dp all-reduce through the same seam as the engine's.
    std::vector<at::Tensor> tensors{torch::ones({kDpElements}, torch::kFloat64)};
    const auto& dp = mesh.group(MeshDim::kData);
    const CollectiveIssue issue =
        IssueCollective(CollectiveKind::kAllReduce, dp.get(), TensorBytes(tensors), false);
    WaitForPeers(dp->allreduce(tensors), issue);
    EXPECT_DOUBLE_EQ(tensors[0][0].item<double>(), 2.0);
  });
  const CollectiveTable grown = Since(before);
  // Four ranks (threads) share the process's table.
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
  testing::RunMeshThreads(MeshShape{.dp = 2},
                          [&](int, const JoinedGroup& world, const DeviceMesh& mesh) {
                            EXPECT_EQ(mesh.group(MeshDim::kData).get(), world.group.get());
                            EXPECT_EQ(CollectiveDimOf(world.group.get()), Dim(MeshDim::kData));
                          });
  testing::RunMeshThreads(
      MeshShape{.pp = 2, .dp = 2}, [&](int, const JoinedGroup& world, const DeviceMesh& mesh) {
        EXPECT_EQ(CollectiveDimOf(mesh.group(MeshDim::kPipeline).get()), Dim(MeshDim::kPipeline));
        EXPECT_EQ(CollectiveDimOf(mesh.group(MeshDim::kData).get()), Dim(MeshDim::kData));
        EXPECT_EQ(CollectiveDimOf(world.group.get()), kWorldCollectiveDim);
      });
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

}  // namespace
}  // namespace tessera::trainer

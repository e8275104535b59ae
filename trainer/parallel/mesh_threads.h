// Test support: the ranks of a device mesh as threads of one process, on real Gloo groups over a
// shared in-memory HashStore (c10d's own way of testing several ranks). RunMeshThreads builds
// each rank's world group and DeviceMesh, runs `body` on every rank's thread and joins them; a
// failure to build a rank's group or mesh fails the test. The ranks meet in a world barrier once
// their mesh is built and again after `body`, so that none tears its groups down while a peer is
// still connecting or communicating. The ranks run with one intra-op thread each. Header-only,
// for tests.
#pragma once

#include <ATen/Parallel.h>
#include <cstdlib>
#include <functional>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "trainer/parallel/distributed.h"
#include "trainer/parallel/mesh.h"

namespace tessera::trainer::testing {

inline void RunMeshThreads(
    const MeshShape& shape,
    const std::function<void(int rank, const JoinedGroup& world, const DeviceMesh& mesh)>& body) {
  // c10d's FlightRecorder is one per process and races (crashes inserting into its map) when
  // several process groups of one process record collectives at once, as threads-as-ranks do;
  // a trainer has one rank per process. Off, before the first group exists.
  setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/1);
  // One intra-op thread per rank, as each trainer rank gets (common/trainer_env.h): the ranks
  // share the process's cores as a node's ranks share its cores, and with a team of threads each
  // they oversubscribe them and wait on each other's descheduled threads. The count is
  // process-wide and taken up by each thread on its first parallel op; restored afterwards.
  const int intra_op_threads = at::get_num_threads();
  at::set_num_threads(1);
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::thread> threads;
  for (int rank = 0; rank < shape.world(); ++rank) {
    threads.emplace_back([&, rank] {
      JoinedGroup world;
      world.store = store;
      world.backend = "gloo";
      world.hostname = "127.0.0.1";
      auto group = NewProcessGroup(store, rank, shape.world(), v1::DEVICE_TYPE_CPU, "127.0.0.1",
                                   ProcessGroupOptions{});
      ASSERT_THAT(group, ::tessera::testing::IsOk());
      world.group = *group;
      auto mesh = DeviceMesh::Create(shape, rank, &world, ProcessGroupOptions{});
      ASSERT_THAT(mesh, ::tessera::testing::IsOk());
      // A rank whose groups are connected may otherwise run a body without collectives, return
      // and close its sockets while a slower peer still accepts that connection; the peer then
      // reads "connection closed by peer". Every rank passes both barriers before any leaves.
      ASSERT_THAT(Barrier(world), ::tessera::testing::IsOk());
      body(rank, world, *mesh);
      EXPECT_THAT(Barrier(world), ::tessera::testing::IsOk());
    });
  }
  for (auto& thread : threads) thread.join();
  at::set_num_threads(intra_op_threads);
}

}  // namespace tessera::trainer::testing

#include "trainer/distributed.h"

#include <chrono>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

#define USE_C10D_GLOO 1
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#if TESSERA_WITH_CUDA
#define USE_C10D_NCCL 1
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace tessera::trainer {
namespace {

absl::Status ReadInt(const EnvLookup& env, const char* name, int min_value, int* out) {
  const char* value = env(name);
  if (value == nullptr) return absl::OkStatus();
  int parsed = 0;
  if (!absl::SimpleAtoi(value, &parsed) || parsed < min_value) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, "=", value, ": not an integer >= ", min_value));
  }
  *out = parsed;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::RankAssignment> ResolveRankAssignment(const v1::RankAssignment& assignment,
                                                         const EnvLookup& env) {
  v1::RankAssignment resolved = assignment;
  int rank = resolved.rank(), world = std::max(1, resolved.world_size());
  int local_rank = resolved.local_rank(), local_world = std::max(1, resolved.local_world_size());
  int port = resolved.master_port() > 0 ? resolved.master_port() : 29500;
  for (auto [name, min_value, target] :
       {std::tuple{kRankEnv, 0, &rank}, std::tuple{kWorldSizeEnv, 1, &world},
        std::tuple{kLocalRankEnv, 0, &local_rank}, std::tuple{kLocalWorldSizeEnv, 1, &local_world},
        std::tuple{kMasterPortEnv, 1, &port}}) {
    if (auto status = ReadInt(env, name, min_value, target); !status.ok()) return status;
  }
  if (rank >= world) {
    return absl::InvalidArgumentError(
        absl::StrCat("RANK ", rank, " is not below WORLD_SIZE ", world));
  }
  if (local_rank >= local_world) {
    return absl::InvalidArgumentError(
        absl::StrCat("LOCAL_RANK ", local_rank, " is not below LOCAL_WORLD_SIZE ", local_world));
  }
  if (port > 65535) return absl::InvalidArgumentError(absl::StrCat("MASTER_PORT ", port));
  resolved.set_rank(rank);
  resolved.set_world_size(world);
  resolved.set_local_rank(local_rank);
  resolved.set_local_world_size(local_world);
  resolved.set_master_port(port);
  if (const char* addr = env(kMasterAddrEnv); addr != nullptr) resolved.set_master_addr(addr);
  if (resolved.master_addr().empty()) resolved.set_master_addr("127.0.0.1");
  return resolved;
}

absl::StatusOr<JoinedGroup> JoinProcessGroup(const v1::RankAssignment& assignment,
                                             const ProcessGroupOptions& options) {
  const auto timeout = std::chrono::milliseconds(absl::ToInt64Milliseconds(options.timeout));
  const int rank = assignment.rank(), size = assignment.world_size();
  JoinedGroup joined;
  try {
    c10d::TCPStoreOptions store_options;
    store_options.port = static_cast<uint16_t>(assignment.master_port());
    store_options.isServer = rank == 0;
    store_options.numWorkers = size;
    store_options.waitWorkers = true;
    store_options.timeout = timeout;
    joined.store = c10::make_intrusive<c10d::TCPStore>(assignment.master_addr(), store_options);
    joined.group = c10::make_intrusive<c10d::ProcessGroup>(joined.store, rank, size);
    if (assignment.device_type() == v1::DEVICE_TYPE_CUDA) {
#if TESSERA_WITH_CUDA
      auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
      nccl_options->timeout = timeout;
      auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(joined.store, rank, size,
                                                              std::move(nccl_options));
      joined.group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, nccl);
      joined.group->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
      joined.backend = "nccl";
#else
      return absl::FailedPreconditionError(
          "device_type CUDA: this trainer was built without CUDA (TESSERA_WITH_CUDA=OFF)");
#endif
    } else {
      auto gloo_options = c10d::ProcessGroupGloo::Options::create(timeout);
      gloo_options->devices.push_back(
          c10d::ProcessGroupGloo::createDeviceForHostname(assignment.master_addr()));
      auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(joined.store, rank, size,
                                                              std::move(gloo_options));
      joined.group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
      joined.group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
      joined.backend = "gloo";
    }
  } catch (const c10::Error& e) {
    return absl::UnavailableError(absl::StrCat("rendezvous at ", assignment.master_addr(), ":",
                                               assignment.master_port(), " as rank ", rank, "/",
                                               size, ": ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("rendezvous at ", assignment.master_addr(), ":",
                                               assignment.master_port(), ": ", e.what()));
  }
  return joined;
}

absl::Status Barrier(JoinedGroup& group) {
  try {
    group.group->barrier()->wait();
  } catch (const c10::Error& e) {
    return absl::DeadlineExceededError(absl::StrCat("barrier: ", e.what_without_backtrace()));
  }
  return absl::OkStatus();
}

}  // namespace tessera::trainer

#include "trainer/parallel/distributed.h"

#include <algorithm>
#include <chrono>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

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
  int port = resolved.master_port() > 0 ? resolved.master_port() : kDefaultMasterPort;
  for (auto [name, min_value, target] :
       {std::tuple{kRankEnv, 0, &rank}, std::tuple{kWorldSizeEnv, 1, &world},
        std::tuple{kLocalRankEnv, 0, &local_rank}, std::tuple{kLocalWorldSizeEnv, 1, &local_world},
        std::tuple{kMasterPortEnv, 1, &port}}) {
    if (auto status = ReadInt(env, name, min_value, target); !status.ok()) return status;
  }
  if (rank >= world) {
    return absl::InvalidArgumentError(
        absl::StrCat(kRankEnv, " ", rank, " is not below ", kWorldSizeEnv, " ", world));
  }
  if (local_rank >= local_world) {
    return absl::InvalidArgumentError(absl::StrCat(kLocalRankEnv, " ", local_rank, " is not below ",
                                                   kLocalWorldSizeEnv, " ", local_world));
  }
  if (port > 65535) return absl::InvalidArgumentError(absl::StrCat(kMasterPortEnv, " ", port));
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
    if (rank == 0 && assignment.master_listen_fd() > 0) {
      store_options.masterListenFd = assignment.master_listen_fd();
    }
    store_options.numWorkers = size;
    store_options.waitWorkers = true;
    store_options.timeout = std::chrono::milliseconds(
        absl::ToInt64Milliseconds(std::max(options.rendezvous_timeout, options.timeout)));
    joined.store = c10::make_intrusive<c10d::TCPStore>(assignment.master_addr(), store_options);
    // Gloo binds to this rank's own address: rank 0's would not be local on any other host.
    joined.hostname =
        assignment.node_addr().empty() ? assignment.master_addr() : assignment.node_addr();
    ASSIGN_OR_RETURN(joined.group, NewProcessGroup(joined.store, rank, size,
                                                   assignment.device_type(), joined.hostname,
                                                   options));
    joined.backend = assignment.device_type() == v1::DEVICE_TYPE_CUDA ? "nccl" : "gloo";
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    if (rank == 0 && (absl::StrContains(what, "Address already in use") ||
                      absl::StrContains(what, "EADDRINUSE"))) {
      return absl::AlreadyExistsError(absl::StrCat(
          "rendezvous: rank 0 cannot listen on the master port ", assignment.master_port(), " of ",
          assignment.master_addr(),
          ": another process holds it (address already in use); a restart of the job takes "
          "another port. ",
          what));
    }
    return absl::UnavailableError(absl::StrCat("rendezvous at ", assignment.master_addr(), ":",
                                               assignment.master_port(), " as rank ", rank, "/",
                                               size, ": ", what));
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("rendezvous at ", assignment.master_addr(), ":",
                                               assignment.master_port(), ": ", e.what()));
  }
  return joined;
}

absl::StatusOr<c10::intrusive_ptr<c10d::ProcessGroup>> NewProcessGroup(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, v1::DeviceType device_type,
    const std::string& hostname, const ProcessGroupOptions& options) {
  const auto timeout = std::chrono::milliseconds(absl::ToInt64Milliseconds(options.timeout));
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
  if (device_type == v1::DEVICE_TYPE_CUDA) {
#if TESSERA_WITH_CUDA
    auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
    nccl_options->timeout = timeout;
    auto nccl =
        c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, std::move(nccl_options));
    group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, nccl);
    group->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
#else
    return absl::FailedPreconditionError(
        "device_type CUDA: this trainer was built without CUDA (TESSERA_WITH_CUDA=OFF)");
#endif
  } else {
    auto gloo_options = c10d::ProcessGroupGloo::Options::create(timeout);
    gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
    auto gloo =
        c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, std::move(gloo_options));
    group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
    group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  }
  return group;
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

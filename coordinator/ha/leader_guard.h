// LeadershipInterceptorFactory: the leader's own check on every call it answers (the HA
// contract: a leader acts only while its last lease renewal is less than the lease ago, on its
// monotonic clock). A leader that was paused (SIGSTOP, a stall) longer than its lease may have
// been deposed; its writes are refused by the store's fence, and this refuses its answers to
// tessera.v1.Coordinator and tessera.v1.NodeService calls in the moment before its renewal
// thread notices and ends the process: the status about to be sent becomes UNAVAILABLE
// "coordinator <advertise> lost leadership", which clients and workers treat as any coordinator
// that is going away. Health and reflection are left alone. A stream's messages already sent
// stay sent; its final status is replaced likewise.
//
// Thread safety: `leading` is called on gRPC's threads, concurrently.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "grpcpp/support/server_interceptor.h"

namespace tessera::coordinator {

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
MakeLeadershipInterceptorFactory(std::function<bool()> leading, std::string advertise_address);

}  // namespace tessera::coordinator

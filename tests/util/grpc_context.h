// A client context with a deadline, for tests that call gRPC services.
#pragma once

#include <chrono>
#include <memory>

#include "grpcpp/client_context.h"

namespace tessera::testing {

inline std::unique_ptr<grpc::ClientContext> ContextWithDeadline(int seconds = 10) {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
  return context;
}

}  // namespace tessera::testing

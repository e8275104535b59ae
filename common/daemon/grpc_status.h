// The one place where absl::Status and grpc::Status convert into each other.
// Both use the canonical codes, so the conversion keeps code and message.
#pragma once

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace tessera {

// Payload key of a RESOURCE_EXHAUSTED status carrying the retry delay in
// milliseconds (decimal text); services send it as trailing metadata
// "retry-after-ms".
inline constexpr char kRetryAfterPayload[] = "tessera.dev/retry-after-ms";

// absl::Status -> grpc::Status, keeping code and message.
grpc::Status ToGrpcStatus(const absl::Status& status);

// grpc::Status -> absl::Status, keeping code and message (and error details
// are dropped; Tessera does not send any).
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace tessera

// A minimal blocking HTTP/1.0 GET over loopback, for tests that scrape a
// daemon's Prometheus /metrics endpoint.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tessera::testing {

struct HttpResponse {
  int status_code = 0;
  std::string body;
};

// GET http://127.0.0.1:<port><path>. UNAVAILABLE when nothing listens,
// DEADLINE_EXCEEDED past `timeout`.
absl::StatusOr<HttpResponse> HttpGet(int port, const std::string& path,
                                     absl::Duration timeout = absl::Seconds(10));

}  // namespace tessera::testing

#include "tests/util/wait.h"

#include <algorithm>

#include "absl/time/clock.h"

namespace tessera::testing {

bool WaitUntil(const std::function<bool()>& condition, absl::Duration timeout,
               absl::Duration poll) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    if (condition()) return true;
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return false;
    absl::SleepFor(std::min(poll, left));
  }
}

}  // namespace tessera::testing

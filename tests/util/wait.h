// WaitUntil: how tests wait for something to happen in another thread or process (a job to reach
// a state, a node to register, a file to be reloaded) without a fixed sleep: the condition is
// polled until it holds or a generous deadline passes. This is the one place test code sleeps
// between polls; tests of code that takes a Clock use a SimulatedClock instead.
//
// Thread safety: the condition runs on the calling thread only.
#pragma once

#include <functional>

#include "absl/time/time.h"

namespace tessera::testing {

// How often a condition is polled unless told otherwise.
inline constexpr absl::Duration kDefaultPoll = absl::Milliseconds(20);

// Calls `condition` until it returns true (then true) or `timeout` has passed (then false). The
// condition is always called at least once, and once more at the deadline.
bool WaitUntil(const std::function<bool()>& condition, absl::Duration timeout,
               absl::Duration poll = kDefaultPoll);

}  // namespace tessera::testing

#ifndef FLUXION_COMMON_WAIT_TESTING_H_
#define FLUXION_COMMON_WAIT_TESTING_H_

// Test-only: wait for a condition instead of sleeping for a guessed time. A test that sleeps "long
// enough for X to happen" fails when a loaded machine is slower than the guess, and a test that
// asserts how fast something happened measures the machine. These helpers poll the condition
// until it holds, with a deadline far beyond any scheduling stall, so a test fails only when X
// does not happen at all; what it then asserts is the order of events, not their speed.
//
// Header-only; thread-compatible (each call polls on the calling thread).

#include <utility>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace fluxion {

// How long a test waits for something that, when the code works, happens within milliseconds to
// seconds: reaching it means the thing did not happen, not that the machine was busy.
inline constexpr absl::Duration kGenerousWait = absl::Seconds(60);

// Calls `done` until it returns true or `timeout` has passed, sleeping `poll` between calls.
// Returns whether it returned true (it is asked once more at the deadline, so a condition that
// became true during the last sleep counts).
template <typename Predicate>
bool WaitFor(Predicate&& done, absl::Duration timeout = kGenerousWait,
             absl::Duration poll = absl::Milliseconds(5)) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!done()) {
    if (absl::Now() >= deadline) return done();
    absl::SleepFor(poll);
  }
  return true;
}

// Calls `get` until `want(value)` holds for the value it returned or `timeout` has passed,
// sleeping `poll` between calls. Returns the last value, so the caller's assertion on it shows
// what was seen when the wait gave up.
template <typename Get, typename Want>
auto WaitForValue(Get&& get, Want&& want, absl::Duration timeout = kGenerousWait,
                  absl::Duration poll = absl::Milliseconds(5)) -> decltype(get()) {
  const absl::Time deadline = absl::Now() + timeout;
  auto value = get();
  while (!want(value) && absl::Now() < deadline) {
    absl::SleepFor(poll);
    value = get();
  }
  return value;
}

}  // namespace fluxion

#endif  // FLUXION_COMMON_WAIT_TESTING_H_

// The CPU lane of the ping-pong executor (docs/EXECUTOR.md section 8): while a step is open, the
// work its driver threads (one per micro-batch) would run on the CPU pool -- each layer's CPU
// phase, the error guard's checks, admissions inside the step -- is handed to the thread that
// serves the lane, the thread that called the executor's Step, and runs there one at a time, in
// the order it was submitted.
//
// Why one at a time: the CPU phase is bound by the cores and the host-memory bandwidth, so two at
// once would each get half of both and both finish late. Why on the step's calling thread (not a
// lock the drivers take in turn): libgomp keeps a team of worker threads for
// every thread that starts parallel regions, and once it manages more threads than there are
// CPUs it stops its workers' spinning almost at once (its "throttled" spin count), so that every
// region's start waits for sleeping threads to wake. The drivers starting regions made two teams
// besides the caller's own (which it has from everything else it runs on the pool); one-pipeline
// rows measured after ping-pong rows in the same process were slower too (resident-only plan 0.8
// -> 3.6-4.6 ms a step at 4 x 128K; bench/results/decode-pingpong-*-h200-20261204). Serving the
// work on the caller's
// thread keeps one team.
//
// Outside Open .. Serve, Run runs its function at once on the calling thread (a pipeline stepped
// on its own, e.g. the one-pipeline rows of `fluxion bench decode`).
//
// Thread-safe.
#ifndef FLUXION_DECODE_STEP_CPU_LANE_H_
#define FLUXION_DECODE_STEP_CPU_LANE_H_

#include "absl/base/thread_annotations.h"
#include "absl/container/inlined_vector.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace fluxion::decode {

class CpuLane {
 public:
  CpuLane() = default;
  CpuLane(const CpuLane&) = delete;
  CpuLane& operator=(const CpuLane&) = delete;

  // Runs fn and returns its status: while the lane is open, on the serving thread once every
  // fn submitted before it has run (this call waits); otherwise at once, here. fn must not throw.
  absl::Status Run(absl::FunctionRef<absl::Status()> fn);

  // Opens the lane for `parts` submitters (threads that will call Run and then Leave).
  // REQUIRES: not open; parts >= 0.
  void Open(int parts);
  // One submitter will call Run no more until the next Open.
  void Leave();
  // Runs the submitted functions in order until every submitter has left and none is queued,
  // then closes the lane. REQUIRES: open, and called by one thread.
  void Serve();
  // Functions submitted and not yet taken by Serve (tests wait on it to see a submitter blocked).
  int queued();

 private:
  struct Job {
    absl::FunctionRef<absl::Status()> fn;
    absl::Status result;
    bool done = false;
  };
  bool WorkOrDone() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !queue_.empty() || parts_ == 0;
  }

  absl::Mutex mu_;
  bool open_ ABSL_GUARDED_BY(mu_) = false;
  int parts_ ABSL_GUARDED_BY(mu_) = 0;           // submitters that have not left
  // The submitters' jobs (on their stacks), oldest first: at most one per submitter, so a step's
  // hand-offs allocate nothing.
  absl::InlinedVector<Job*, 4> queue_ ABSL_GUARDED_BY(mu_);
};

// lane->Run(fn), or fn() when there is no lane.
inline absl::Status RunOnLane(CpuLane* lane, absl::FunctionRef<absl::Status()> fn) {
  return lane != nullptr ? lane->Run(fn) : fn();
}

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_STEP_CPU_LANE_H_

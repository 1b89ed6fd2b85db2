// The CPU lane of the ping-pong executor (docs/EXECUTOR.md section 8): the CPU phases of hybrid
// attentions driven from several threads (its two micro-batches' driver threads) run one at a
// time, in the order they were submitted, on the lane's own thread.
//
// Why one at a time: the CPU phase is bound by the cores and the host-memory bandwidth, so two at
// once would each get half of both and both finish late. Why on one thread (not a lock the
// drivers take in turn, as until session 20): libgomp keeps a team of worker threads for every
// thread that starts parallel regions, so two drivers starting the phases' regions made two teams
// of pool-size workers on the same cores; with more threads than cores libgomp throttles its
// workers' spinning, and each region's start then waits for sleeping threads to wake (measured on
// the H200 host: lane waits of up to 30 ms a step and CPU phases up to 2x those of one pipeline,
// bench/results "session 20"). One thread starting every region means one team.
//
// Thread-safe.
#ifndef FLUXION_DECODE_CPU_LANE_H_
#define FLUXION_DECODE_CPU_LANE_H_

#include <deque>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace fluxion::decode {

class CpuLane {
 public:
  // `thread_init` (may be null) runs first on the lane's thread, e.g. to make the CUDA device
  // current there (the phases launch the device's zero-copy reads); when it fails, every Run
  // returns its error instead of running anything.
  explicit CpuLane(std::function<absl::Status()> thread_init = nullptr);
  // Joins the lane's thread. REQUIRES: no Run in progress.
  ~CpuLane();
  CpuLane(const CpuLane&) = delete;
  CpuLane& operator=(const CpuLane&) = delete;

  // Runs fn on the lane's thread once every fn submitted before it has run, and returns fn's
  // status when it has. fn must not throw.
  absl::Status Run(absl::FunctionRef<absl::Status()> fn);

 private:
  struct Job {
    absl::FunctionRef<absl::Status()> fn;
    absl::Status result;
    bool done = false;
  };
  void Loop(const std::function<absl::Status()>& thread_init);

  absl::Mutex mu_;
  std::deque<Job*> queue_ ABSL_GUARDED_BY(mu_);  // the callers' jobs, on their stacks
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: it starts once every other member is built
};

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_CPU_LANE_H_

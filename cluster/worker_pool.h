// A fixed set of threads running jobs from a bounded queue. The HTTP API runs its CPU work
// (parsing, chat template, tokenization) here rather than on its polling thread, so one
// expensive request cannot stall every connection; a full queue is refused at once (the caller
// answers "try later") instead of growing without bound.
//
// Thread-safe.
#ifndef FLUXION_CLUSTER_WORKER_POOL_H_
#define FLUXION_CLUSTER_WORKER_POOL_H_

#include <cstddef>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace fluxion::cluster {

class WorkerPool {
 public:
  // REQUIRES: threads >= 1.
  WorkerPool(int threads, size_t max_queued);
  // Stop().
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Queues `job`; false (and `job` dropped unrun) when every thread is busy and `max_queued`
  // jobs already wait, or the pool is stopping.
  bool TrySubmit(std::function<void()> job);
  // Refuses new jobs, runs every queued one, joins the threads. Idempotent.
  void Stop();

 private:
  void Run();

  const size_t threads_count_;
  const size_t max_queued_;
  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  size_t busy_ ABSL_GUARDED_BY(mu_) = 0;  // threads running a job
  std::vector<std::thread> threads_;
};

}  // namespace fluxion::cluster

#endif  // FLUXION_CLUSTER_WORKER_POOL_H_

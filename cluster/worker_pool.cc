#include "cluster/worker_pool.h"

#include <utility>

namespace fluxion::cluster {

WorkerPool::WorkerPool(int threads, size_t max_queued)
    : threads_count_(static_cast<size_t>(threads)), max_queued_(max_queued) {
  threads_.reserve(threads);
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Run(); });
}

WorkerPool::~WorkerPool() { Stop(); }

bool WorkerPool::TrySubmit(std::function<void()> job) {
  absl::MutexLock lock(&mu_);
  // A job an idle thread is about to take does not count as waiting.
  if (stopping_ || queue_.size() >= max_queued_ + (threads_count_ - busy_)) return false;
  queue_.push_back(std::move(job));
  return true;
}

void WorkerPool::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
}

void WorkerPool::Run() {
  while (true) {
    std::function<void()> job;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || !queue_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping, and nothing is left to run
      job = std::move(queue_.front());
      queue_.pop_front();
      ++busy_;
    }
    job();
    job = nullptr;  // what it holds goes before the thread counts as free
    absl::MutexLock lock(&mu_);
    --busy_;
  }
}

}  // namespace fluxion::cluster

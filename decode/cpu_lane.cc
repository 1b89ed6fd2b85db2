#include "decode/cpu_lane.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace fluxion::decode {

CpuLane::CpuLane(std::function<absl::Status()> thread_init)
    : thread_([this, init = std::move(thread_init)] { Loop(init); }) {}

CpuLane::~CpuLane() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

absl::Status CpuLane::Run(absl::FunctionRef<absl::Status()> fn) {
  Job job{fn, absl::OkStatus()};
  absl::MutexLock lock(&mu_);
  queue_.push_back(&job);
  mu_.Await(absl::Condition(&job.done));
  return std::move(job.result);
}

void CpuLane::Loop(const std::function<absl::Status()>& thread_init) {
  absl::Status init = thread_init ? thread_init() : absl::OkStatus();
  if (!init.ok()) init = absl::Status(init.code(), absl::StrCat("CPU lane: ", init.message()));
  auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); };
  mu_.Lock();
  while (true) {
    mu_.Await(absl::Condition(&ready));
    if (queue_.empty()) break;  // stopping, and nothing is left to run
    Job* job = queue_.front();
    queue_.pop_front();
    mu_.Unlock();
    absl::Status result = init.ok() ? job->fn() : init;
    mu_.Lock();
    job->result = std::move(result);
    job->done = true;
  }
  mu_.Unlock();
}

}  // namespace fluxion::decode

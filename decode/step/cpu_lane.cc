#include "decode/step/cpu_lane.h"

#include <utility>

#include "glog/logging.h"

namespace fluxion::decode {

absl::Status CpuLane::Run(absl::FunctionRef<absl::Status()> fn) {
  Job job{fn, absl::OkStatus()};
  {
    absl::MutexLock lock(&mu_);
    if (open_) {
      queue_.push_back(&job);
      mu_.Await(absl::Condition(&job.done));
      return std::move(job.result);
    }
  }
  return fn();
}

void CpuLane::Open(int parts) {
  absl::MutexLock lock(&mu_);
  CHECK(!open_) << "CpuLane::Open on an open lane";
  CHECK_GE(parts, 0);
  open_ = true;
  parts_ = parts;
}

void CpuLane::Leave() {
  absl::MutexLock lock(&mu_);
  CHECK_GT(parts_, 0) << "CpuLane::Leave without a submitter left";
  --parts_;
}

int CpuLane::queued() {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(queue_.size());
}

void CpuLane::Serve() {
  mu_.Lock();
  CHECK(open_) << "CpuLane::Serve on a closed lane";
  while (true) {
    mu_.Await(absl::Condition(this, &CpuLane::WorkOrDone));
    if (queue_.empty()) break;  // every submitter left
    Job* job = queue_.front();
    queue_.erase(queue_.begin());
    mu_.Unlock();
    absl::Status result = job->fn();
    mu_.Lock();
    job->result = std::move(result);
    job->done = true;
  }
  open_ = false;
  mu_.Unlock();
}

}  // namespace fluxion::decode

#include "decode/window_admitter.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/status/status.h"

namespace fluxion::decode {

WindowAdmitter::WindowAdmitter(ResidentWindow* window, int threads)
    : window_(window), threads_(std::max(threads, 1)), thread_([this] { Loop(); }) {}

WindowAdmitter::~WindowAdmitter() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
  // Finished admissions nobody took: their slots go back.
  for (auto& [id, job] : jobs_) {
    if (job.done && job.result.slot.ok()) window_->Release(*job.result.slot);
  }
}

void WindowAdmitter::Start(uint64_t id, const PagedKv* kv, int64_t score_block_tokens) {
  absl::MutexLock lock(&mu_);
  if (jobs_.contains(id)) return;
  Job& job = jobs_[id];
  job.kv = kv;
  job.score_block_tokens = score_block_tokens;
  job.result.slot = absl::UnavailableError("not admitted yet");
  queue_.push_back(id);
}

bool WindowAdmitter::Done(uint64_t id) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(id);
  return it == jobs_.end() || it->second.done;
}

std::optional<WindowAdmitter::Result> WindowAdmitter::Take(uint64_t id) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(id);
  if (it == jobs_.end()) return std::nullopt;
  auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return jobs_.at(id).done; };
  mu_.Await(absl::Condition(&done));
  Result result = std::move(jobs_.at(id).result);
  jobs_.erase(id);
  return result;
}

void WindowAdmitter::Cancel(uint64_t id) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(id);
  if (it == jobs_.end()) return;
  if (auto q = std::find(queue_.begin(), queue_.end(), id); q != queue_.end()) {
    queue_.erase(q);  // never started: nothing to undo
    jobs_.erase(it);
    return;
  }
  auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return jobs_.at(id).done; };
  mu_.Await(absl::Condition(&done));
  const absl::StatusOr<int>& slot = jobs_.at(id).result.slot;
  if (slot.ok()) window_->Release(*slot);
  jobs_.erase(id);
}

void WindowAdmitter::Loop() {
  // Normal priority: at nice 19 an admission took 4-9x longer and the steps beside it stalled
  // longer still (up to 171 ms at 4 x 32K on the H200 host), likely behind driver locks the
  // starved thread held.
  while (true) {
    uint64_t id = 0;
    Job job;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || !queue_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (stop_) return;
      id = queue_.front();
      queue_.pop_front();
      job = jobs_.at(id);  // its kv stays valid until Take or Cancel returns
    }
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<int> slot = window_->Admit(*job.kv, job.score_block_tokens,
                                              ResidentWindow::AdmitThreads{false, threads_});
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    absl::MutexLock lock(&mu_);
    Job& j = jobs_.at(id);  // Cancel waits for a running job, so it is still here
    j.result = {std::move(slot), seconds};
    j.done = true;
  }
}

}  // namespace fluxion::decode

#include "decode/kv_admission.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace fluxion::decode {

KvAdmission::KvAdmission(KvArena* arena, const KvAdmissionOptions& options)
    : arena_(arena), options_(options), releaser_([this] { ReleaseLoop(); }) {}

KvAdmission::~KvAdmission() {
  std::vector<Held> held;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    held.swap(quarantined_);
  }
  releaser_.join();
  for (Held& h : held) (void)arena_->ReleaseQuarantine(h.runs);
}

absl::StatusOr<std::vector<PageRun>> KvAdmission::Reserve(int64_t pages, absl::Time deadline,
                                                          const std::function<bool()>& cancelled) {
  const int64_t total = arena_->num_pages();
  if (pages <= 0) return absl::InvalidArgumentError("a reservation needs at least one page");
  if (pages + options_.headroom_pages > total) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the request needs ", pages, " KV pages plus ", options_.headroom_pages,
        " pages of headroom; this decode node has ", total,
        " pages in all and can never admit it: shorten the prompt or send it to a node with a "
        "larger arena (--kv-pages)"));
  }
  absl::MutexLock lock(&mu_);
  bool counted = false;
  while (true) {
    const KvArenaCounters c = arena_->counters();
    if (c.free - pages >= options_.headroom_pages) {
      absl::StatusOr<std::vector<PageRun>> runs = arena_->Allocate(pages);
      if (runs.ok()) {
        if (counted) --waiting_;
        return runs;
      }
    }
    if (!counted) {
      if (waiting_ >= options_.max_waiting) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "KV arena full (", c.free, " of ", total, " pages free, ", pages,
            " needed) and ", waiting_, " requests already wait for pages; retry later or on "
            "another decode node"));
      }
      ++waiting_;
      counted = true;
    }
    if (cancelled()) {
      --waiting_;
      return absl::CancelledError("cancelled while waiting for KV pages");
    }
    if (absl::Now() >= deadline) {
      --waiting_;
      return absl::ResourceExhaustedError(absl::StrCat(
          "no room in the KV arena before the deadline: ", pages, " pages needed, ", c.free,
          " of ", total, " free, ", c.quarantined, " quarantined; retry later or on another "
          "decode node"));
    }
    const uint64_t seen = generation_;
    auto changed = [this, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return generation_ != seen;
    };
    mu_.AwaitWithDeadline(absl::Condition(&changed),
                          std::min(deadline, absl::Now() + absl::Milliseconds(50)));
  }
}

void KvAdmission::Free(std::vector<PageRun> runs) {
  if (!runs.empty()) (void)arena_->Free(runs);
  Notify();
}

void KvAdmission::Quarantine(std::vector<PageRun> runs, absl::Time release_at) {
  if (runs.empty()) return;
  (void)arena_->Quarantine(runs);
  absl::MutexLock lock(&mu_);
  quarantined_.push_back({std::move(runs), release_at});
}

void KvAdmission::Notify() {
  absl::MutexLock lock(&mu_);
  ++generation_;
}

int64_t KvAdmission::waiting() const {
  absl::MutexLock lock(&mu_);
  return waiting_;
}

void KvAdmission::ReleaseLoop() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(20));
    const absl::Time now = absl::Now();
    bool released = false;
    for (size_t i = 0; i < quarantined_.size();) {
      if (quarantined_[i].release_at <= now) {
        (void)arena_->ReleaseQuarantine(quarantined_[i].runs);
        quarantined_[i] = std::move(quarantined_.back());
        quarantined_.pop_back();
        released = true;
      } else {
        ++i;
      }
    }
    if (released) ++generation_;
  }
}

}  // namespace fluxion::decode

#include "decode/kv/kv_admission.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace fluxion::decode {

Reservation& Reservation::operator=(Reservation&& other) noexcept {
  if (this == &other) return *this;
  Release();
  arena_ = other.arena_;
  admission_ = other.admission_;
  runs_ = std::move(other.runs_);
  registrations_ = std::move(other.registrations_);
  ranges_ = std::move(other.ranges_);
  peer_may_write_ = other.peer_may_write_;
  lease_ = other.lease_;
  other.runs_.clear();
  other.registrations_.clear();
  other.ranges_.clear();
  other.peer_may_write_ = false;
  return *this;
}

absl::StatusOr<Reservation> Reservation::Allocate(KvArena* arena, int64_t count,
                                                  KvAdmission* admission) {
  absl::StatusOr<std::vector<PageRun>> runs = arena->Allocate(count);
  if (!runs.ok()) return runs.status();
  return Reservation(arena, admission, std::move(*runs));
}

absl::StatusOr<Reservation> Reservation::SplitAfter(int64_t n) {
  if (!registrations_.empty() || peer_may_write_) {
    return absl::FailedPreconditionError(
        "a reservation whose runs are registered or known to a peer cannot be split");
  }
  std::vector<PageRun> head, tail;
  for (const PageRun& r : runs_) {
    const int64_t take = std::max<int64_t>(0, std::min<int64_t>(n, r.count));
    if (take > 0) head.push_back({r.first, static_cast<int32_t>(take)});
    if (take < r.count) {
      tail.push_back({r.first + static_cast<int32_t>(take), r.count - static_cast<int32_t>(take)});
    }
    n -= take;
  }
  runs_ = std::move(head);
  if (tail.empty()) return Reservation();
  return Reservation(arena_, admission_, std::move(tail));
}

absl::Status Reservation::RegisterRuns(transfer::Transport* transport) {
  std::vector<std::unique_ptr<transfer::Registration>> regs;
  std::vector<transfer::PeerDescriptor> ranges;
  for (const PageRun& r : runs_) {
    const transfer::MemoryRegion region{arena_->page(r.first),
                                        static_cast<size_t>(r.count) * arena_->page_bytes()};
    absl::StatusOr<std::unique_ptr<transfer::Registration>> reg =
        transport->Register(region, {/*remote_write=*/true});
    if (!reg.ok()) return reg.status();  // `regs` die here: nothing stays registered
    absl::StatusOr<transfer::PeerDescriptor> described = (*reg)->Describe();
    if (!described.ok()) return described.status();
    ranges.push_back(*std::move(described));
    regs.push_back(*std::move(reg));
  }
  for (auto& reg : regs) registrations_.push_back(std::move(reg));
  for (auto& range : ranges) ranges_.push_back(std::move(range));
  return absl::OkStatus();
}

void Reservation::SetPeerMayWrite(absl::Duration lease) {
  peer_may_write_ = true;
  lease_ = lease;
}

void Reservation::SetPeerStopped() {
  peer_may_write_ = false;
  // Nobody may write here any more: revoke the keys now rather than when the pages are freed, so
  // a stale key cannot reach the pages while their request decodes.
  registrations_.clear();
  ranges_.clear();
}

void Reservation::Release() {
  if (runs_.empty()) {
    registrations_.clear();
    return;
  }
  std::vector<PageRun> runs = std::move(runs_);
  runs_.clear();
  ranges_.clear();
  const bool quarantine = peer_may_write_;
  peer_may_write_ = false;
  if (admission_ != nullptr) {
    admission_->GiveBack(std::move(runs), std::move(registrations_), quarantine, lease_);
    registrations_.clear();
    return;
  }
  // Arena-only pages (no admission keeps a quarantine): a peer that may write keeps them
  // quarantined for good rather than corrupting whoever gets them next.
  registrations_.clear();  // keys first: no write may land after the pages change hands
  absl::Status s = quarantine ? arena_->Quarantine(runs) : arena_->Free(runs);
  (void)s;  // our own bookkeeping: a failure is a bug the arena's counters show
}

KvAdmission::KvAdmission(KvArena* arena, const KvAdmissionOptions& options)
    : arena_(arena), options_(options) {
  if (options_.release_thread) releaser_ = std::thread([this] { ReleaseLoop(); });
}

KvAdmission::~KvAdmission() {
  std::vector<Held> held;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    held.swap(quarantined_);
  }
  if (releaser_.joinable()) releaser_.join();
  for (Held& h : held) {
    h.registrations.clear();
    (void)arena_->ReleaseQuarantine(h.runs);
  }
}

absl::StatusOr<Reservation> KvAdmission::Reserve(int64_t pages, absl::Time deadline,
                                                 const std::function<bool()>& cancelled) {
  const int64_t total = arena_->num_pages();
  if (pages <= 0) return absl::InvalidArgumentError("a reservation needs at least one page");
  if (pages + options_.headroom_pages > total) {
    // Not RESOURCE_EXHAUSTED: waiting or retrying later cannot help. OUT_OF_RANGE says the
    // request is beyond what this node can ever hold; a router tries a node with a larger arena.
    return absl::OutOfRangeError(absl::StrCat(
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
        return Reservation(arena_, this, std::move(*runs));
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
    const absl::Time wake = options_.poll_interval == absl::InfiniteDuration()
                                ? deadline
                                : std::min(deadline, absl::Now() + options_.poll_interval);
    mu_.AwaitWithDeadline(absl::Condition(&changed), wake);
  }
}

void KvAdmission::GiveBack(std::vector<PageRun> runs,
                           std::vector<std::unique_ptr<transfer::Registration>> registrations,
                           bool quarantine, absl::Duration lease) {
  if (quarantine) {
    // The keys stay valid while the peer may still write: revoking them early would make its
    // in-flight writes fail loudly on a NIC but land anyway over transports that do not check.
    (void)arena_->Quarantine(runs);
    absl::MutexLock lock(&mu_);
    quarantined_.push_back({std::move(runs), std::move(registrations), Now() + lease});
    ++stats_.quarantined;
    ++generation_;  // the quarantined count changed; waiters re-read it for their message
    return;
  }
  registrations.clear();  // revoke the keys before anyone else can get the pages
  (void)arena_->Free(runs);
  absl::MutexLock lock(&mu_);
  ++stats_.freed;
  ++generation_;
}

int64_t KvAdmission::ReleaseExpired() {
  std::vector<Held> expired;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = Now();
    for (size_t i = 0; i < quarantined_.size();) {
      if (quarantined_[i].release_at <= now) {
        expired.push_back(std::move(quarantined_[i]));
        quarantined_[i] = std::move(quarantined_.back());
        quarantined_.pop_back();
      } else {
        ++i;
      }
    }
  }
  if (expired.empty()) return 0;
  for (Held& h : expired) {
    h.registrations.clear();  // keys revoked before the pages change hands
    (void)arena_->ReleaseQuarantine(h.runs);
  }
  absl::MutexLock lock(&mu_);
  stats_.lease_expired += expired.size();
  ++generation_;
  return static_cast<int64_t>(expired.size());
}

int64_t KvAdmission::waiting() const {
  absl::MutexLock lock(&mu_);
  return waiting_;
}

KvAdmissionStats KvAdmission::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

void KvAdmission::ReleaseLoop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(20));
      if (stop_) return;
    }
    ReleaseExpired();
  }
}

}  // namespace fluxion::decode

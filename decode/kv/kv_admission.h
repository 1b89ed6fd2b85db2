// Admission to the decode node's KV arena and the one owner of reserved pages.
//
// A request reserves the pages its prompt (and sparse state) needs before anything is prefilled,
// or waits for them in a bounded queue until its deadline, then gets RESOURCE_EXHAUSTED. What it
// gets is a `Reservation`: a move-only object that owns the pages (and the transport
// registrations that let a peer write them) and gives them back when it dies, so that stranding
// pages or forgetting to wake the waiters cannot happen:
//
//   - pages no peer can be writing (never sent, or the peer confirmed it stopped) are freed at
//     once, after their registrations are destroyed (remote keys revoked);
//   - pages a peer may still write (SetPeerMayWrite and no SetPeerStopped) are quarantined for
//     the lease, then their registrations are destroyed and the pages freed (DESIGN.md: a page
//     whose address a peer holds is not reused until the peer confirmed it stopped or the lease
//     has passed);
//   - either way the admission's waiters are woken.
//
// Rule for headroom: a reservation is granted only if `headroom_pages` stay free after it, so
// that running requests can grow by a page per layer and head without preempting at once.
//
// Thread-safe. A Reservation is thread-compatible (one owner at a time).
#ifndef FLUXION_DECODE_KV_KV_ADMISSION_H_
#define FLUXION_DECODE_KV_KV_ADMISSION_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "decode/kv/kv_arena.h"
#include "transfer/transport.h"

namespace fluxion::decode {

class KvAdmission;

// Pages of one arena owned by one holder (a request's prompt, its sparse-state room, a page
// group a growing sequence added). Empty when default-constructed or moved from.
class Reservation {
 public:
  Reservation() = default;
  // Gives the pages back (Release()).
  ~Reservation() { Release(); }
  Reservation(Reservation&& other) noexcept { *this = std::move(other); }
  Reservation& operator=(Reservation&& other) noexcept;
  Reservation(const Reservation&) = delete;
  Reservation& operator=(const Reservation&) = delete;

  // `count` pages straight from `arena`, without headroom or waiting (a running sequence's next
  // page group; preemption handles a shortage). `admission` (may be null) is woken when they come
  // back. ResourceExhausted when fewer are free.
  static absl::StatusOr<Reservation> Allocate(KvArena* arena, int64_t count,
                                              KvAdmission* admission = nullptr);

  bool empty() const { return runs_.empty(); }
  const std::vector<PageRun>& runs() const { return runs_; }
  int64_t pages() const { return CountPages(runs_); }
  KvArena* arena() const { return arena_; }
  KvAdmission* admission() const { return admission_; }

  // Keeps the first `n` pages (in run order) and returns the rest as a reservation of its own
  // (empty when there is no rest). FailedPrecondition (nothing changes) once runs are registered
  // or a peer was told: the ranges describe the runs as they are.
  absl::StatusOr<Reservation> SplitAfter(int64_t n);

  // Registers every run with `transport` as its own remote-writable sub-range of the arena's
  // registered memory: each gives a key scoped to that run. ranges() then describes them, in
  // run order. The registrations are destroyed (keys revoked) when no peer may write any more:
  // at SetPeerStopped(), or when the pages are freed or leave quarantine. Internal/whatever the
  // transport says when it refuses (nothing stays registered then).
  absl::Status RegisterRuns(transfer::Transport* transport);
  const std::vector<transfer::PeerDescriptor>& ranges() const { return ranges_; }
  int64_t registrations() const { return static_cast<int64_t>(registrations_.size()); }

  // A peer holds the pages' addresses and keys from now on and may write until it says it has
  // stopped: if the reservation dies before SetPeerStopped(), the pages are quarantined for
  // `lease` (counted from then), not freed. REQUIRES: made by a KvAdmission (it keeps the
  // quarantine), else the pages would stay quarantined for good.
  void SetPeerMayWrite(absl::Duration lease);
  // The peer confirmed it stopped writing (it replied), or never got the addresses: the keys are
  // revoked now and the pages are free to reuse once the reservation dies.
  void SetPeerStopped();
  bool peer_may_write() const { return peer_may_write_; }

  // Gives the pages back now (what the destructor does); the reservation is empty afterwards.
  void Release();

 private:
  friend class KvAdmission;
  Reservation(KvArena* arena, KvAdmission* admission, std::vector<PageRun> runs)
      : arena_(arena), admission_(admission), runs_(std::move(runs)) {}

  KvArena* arena_ = nullptr;
  KvAdmission* admission_ = nullptr;
  std::vector<PageRun> runs_;
  std::vector<std::unique_ptr<transfer::Registration>> registrations_;
  std::vector<transfer::PeerDescriptor> ranges_;
  bool peer_may_write_ = false;
  absl::Duration lease_ = absl::ZeroDuration();
};

struct KvAdmissionOptions {
  int64_t headroom_pages = 0;
  // Requests waiting for pages at most; one more is refused at once (RESOURCE_EXHAUSTED).
  int64_t max_waiting = 64;
  // How often a waiting Reserve() polls its `cancelled` callback. Pages coming back wake waiters
  // at once whatever this is (tests set it to infinity to prove it).
  absl::Duration poll_interval = absl::Milliseconds(50);
  // Clock of the quarantine leases; null: absl::Now. Tests inject a fake one.
  std::function<absl::Time()> now;
  // Whether a background thread ends expired leases (every 20 ms). Tests that drive the clock
  // turn it off and call ReleaseExpired().
  bool release_thread = true;
};

// Counters of page hand-backs (for metrics), cumulative.
struct KvAdmissionStats {
  uint64_t freed = 0;           // reservations freed at once
  uint64_t quarantined = 0;     // reservations quarantined (a peer may still write)
  uint64_t lease_expired = 0;   // quarantined reservations freed after their lease
};

class KvAdmission {
 public:
  // `arena` must outlive this object, and every Reservation it made must die before it.
  KvAdmission(KvArena* arena, const KvAdmissionOptions& options);
  // Releases every quarantined reservation (the process is ending: nobody will read the pages).
  ~KvAdmission();
  KvAdmission(const KvAdmission&) = delete;
  KvAdmission& operator=(const KvAdmission&) = delete;

  // Reserves `pages` pages, waiting while they are short until `deadline` or until `cancelled()`
  // (polled). OutOfRange at once when `pages` plus the headroom exceed the whole arena (never
  // admissible here: a permanent answer, naming --kv-pages); ResourceExhausted at once when the
  // wait queue is full, after the deadline otherwise; Cancelled when cancelled. The message says
  // which and what to do.
  absl::StatusOr<Reservation> Reserve(int64_t pages, absl::Time deadline,
                                      const std::function<bool()>& cancelled);

  // Frees the quarantined reservations whose lease has passed (the background thread calls it
  // too). Returns how many.
  int64_t ReleaseExpired();

  int64_t waiting() const;
  KvAdmissionStats stats() const;
  int64_t headroom_pages() const { return options_.headroom_pages; }
  KvArena* arena() const { return arena_; }
  absl::Time Now() const { return options_.now ? options_.now() : absl::Now(); }

 private:
  friend class Reservation;
  struct Held {
    std::vector<PageRun> runs;
    std::vector<std::unique_ptr<transfer::Registration>> registrations;
    absl::Time release_at;
  };
  // Called by a dying Reservation: frees `runs` (after revoking `registrations`) or quarantines
  // them until Now() + lease; wakes waiters either way.
  void GiveBack(std::vector<PageRun> runs,
                std::vector<std::unique_ptr<transfer::Registration>> registrations,
                bool quarantine, absl::Duration lease);
  void ReleaseLoop();

  KvArena* const arena_;
  const KvAdmissionOptions options_;
  mutable absl::Mutex mu_;
  int64_t waiting_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;  // bumped whenever pages come back
  std::vector<Held> quarantined_ ABSL_GUARDED_BY(mu_);
  KvAdmissionStats stats_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread releaser_;
};

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_KV_KV_ADMISSION_H_

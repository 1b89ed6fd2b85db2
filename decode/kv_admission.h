// Admission to the decode node's KV arena: a request reserves the pages its prompt (and sparse
// state) needs before anything is prefilled, or waits for them in a bounded queue until its
// deadline, then gets RESOURCE_EXHAUSTED. Also owns the quarantine of pages a peer may still be
// writing: they come back only after a lease (counted from when the peer was last heard of) has
// passed, never at once (DESIGN.md: a page whose address a peer holds is not reused until the
// peer confirmed it stopped or is known dead).
//
// Rule for headroom: a reservation is granted only if `headroom_pages` stay free after it, so
// that running requests can grow by a page per layer and head without preempting at once.
//
// Thread-safe.
#ifndef FLUXION_DECODE_KV_ADMISSION_H_
#define FLUXION_DECODE_KV_ADMISSION_H_

#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "decode/kv_arena.h"

namespace fluxion::decode {

struct KvAdmissionOptions {
  int64_t headroom_pages = 0;
  // Requests waiting for pages at most; one more is refused at once (RESOURCE_EXHAUSTED).
  int64_t max_waiting = 64;
};

class KvAdmission {
 public:
  // `arena` must outlive this object.
  KvAdmission(KvArena* arena, const KvAdmissionOptions& options);
  // Releases every quarantined reservation (the process is ending: nobody will read the pages).
  ~KvAdmission();
  KvAdmission(const KvAdmission&) = delete;
  KvAdmission& operator=(const KvAdmission&) = delete;

  // Reserves `pages` pages, waiting while they are short until `deadline` or until `cancelled()`
  // (polled). ResourceExhausted at once when `pages` plus the headroom exceed the whole arena
  // (never admissible) or the wait queue is full, after the deadline otherwise; Cancelled when
  // cancelled. The message says which and what to do.
  absl::StatusOr<std::vector<PageRun>> Reserve(int64_t pages, absl::Time deadline,
                                               const std::function<bool()>& cancelled);

  // Returns reserved pages to the pool and wakes waiters.
  void Free(std::vector<PageRun> runs);
  // Quarantines reserved pages until `release_at`, then frees them.
  void Quarantine(std::vector<PageRun> runs, absl::Time release_at);
  // Wakes waiters after pages were freed elsewhere (a finished request's PagedKv).
  void Notify();

  int64_t waiting() const;
  int64_t headroom_pages() const { return options_.headroom_pages; }
  KvArena* arena() const { return arena_; }

 private:
  void ReleaseLoop();

  KvArena* const arena_;
  const KvAdmissionOptions options_;
  mutable absl::Mutex mu_;
  int64_t waiting_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;  // bumped whenever pages come back
  struct Held {
    std::vector<PageRun> runs;
    absl::Time release_at;
  };
  std::vector<Held> quarantined_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread releaser_;
};

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_KV_ADMISSION_H_

// The decode node's host KV memory: one arena allocated once at start-up, carved into fixed-size
// pages, handed out to requests in contiguous runs where possible.
//
// Page layout (docs/KV_LAYOUT.md): a page holds `page_tokens` tokens of one layer and one KV head,
// K then V, each bf16 [page_tokens][head_dim]; page `id` starts at base() + id * page_bytes().
// The arena is one mapping so it can be registered with UCX (and pinned for the GPU) once.
//
// Pages move between three states: free -> reserved (Allocate) -> free (Free), or reserved ->
// quarantined (Quarantine: a peer may still be writing into them) -> free (ReleaseQuarantine, once
// the peer confirmed it stopped or is known dead). Allocation reserves everything asked or nothing.
// The served path never calls these directly: pages are held by decode::Reservation
// (decode/kv/kv_admission.h), which makes these transitions when it dies.
//
// Thread-safe: all methods may be called concurrently.
#ifndef FLUXION_DECODE_KV_KV_ARENA_H_
#define FLUXION_DECODE_KV_KV_ARENA_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"

namespace fluxion::decode {

// `count` consecutive pages starting at `first`.
struct PageRun {
  int32_t first = 0;
  int32_t count = 0;
  bool operator==(const PageRun& o) const { return first == o.first && count == o.count; }
};

struct KvArenaOptions {
  // Try explicit huge pages (MAP_HUGETLB, 2 MiB) first, then ask for transparent huge pages.
  // Huge pages cut TLB misses on scattered page reads and let UCX register fewer, larger chunks.
  bool huge_pages = true;
  // Touch every page at creation (MAP_POPULATE), so the first request does not pay the faults.
  bool populate = false;
};

// Something tied to the arena's memory that must end before the memory goes: a registration of
// it with a device (decode/device/cuda_resident_window.h, PinArenaForCuda). The arena owns it.
class ArenaAttachment {
 public:
  virtual ~ArenaAttachment() = default;
};

struct KvArenaCounters {
  int64_t total = 0;
  int64_t free = 0;
  int64_t reserved = 0;
  int64_t quarantined = 0;
};

class KvArena {
 public:
  // Maps num_pages * page_bytes bytes. InvalidArgument for non-positive sizes or a size that
  // overflows; ResourceExhausted when the memory cannot be mapped.
  static absl::StatusOr<std::unique_ptr<KvArena>> Create(size_t page_bytes, int64_t num_pages,
                                                         const KvArenaOptions& options = {});
  // An arena over memory someone else owns (e.g. a UCX-allocated segment from
  // transfer::Transport::Allocate, which peers on this host write into directly): `bytes` from
  // `base` hold bytes / page_bytes pages; the memory must outlive the arena and is not unmapped.
  // InvalidArgument for a null base or fewer bytes than one page.
  static absl::StatusOr<std::unique_ptr<KvArena>> Over(uint8_t* base, size_t bytes,
                                                       size_t page_bytes);
  ~KvArena();
  KvArena(const KvArena&) = delete;
  KvArena& operator=(const KvArena&) = delete;

  uint8_t* base() const { return base_; }
  size_t bytes() const { return bytes_; }
  size_t page_bytes() const { return page_bytes_; }
  int64_t num_pages() const { return num_pages_; }
  // True when the mapping is backed by explicit huge pages (MAP_HUGETLB).
  bool explicit_huge_pages() const { return explicit_huge_pages_; }
  // Keeps `a` until the arena dies; attachments end (latest first) before the memory is unmapped.
  void Attach(std::unique_ptr<ArenaAttachment> a);
  // REQUIRES: 0 <= id < num_pages().
  uint8_t* page(int32_t id) const { return base_ + static_cast<size_t>(id) * page_bytes_; }

  // Reserves `count` pages as few runs as possible: one run if any free extent is large enough
  // (the smallest such, to keep big extents for big requests), else the largest extents first.
  // ResourceExhausted (nothing reserved) when fewer than `count` pages are free;
  // InvalidArgument for count <= 0.
  absl::StatusOr<std::vector<PageRun>> Allocate(int64_t count);

  // Returns reserved pages to the free pool. FailedPrecondition (and nothing changes) if any page
  // in `runs` is not currently reserved: a double free is a bug we report instead of corrupting.
  absl::Status Free(absl::Span<const PageRun> runs);

  // Moves reserved pages to quarantine: a peer holds their address and may still write.
  absl::Status Quarantine(absl::Span<const PageRun> runs);
  // Frees quarantined pages once the peer is known to have stopped writing.
  absl::Status ReleaseQuarantine(absl::Span<const PageRun> runs);

  KvArenaCounters counters() const;

 private:
  enum class State : uint8_t { kFree, kReserved, kQuarantined };
  KvArena(uint8_t* base, size_t bytes, size_t page_bytes, int64_t num_pages, bool huge,
          bool owned = true);
  absl::Status Transition(absl::Span<const PageRun> runs, State from, State to)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AddFreeExtent(int32_t first, int32_t count) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RemoveFreeExtent(int32_t first, int32_t count) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  uint8_t* const base_;
  const size_t bytes_;
  const size_t page_bytes_;
  const int64_t num_pages_;
  const bool explicit_huge_pages_;
  const bool owned_;  // unmapped on destruction
  std::vector<std::unique_ptr<ArenaAttachment>> attachments_ ABSL_GUARDED_BY(mu_);

  mutable absl::Mutex mu_;
  std::vector<State> state_ ABSL_GUARDED_BY(mu_);
  // Free extents, coalesced: first page -> count, and (count, first) ordered for best fit.
  std::map<int32_t, int32_t> free_by_first_ ABSL_GUARDED_BY(mu_);
  std::set<std::pair<int32_t, int32_t>> free_by_size_ ABSL_GUARDED_BY(mu_);
  int64_t free_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t quarantined_ ABSL_GUARDED_BY(mu_) = 0;
};

// Total pages in `runs`.
int64_t CountPages(absl::Span<const PageRun> runs);

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_KV_KV_ARENA_H_

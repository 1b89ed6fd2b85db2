// The bounded host memory a prompt's KV pages pass through on their way to the decode node
// (issue 15): a slot is filled with pages (packed on the CPU path, copied from HBM on the GPU
// path), its writes are submitted from it, and its bytes are reused only once every one of those
// writes has completed. Before, the prefill node staged a whole prompt (16 GiB of pinned memory at
// 128K with Llama-3.1-8B shapes, held from start-up); the ring needs what is in flight on the
// link, and the pages that do not fit yet wait where they were computed (the model's cache, HBM),
// so the compute never waits on the link: the engine tries, and sends the rest later.
//
// Slots are taken in order and freed in order (the oldest first): a write that never completes
// holds its slot and every slot after it, which is what a stalled link should do.
//
// Not thread-safe: one request's sends use it from one thread at a time.
#ifndef FLUXION_PREFILL_STAGING_RING_H_
#define FLUXION_PREFILL_STAGING_RING_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transfer/transport.h"

namespace fluxion::prefill {

class StagingRing {
 public:
  // `memory` (`capacity` bytes) is the caller's; it must outlive every write submitted from it
  // (WaitAll, or the writes' failure).
  StagingRing(uint8_t* memory, size_t capacity);
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;

  size_t capacity() const { return capacity_; }
  size_t in_flight_bytes() const;
  bool empty() const { return slots_.empty(); }

  // `bytes` of contiguous room, after freeing the slots whose writes completed; null while the
  // writes in flight hold the room. Never blocks. The room is the caller's until the next
  // TryAcquire; Commit makes it a slot. InvalidArgument for more than the capacity (or zero);
  // the first error of a completed write (the same error is returned once).
  absl::StatusOr<uint8_t*> TryAcquire(size_t bytes);
  // The writes submitted from the room the last TryAcquire returned: the room is reused once all
  // of them completed. REQUIRES: a TryAcquire returned room since the last Commit.
  void Commit(std::vector<std::unique_ptr<transfer::TransferHandle>> writes);
  // Waits until `deadline` for the oldest slot's writes and frees it. OK also when none is in
  // flight; the writes' error (DeadlineExceeded: still in flight, the slot stays held).
  absl::Status WaitOldest(absl::Time deadline);
  // WaitOldest until none is left; the first error (the slots after a timed-out one are kept).
  absl::Status WaitAll(absl::Time deadline);

 private:
  struct Slot {
    size_t offset = 0, bytes = 0;
    std::vector<std::unique_ptr<transfer::TransferHandle>> writes;
  };
  // Frees the oldest slots whose writes all completed, stopping at the first still in flight.
  absl::Status Reclaim();
  // Where `bytes` fit in the free room, or capacity_ when they do not.
  size_t Place(size_t bytes) const;

  uint8_t* const memory_;
  const size_t capacity_;
  std::deque<Slot> slots_;  // oldest first
  size_t acquired_offset_ = 0, acquired_bytes_ = 0;
  bool acquired_ = false;
};

}  // namespace fluxion::prefill

#endif  // FLUXION_PREFILL_STAGING_RING_H_

#include "prefill/staging_ring.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace fluxion::prefill {

StagingRing::StagingRing(uint8_t* memory, size_t capacity) : memory_(memory), capacity_(capacity) {}

size_t StagingRing::in_flight_bytes() const {
  size_t bytes = 0;
  for (const Slot& s : slots_) bytes += s.bytes;
  return bytes;
}

size_t StagingRing::Place(size_t bytes) const {
  if (slots_.empty()) return 0;
  const Slot &oldest = slots_.front(), &newest = slots_.back();
  const size_t tail = oldest.offset, head = newest.offset + newest.bytes;
  if (newest.offset >= oldest.offset) {  // one run [tail, head): room after it, then before it
    if (capacity_ - head >= bytes) return head;
    if (tail >= bytes) return 0;
    return capacity_;
  }
  // Wrapped: [tail, capacity) and [0, head) are taken.
  return tail - head >= bytes ? head : capacity_;
}

absl::Status StagingRing::Reclaim() {
  absl::Status first;
  while (!slots_.empty()) {
    auto& writes = slots_.front().writes;
    for (auto it = writes.begin(); it != writes.end();) {
      absl::StatusOr<bool> done = (*it)->Poll();
      if (done.ok() && !*done) break;
      if (!done.ok() && first.ok()) first = done.status();  // a failed write is over too
      it = writes.erase(it);
    }
    if (!writes.empty()) break;
    slots_.pop_front();
  }
  return first;
}

absl::StatusOr<uint8_t*> StagingRing::TryAcquire(size_t bytes) {
  if (bytes == 0 || bytes > capacity_) {
    return absl::InvalidArgumentError(absl::StrCat("a staging slot of ", bytes,
                                                   " bytes does not fit a ring of ", capacity_));
  }
  if (absl::Status s = Reclaim(); !s.ok()) return s;
  const size_t at = Place(bytes);
  if (at == capacity_) return nullptr;
  acquired_ = true;
  acquired_offset_ = at;
  acquired_bytes_ = bytes;
  return memory_ + at;
}

void StagingRing::Commit(std::vector<std::unique_ptr<transfer::TransferHandle>> writes) {
  CHECK(acquired_) << "StagingRing::Commit without room acquired";
  acquired_ = false;
  slots_.push_back(Slot{acquired_offset_, acquired_bytes_, std::move(writes)});
}

absl::Status StagingRing::WaitOldest(absl::Time deadline) {
  if (slots_.empty()) return absl::OkStatus();
  auto& writes = slots_.front().writes;
  absl::Status first;
  for (auto it = writes.begin(); it != writes.end();) {
    absl::Status s = (*it)->Wait(std::max(absl::ZeroDuration(), deadline - absl::Now()));
    // Still in flight: the copies may yet read the slot, so it stays held.
    if (absl::IsDeadlineExceeded(s)) return s;
    if (!s.ok() && first.ok()) first = s;
    it = writes.erase(it);
  }
  slots_.pop_front();
  return first;
}

absl::Status StagingRing::WaitAll(absl::Time deadline) {
  absl::Status first;
  while (!slots_.empty()) {
    absl::Status s = WaitOldest(deadline);
    if (absl::IsDeadlineExceeded(s)) return first.ok() ? s : first;
    if (!s.ok() && first.ok()) first = s;
  }
  return first;
}

}  // namespace fluxion::prefill

// Pieces shared by the Transport implementations: completion state behind a TransferHandle,
// metrics counters, the table of local registrations used to validate copy sources, and batch
// validation. Not part of the seam; included only by transfer/*.cc.
#ifndef FLUXION_TRANSFER_TRANSPORT_INTERNAL_H_
#define FLUXION_TRANSFER_TRANSPORT_INTERNAL_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "transfer/transport.h"

namespace fluxion::transfer::internal {

// Lock-free counters behind Transport::metrics(). Shared (shared_ptr) with completion states, which
// may outlive their transport. Thread-safe.
class MetricsRecorder {
 public:
  enum class Failure { kInvalidArgument, kIncompatible, kUnavailable, kDeadline, kOther };

  void AddSubmitted(uint64_t copies, uint64_t ops);
  void AddCompleted(uint64_t bytes, absl::Duration latency);
  void AddFailure(Failure cause);
  // Counts a failed status by its code (Unavailable, DeadlineExceeded, InvalidArgument, ...).
  void AddFailure(const absl::Status& status);
  void AddRegistration(int64_t count, int64_t bytes);
  // The target side: bytes landed in our registrations, a refused write message, a revocation
  // that timed out with receives in flight.
  void AddLanded(uint64_t bytes);
  void AddLandingRefused();
  void AddLandingRevokeTimeout();
  TransportMetrics Snapshot() const;

 private:
  std::atomic<uint64_t> bytes_written_{0}, copies_submitted_{0}, ops_issued_{0},
      batches_submitted_{0}, batches_completed_{0}, latency_sum_us_{0}, landed_bytes_{0},
      landing_refused_{0}, landing_revoke_timeouts_{0};
  std::atomic<int64_t> registrations_{0}, registered_bytes_{0};
  std::atomic<uint64_t> failures_[5] = {};
  std::atomic<uint64_t> latency_buckets_[TransportMetrics::kLatencyBoundsUs.size() + 1] = {};
};

// The result of one batch, set once by whoever learns it (a UCX callback, a loopback memcpy, a
// shutdown) and read by TransferHandle. Thread-safe.
class CompletionState {
 public:
  // `is_batch`: a Write() batch (its outcome feeds the batch metrics), not a Flush().
  CompletionState(std::shared_ptr<MetricsRecorder> metrics, uint64_t bytes, bool is_batch = true);
  // Sets the outcome; later calls are ignored (the first outcome wins). Records metrics.
  void Complete(absl::Status status);
  bool done() const;
  absl::StatusOr<bool> Poll() const;
  absl::Status Wait(absl::Duration timeout) const;

 private:
  const std::shared_ptr<MetricsRecorder> metrics_;
  const uint64_t bytes_;
  const bool is_batch_;
  const absl::Time start_;
  mutable absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

// A TransferHandle over a shared CompletionState.
class StateHandle final : public TransferHandle {
 public:
  explicit StateHandle(std::shared_ptr<CompletionState> state) : state_(std::move(state)) {}
  absl::StatusOr<bool> Poll() override { return state_->Poll(); }
  absl::Status Wait(absl::Duration timeout) override { return state_->Wait(timeout); }

 private:
  std::shared_ptr<CompletionState> state_;
};

// The local registrations of one transport, by address, so that Write() can check that every copy
// source lies inside one (and find the implementation's handle for it). Overlapping entries are
// allowed (a narrower registration inside the arena). Thread-safe.
class LocalRegistry {
 public:
  // `cookie` is the implementation's handle for the entry (e.g. a ucp_mem_h); `id` must be unique.
  void Add(uint64_t id, uintptr_t base, size_t length, void* cookie);
  void Remove(uint64_t id);
  // The cookie of a registration containing [addr, addr + length), or NotFound.
  absl::StatusOr<void*> Find(uintptr_t addr, size_t length) const;

 private:
  struct Entry {
    uint64_t id;
    size_t length;
    void* cookie;
  };
  mutable absl::Mutex mu_;
  std::multimap<uintptr_t, Entry> by_base_ ABSL_GUARDED_BY(mu_);
  size_t max_length_ ABSL_GUARDED_BY(mu_) = 0;
};

// True when [addr, addr + length) lies inside [base, base + limit), without overflow.
bool RangeInside(uint64_t addr, uint64_t length, uint64_t base, uint64_t limit);

// Checks a batch against the target range and the local registry, as Transport::Write()
// documents: InvalidArgument naming the first bad copy.
absl::Status ValidateBatch(absl::Span<const BlockCopy> copies, uint64_t remote_base,
                           uint64_t remote_length, const LocalRegistry& local);

// Total bytes of `copies`.
uint64_t TotalBytes(absl::Span<const BlockCopy> copies);

}  // namespace fluxion::transfer::internal

#endif  // FLUXION_TRANSFER_TRANSPORT_INTERNAL_H_

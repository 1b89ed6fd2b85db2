// The target side of target-checked landings (docs/TRANSFER.md, "Target-checked landings"): the
// table of live landings of one UCX transport and the active-message handlers that land writes
// into them. Every byte a peer writes into this process through the UCX transport passes
// LandingTable::OnWrite, which checks, before memory is touched, that the message's token names a
// live landing and that [remote_addr, remote_addr + length) lies inside it; anything else is
// dropped, counted, logged (rate-limited) and reported in the batch's ack.
//
// Eager messages are copied inside the handler. Rendezvous messages are received with
// ucp_am_recv_data_nbx into the checked destination; the receive finishes later, so a landing
// counts its receives in flight and Close() waits for them (bounded). Per-batch tallies answer the
// writer's fence: how many messages landed, were refused or are still being received.
//
// Bounds against a hostile peer (UcxOptions::LandingLimits): at most max_batches tallies (the
// least recently touched idle ones are evicted, idle ones expire after batch_idle), at most
// max_receives rendezvous receives in flight (further ones are refused), acks are sent only inside
// the fence's own callback (the reply endpoint is valid there and nowhere else), and no header can
// make the handler read or write outside what it checked.
//
// What this cannot stop: a peer that speaks raw UCT (UCT's tcp transport executes PUT requests
// to any address) or forges UCX's own protocol messages; docs/TRANSFER.md, "Remote-key scope".
//
// Thread-safety: every method and every handler runs with the transport's worker lock held (the
// handlers run inside ucp_worker_progress, which the transport calls with it held); the public
// methods assert it (AssertHeld), since the owner's lock annotation cannot name this table's.
#ifndef FLUXION_TRANSFER_UCX_LANDING_H_
#define FLUXION_TRANSFER_UCX_LANDING_H_

#include <ucp/api/ucp.h>

#include <cstdint>
#include <memory>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "transfer/landing_wire.h"
#include "transfer/transport_internal.h"
#include "transfer/ucx_handles.h"
#include "transfer/ucx_transport.h"

namespace fluxion::transfer::ucx {

class LandingTable {
 public:
  // `worker_mu`: the transport's worker lock, held around every call and every UCX callback.
  LandingTable(absl::Mutex* worker_mu, std::shared_ptr<internal::MetricsRecorder> metrics,
               const UcxOptions::LandingLimits& limits);
  // REQUIRES: the worker this table is attached to is destroyed (no handler or receive callback
  // can run any more), and the context still exists (parked memory handles are unmapped here).
  ~LandingTable() = default;
  LandingTable(const LandingTable&) = delete;
  LandingTable& operator=(const LandingTable&) = delete;

  // Every method REQUIRES the worker lock.

  // Registers the write and fence handlers on `worker`.
  absl::Status Attach(ucp_worker_h worker);

  // Opens a landing over [base, base + length). `memh`: the region's UCX memory handle, handed to
  // rendezvous receives into it (it must stay mapped until Close returns true, or is parked).
  absl::StatusOr<landing::Token> Open(uintptr_t base, size_t length, ucp_mem_h memh);

  // Revokes a landing: its token is removed at once, so every later message naming it is
  // refused. Rendezvous receives already issued into it are waited for, up to `timeout` (the lock
  // is released meanwhile so that the progress thread can finish them). true: nothing can land
  // in the region any more, and `memory` is handed back to be unmapped by the caller. false: some
  // receives are still in flight (a peer that stopped sending mid-message); UCX 1.13 cannot cancel
  // them, so they may still land later: `memory` is kept mapped until they end, counted in
  // landing_revoke_timeouts and logged.
  bool Close(const landing::Token& token, absl::Duration timeout,
             std::unique_ptr<MemoryHandle>* memory);

  // Drops tallies idle for longer than LandingLimits::batch_idle. The progress thread calls it.
  void Sweep(absl::Time now);

  // Tallies kept now (tests).
  size_t BatchesForTesting() const {
    worker_mu_->AssertHeld();
    return tallies_.size();
  }

 private:
  struct Landing {
    uintptr_t base = 0;
    size_t length = 0;
    ucp_mem_h memh = nullptr;
    uint64_t in_flight = 0;  // rendezvous receives into it
    // The registration's mapping, kept here when Close timed out with receives in flight.
    std::unique_ptr<MemoryHandle> parked;
  };
  using BatchKey = std::pair<uint64_t, uint64_t>;  // writer stream, batch
  struct Tally {
    uint64_t accepted = 0;
    uint64_t accepted_bytes = 0;
    uint64_t refused = 0;
    uint64_t in_flight = 0;
    landing::Refusal first_refusal = landing::Refusal::kNone;
    absl::Time touched;
  };
  struct Receive {
    LandingTable* table;
    BatchKey batch;
    std::shared_ptr<Landing> landing;
    size_t length;
  };

  static ucs_status_t OnWrite(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnFence(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param);
  static void OnReceiveDone(void* request, ucs_status_t status, size_t length, void* user_data);
  static void OnAckSent(void* request, ucs_status_t status, void* user_data);

  ucs_status_t Write(const void* header, size_t header_length, void* data, size_t length,
                     bool rendezvous) ABSL_EXCLUSIVE_LOCKS_REQUIRED(*worker_mu_);
  void Fence(const void* header, size_t header_length, size_t length,
             const ucp_am_recv_param_t* param) ABSL_EXCLUSIVE_LOCKS_REQUIRED(*worker_mu_);
  // The batch's tally, created if new (evicting idle ones when full); null when the table is full
  // of batches with receives in flight.
  Tally* TallyFor(const BatchKey& key, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(*worker_mu_);
  void Refuse(Tally* tally, landing::Refusal why, const landing::WriteHeader* h, size_t length)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(*worker_mu_);
  // LOG(WARNING) at most once a second; the rest are counted and reported with the next one.
  void LogRateLimited(const std::string& what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(*worker_mu_);

  absl::Mutex* const worker_mu_;
  const std::shared_ptr<internal::MetricsRecorder> metrics_;
  const UcxOptions::LandingLimits options_;
  ucp_worker_h worker_ ABSL_GUARDED_BY(*worker_mu_) = nullptr;
  absl::flat_hash_map<landing::Token, std::shared_ptr<Landing>> landings_
      ABSL_GUARDED_BY(*worker_mu_);
  absl::flat_hash_map<BatchKey, Tally> tallies_ ABSL_GUARDED_BY(*worker_mu_);
  absl::flat_hash_map<Receive*, std::unique_ptr<Receive>> receives_ ABSL_GUARDED_BY(*worker_mu_);
  absl::Time last_log_ ABSL_GUARDED_BY(*worker_mu_) = absl::InfinitePast();
  uint64_t suppressed_logs_ ABSL_GUARDED_BY(*worker_mu_) = 0;
};

}  // namespace fluxion::transfer::ucx

#endif  // FLUXION_TRANSFER_UCX_LANDING_H_

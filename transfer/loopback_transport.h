// In-process Transport: copies are memcpy between registrations of transports living in the same
// process. It checks as the UCX transport does: the writer refuses a write outside the target's
// registered range (InvalidArgument before any byte moves), and the target re-checks every copy
// when it lands against the registration as it is then, so a stale or forged descriptor fails
// the batch (FailedPrecondition) and nothing lands. Connect() also refuses a descriptor whose
// range its registration does not cover (UCX cannot tell before the first write). Used by unit
// tests and by in-process service tests.
//
// Progress model: a batch is copied on the writer's thread inside Write(), unless the target's
// progress is paused (SetProgressPausedForTesting), in which case it waits in the target's queue,
// as it would behind a UCX target whose worker is not progressed.
//
// Thread-safe: every method may be called from any thread.
#ifndef FLUXION_TRANSFER_LOOPBACK_TRANSPORT_H_
#define FLUXION_TRANSFER_LOOPBACK_TRANSPORT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "transfer/transport.h"
#include "transfer/transport_internal.h"

namespace fluxion::transfer {

struct LoopbackOptions {
  // PeerDescriptor::peer_name of this node.
  std::string node_name = "loopback";
  // What this node serves; Connect() compares peers against it.
  CompatibilityRecord compat;
};

namespace loopback_internal {
class Core;
}

class LoopbackTransport final : public Transport {
 public:
  explicit LoopbackTransport(const LoopbackOptions& options);
  // Batches queued into this transport's memory fail with Unavailable; batches this transport
  // wrote that have not landed are cancelled (Unavailable) so that no copy reads our memory later.
  ~LoopbackTransport() override;
  LoopbackTransport(const LoopbackTransport&) = delete;
  LoopbackTransport& operator=(const LoopbackTransport&) = delete;

  absl::string_view kind() const override { return "loopback"; }
  absl::StatusOr<std::unique_ptr<Registration>> Register(
      MemoryRegion region, const RegistrationOptions& options = {}) override;
  absl::StatusOr<std::unique_ptr<RemoteTarget>> Connect(const PeerDescriptor& peer) override;
  absl::StatusOr<std::unique_ptr<TransferHandle>> Write(const RemoteTarget& target,
                                                        absl::Span<const BlockCopy> copies,
                                                        const WriteOptions& options = {}) override;
  absl::Status Flush(absl::Duration timeout) override;
  TransportMetrics metrics() const override { return metrics_->Snapshot(); }

  // Test hook. While paused, batches written into this transport's registrations are queued, not
  // copied; unpausing copies them in submission order on the calling thread.
  void SetProgressPausedForTesting(bool paused);
  // Test hook: the batches queued while paused.
  size_t QueuedWritesForTesting() const;

 private:
  friend class LoopbackRegistration;
  void Deregister(uint64_t id, size_t length);

  const LoopbackOptions options_;
  const std::shared_ptr<internal::MetricsRecorder> metrics_;
  // This transport's memory as a target, shared with peers (they hold it weakly).
  const std::shared_ptr<loopback_internal::Core> core_;
  internal::LocalRegistry local_;

  struct Outstanding {
    std::weak_ptr<loopback_internal::Core> peer;
    std::shared_ptr<internal::CompletionState> state;
  };
  absl::Mutex mu_;
  // Batches this transport wrote that may not have landed yet (pruned as they complete).
  std::vector<Outstanding> outstanding_ ABSL_GUARDED_BY(mu_);
};

std::unique_ptr<Transport> NewLoopbackTransport(const LoopbackOptions& options);

}  // namespace fluxion::transfer

#endif  // FLUXION_TRANSFER_LOOPBACK_TRANSPORT_H_

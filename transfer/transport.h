// The transfer seam: how the prefill node writes KV pages straight into the decode node's host
// arena. One model for every implementation (NIXL, Mooncake, TensorRT-LLM's transfer agent):
// register memory, describe it to a peer, connect from the peer's descriptor, submit a batch of
// copies, wait for it with a deadline. docs/TRANSFER.md explains the design and the UCX progress
// model; docs/PROTOCOL.md says how descriptors travel in `Prefill`.
//
// Two implementations: UCX (transfer/ucx_transport.h, the real one) and loopback
// (transfer/loopback_transport.h: memcpy inside one process, for unit tests). The same
// conformance suite (transfer/transport_conformance_test.cc) runs over both.
//
// Lifetimes, in one place:
//   - A Registration and a RemoteTarget must be destroyed before the Transport that made them.
//   - Memory written by copies (both the local source and the remote destination) must stay valid
//     until the copies' handle reports completion, or the peer is known dead.
//   - A TransferHandle may outlive everything; destroying it does NOT cancel or wait for its
//     copies (every wait in this seam has a deadline, so no destructor blocks).
#ifndef FLUXION_TRANSFER_TRANSPORT_H_
#define FLUXION_TRANSFER_TRANSPORT_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace fluxion::transfer {

// Version of what a descriptor means (its fields, and how writes land in the page layout). Peers
// with different versions refuse to connect. Matches fluxion.v1.ProtocolVersion.
inline constexpr uint32_t kTransferProtocolVersion = 1;

// A range of this process's memory, in bytes.
struct MemoryRegion {
  void* addr = nullptr;
  size_t length = 0;
};

// What both ends must agree on before one writes KV pages into the other: the model and the page
// layout (fluxion.v1.ModelLayout) plus the protocol version. Compared field by field at Connect().
struct CompatibilityRecord {
  uint32_t protocol_version = kTransferProtocolVersion;
  // Identifies the exact weights (ModelLayout.model_hash, or model_id where no hash exists).
  // Compared for equality.
  std::string model_id;
  // Element type of K and V in pages: a fluxion.v1.DType value.
  uint32_t kv_dtype = 0;
  uint32_t num_layers = 0;
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  // The page layout: tokens per page and the layout version (docs/PROTOCOL.md, "KV page layout").
  uint32_t page_tokens = 0;
  uint32_t layout_version = 0;

  bool operator==(const CompatibilityRecord& o) const;
  bool operator!=(const CompatibilityRecord& o) const { return !(*this == o); }
};

// OK when a peer advertising `remote` may exchange KV with a node configured as `local`;
// otherwise FailedPrecondition naming the first differing field and both values
// ("num_kv_heads: 8 here, 4 at peer").
absl::Status CheckCompatible(const CompatibilityRecord& local, const CompatibilityRecord& remote);

// Everything a peer needs to write into one of our registrations. It maps field for field onto
// fluxion.v1.KvTarget (transport, peer_name, worker_address, remote_key, arena_base_address) plus
// PrefillRequest.layout / protocol_version; Serialize/ParseDescriptor give one opaque blob for
// side channels and tests. `worker_address` and `remote_key` are opaque to everyone but the
// transport that produced them.
struct PeerDescriptor {
  // Name of the node that owns the memory; unique per process incarnation (ServerInfo.node_name).
  std::string peer_name;
  // Which transport produced it: "ucx" or "loopback". Connect() on another kind: InvalidArgument.
  std::string transport;
  // The transport's address (UCX: the ucp_worker_get_address() blob) inside our self-checking
  // envelope (transfer/descriptor_check.h: magic, version, field, length, CRC-32C).
  std::string worker_address;
  // The registration's key inside the same envelope, which also records the range the key was
  // issued for. UCX: the landing's random token (transfer/landing_wire.h), which the target's
  // handler checks on every write; loopback: the registration's id. Its scope is the
  // registration: a peer may write only into [base_address, base_address + length), which must
  // lie inside that range, and the target refuses anything else.
  std::string remote_key;
  // Remote virtual address and length of the writable range, in bytes.
  uint64_t base_address = 0;
  uint64_t length = 0;
  CompatibilityRecord compat;
};

// One opaque byte string holding every field of `d` (versioned, length-prefixed).
std::string SerializeDescriptor(const PeerDescriptor& d);
// Inverse of SerializeDescriptor. InvalidArgument for a truncated or foreign blob.
absl::StatusOr<PeerDescriptor> ParseDescriptor(absl::string_view blob);

// Copy `length` bytes from our `local_addr` to the peer's `remote_addr` (a virtual address in the
// peer's process, inside the range its descriptor advertised).
struct BlockCopy {
  uint64_t remote_addr = 0;
  const void* local_addr = nullptr;
  size_t length = 0;
};

// Merges, in the given order, each copy whose local and remote ranges both start where the
// previous one's end into that previous copy: a run of consecutive pages becomes one write (small
// descriptors cost 10-17x bandwidth in NIXL). Order is kept; nothing is sorted. Pure function.
std::vector<BlockCopy> CoalesceCopies(absl::Span<const BlockCopy> copies);

struct RegistrationOptions {
  // Whether peers may write into the region (a remote key is made and Describe() works). A
  // source-only registration (the prefill side's KV) needs none.
  bool remote_write = true;
};

// A registered memory region. Deregisters on destruction, which revokes its key: a peer still
// holding its descriptor gets its writes refused by the target and nothing lands
// (docs/TRANSFER.md, "Remote-key scope"; UCX bounds the wait for rendezvous receives already under
// way, UcxOptions::revoke_timeout). Registering a sub-range of an already registered region is
// allowed and yields a key of narrower scope: this is how per-reservation keys are made.
// Thread-safe. REQUIRES: destroyed before the Transport that made it.
class Registration {
 public:
  virtual ~Registration() = default;
  virtual MemoryRegion region() const = 0;
  // The descriptor a peer feeds to Connect() to write into this region.
  // FailedPrecondition for a registration made without remote_write.
  virtual absl::StatusOr<PeerDescriptor> Describe() const = 0;
};

// A connected peer's registration: where Write() puts bytes. Holds the transport's per-peer state
// (for UCX: the cached endpoint and the unpacked remote key).
// Thread-safe. REQUIRES: destroyed before the Transport that made it.
class RemoteTarget {
 public:
  virtual ~RemoteTarget() = default;
  virtual const std::string& peer_name() const = 0;
  virtual uint64_t base_address() const = 0;
  virtual uint64_t length() const = 0;
};

// Completion of one submitted batch. Thread-safe.
class TransferHandle {
 public:
  virtual ~TransferHandle() = default;
  // Non-blocking. true once every copy has landed in the peer's memory (remote completion, not
  // just local), false while in flight, or the batch's error: FailedPrecondition when the target
  // refused some copies (its registration was revoked, or the range lies outside it: nothing of
  // those landed), Unavailable when the peer died or the transport shut down, Internal for
  // anything else.
  virtual absl::StatusOr<bool> Poll() = 0;
  // Blocks up to `timeout`. OK: every copy landed. DeadlineExceeded: still in flight (the copies
  // are NOT cancelled; wait again or treat the peer as suspect). FailedPrecondition: the target
  // refused some copies (see Poll). Unavailable: the peer died or the transport shut down; which
  // copies landed is unknown.
  virtual absl::Status Wait(absl::Duration timeout) = 0;
};

struct WriteOptions {
  // Merge contiguous copies (CoalesceCopies) before issuing them. Off only to measure the cost.
  bool coalesce = true;
};

// Cumulative counters of one transport: a plain snapshot, for the metrics registry to export.
struct TransportMetrics {
  // Upper bounds of the batch latency buckets (submit to remote completion), in microseconds;
  // the last bucket of `latency_buckets` counts everything above the last bound.
  static constexpr std::array<uint64_t, 13> kLatencyBoundsUs = {
      10, 30, 100, 300, 1000, 3000, 10000, 30000, 100000, 300000, 1000000, 3000000, 10000000};

  uint64_t bytes_written = 0;     // bytes of batches that completed OK
  uint64_t copies_submitted = 0;  // BlockCopy entries accepted by Write()
  uint64_t ops_issued = 0;        // write messages issued after coalescing (and splitting)
  uint64_t batches_submitted = 0;
  uint64_t batches_completed = 0;  // OK
  uint64_t registrations = 0;      // live
  uint64_t registered_bytes = 0;   // live
  // Failures by cause.
  uint64_t failed_invalid_argument = 0;  // Write/Register/Connect rejected a bad argument
  uint64_t failed_incompatible = 0;      // Connect rejected a peer (CheckCompatible)
  uint64_t failed_unavailable = 0;       // a batch or Connect failed because the peer is gone
  uint64_t failed_deadline = 0;          // a Wait/Flush returned DeadlineExceeded
  uint64_t failed_other = 0;
  std::array<uint64_t, kLatencyBoundsUs.size() + 1> latency_buckets = {};
  uint64_t latency_sum_us = 0;
  // This node as a target (its registrations that peers write into).
  uint64_t landed_bytes = 0;     // bytes peers' writes landed in our registrations
  uint64_t landing_refused = 0;  // peers' write messages refused at the target: nothing written
  // Registrations destroyed while a peer's rendezvous write into them was still in flight after
  // the revocation deadline (UCX: UcxOptions::revoke_timeout; those bytes may still land).
  uint64_t landing_revoke_timeouts = 0;
};

// Thread-safe: every method may be called from any thread.
class Transport {
 public:
  virtual ~Transport() = default;

  // "ucx" or "loopback" (PeerDescriptor::transport).
  virtual absl::string_view kind() const = 0;

  // Registers `region` for use as a copy source and, with options.remote_write, as a destination
  // for peers. InvalidArgument for a null or empty region; Internal if the transport refuses.
  // The memory must outlive the returned Registration.
  virtual absl::StatusOr<std::unique_ptr<Registration>> Register(
      MemoryRegion region, const RegistrationOptions& options = {}) = 0;

  // Prepares to write into the registration `peer` describes. `peer` is untrusted input (it comes
  // in a Prefill request): before the transport library sees a byte, checks the transport kind,
  // every field, both blob envelopes, the key's scope and the blobs' structure (InvalidArgument
  // naming the field; docs/TRANSFER.md, "Validating peer descriptors"), then compatibility
  // (FailedPrecondition naming the field). Connections are cached per peer incarnation: many
  // descriptors from one peer share one connection, and only the first pays a round trip; a peer
  // known dead gives Unavailable, and a restarted peer (new worker address) gets a fresh one.
  virtual absl::StatusOr<std::unique_ptr<RemoteTarget>> Connect(const PeerDescriptor& peer) = 0;

  // Submits `copies` into `target` and returns at once; the handle completes when every copy has
  // landed remotely. Validates the whole batch before issuing anything: a copy with zero length,
  // a remote range outside the target or a local range outside every registration of this
  // transport gives InvalidArgument naming the copy, and nothing is written. Unavailable if the
  // peer is known dead. The target checks every copy again against its live registration before
  // writing (the descriptor may be forged, widened or stale): what it refuses fails the handle
  // with FailedPrecondition.
  // REQUIRES: `target` was made by this transport.
  virtual absl::StatusOr<std::unique_ptr<TransferHandle>> Write(
      const RemoteTarget& target, absl::Span<const BlockCopy> copies,
      const WriteOptions& options = {}) = 0;

  // Waits up to `timeout` until every batch submitted before the call has completed (OK or not).
  // DeadlineExceeded otherwise.
  virtual absl::Status Flush(absl::Duration timeout) = 0;

  virtual TransportMetrics metrics() const = 0;
};

}  // namespace fluxion::transfer

#endif  // FLUXION_TRANSFER_TRANSPORT_H_

// The UCX Transport: one ucp context (AM + WAKEUP features, no RMA), one worker, one progress
// thread. docs/TRANSFER.md has the long form of everything below.
//
// Target-checked landings. Peers never write into this process with one-sided RMA: the context
// does not ask for UCP_FEATURE_RMA, so UCX does not even install its software-RMA handlers (which
// on TCP and shared memory write to whatever address a message names). Register() with
// remote_write opens a landing (transfer/ucx_landing.h): a random token mapped to the region,
// which the descriptor's key carries. Write() sends each coalesced copy as active messages
// {token, address, batch} plus data; the target's handler checks the token and the range before
// touching memory, copies eager data itself and receives rendezvous data into the checked
// destination, and refuses everything else. Destroying the Registration removes the token.
//
// Remote completion. A batch's write messages are followed, once each has completed at the
// writer, by a fence (sent with UCP_AM_SEND_FLAG_REPLY); the target answers it, from inside the
// fence's callback, with what it accepted, refused or is still receiving, and the writer asks
// again until every message is accounted for. The handle completes on that answer: OK only when
// every byte landed, FailedPrecondition when the target refused some (revoked or out of range),
// Unavailable when the peer died or never answered within UcxOptions::ack_timeout.
//
// Progress model. The worker runs in UCS_THREAD_MODE_SERIALIZED and every UCX call is made with
// one transport-wide lock held, so any thread may Register/Connect/Write while the progress thread
// progresses. The progress thread is the only caller of ucp_worker_progress: it progresses until
// idle, arms the worker and sleeps on its event fd (at most UcxOptions::max_idle_sleep), and wakes
// when a writer signals the worker or the network delivers; right after activity it keeps polling
// (UcxOptions::busy_poll), because some progress raises no event. Progress is needed on BOTH ends:
// the target's handlers land the bytes and answer the fences.
//
// Endpoints are cached per peer worker address with UCP_ERR_HANDLING_MODE_PEER; a peer error
// fails that endpoint's batches with Unavailable, and the endpoint is never reused (a restarted
// peer has a new address and gets a new endpoint). The first Connect() of an endpoint ends with a
// round trip (a fence of no messages) so that an unreachable peer fails there, not in the first
// write; later descriptors of the same peer (per-reservation keys) connect without one. Every
// byte of a descriptor is checked before UCX sees it (transfer/descriptor_check.h): UCX 1.13
// parses worker addresses without a length and asserts or crashes on malformed ones.
//
// UCX is configured by the environment (UCX_TLS, UCX_NET_DEVICES, ...) and by UcxOptions::config,
// applied on top. Thread-safe: every method may be called from any thread.
#ifndef FLUXION_TRANSFER_UCX_TRANSPORT_H_
#define FLUXION_TRANSFER_UCX_TRANSPORT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transfer/transport.h"

namespace fluxion::transfer {

struct UcxOptions {
  // PeerDescriptor::peer_name of this node (ServerInfo.node_name).
  std::string node_name = "ucx";
  // What this node serves; Connect() compares peers against it.
  CompatibilityRecord compat;
  // UCX settings without the UCX_ prefix, applied over the environment with ucp_config_modify,
  // e.g. {{"TLS", "tcp"}, {"NET_DEVICES", "lo"}}. Tests set them so that they need no
  // environment; services leave this empty and let operators set UCX_* variables.
  std::vector<std::pair<std::string, std::string>> config;
  // Create endpoints with UCP_ERR_HANDLING_MODE_PEER, so that a dead peer fails its batches with
  // Unavailable instead of leaving them in flight. UCX 1.13 has no peer failure handling on its
  // shared-memory transports (posix, sysv, self; cma has no active messages), so with it on, a
  // one-host pair runs over TCP; off, shared memory works but a dead peer is only noticed by the
  // caller's own deadline (docs/TRANSFER.md).
  bool peer_error_handling = true;
  // UCX keepalive on endpoints (UCX_KEEPALIVE_INTERVAL; UCX's default is 20 s). A dead peer that
  // closes no socket (a crashed host, shared memory) is noticed within about this long.
  absl::Duration keepalive_interval = absl::Seconds(2);
  // Bound on Connect()'s wait for the endpoint's wireup with a new peer (DeadlineExceeded).
  absl::Duration connect_timeout = absl::Seconds(10);
  // The progress thread keeps polling (yielding the core between rounds) for this long after its
  // last event before it sleeps, and while batches are in flight sleeps at most 1 ms: some
  // progress (a send waiting for room in a shared-memory FIFO) raises no event.
  absl::Duration busy_poll = absl::Milliseconds(2);
  // Longest the progress thread sleeps on the worker's event fd without an event. Bounds the cost
  // of a missed wakeup; it is not a polling period (wakeups are event-driven).
  absl::Duration max_idle_sleep = absl::Milliseconds(20);
  // Bound on the waits inside the destructor (closing endpoints).
  absl::Duration shutdown_timeout = absl::Seconds(5);

  // How write messages travel. kAuto lets UCX pick by size (eager below its rendezvous threshold:
  // the target's handler copies out of UCX's buffer; rendezvous above: the target receives
  // straight into the checked destination, zero-copy where the transport can); kEager and
  // kRendezvous force one (UCP_AM_SEND_FLAG_EAGER / _RNDV). docs/TRANSFER.md, "Measured".
  enum class Protocol { kAuto, kEager, kRendezvous };
  Protocol protocol = Protocol::kAuto;
  // Each coalesced copy is sent as messages of at most this many bytes; 0: one message per copy.
  size_t max_message_bytes = 0;
  // A batch whose target has not accounted for every message this long after its fence fails
  // with Unavailable (a target that stopped progressing, a peer that died unnoticed).
  absl::Duration ack_timeout = absl::Seconds(60);
  // Destroying a Registration waits up to this long for rendezvous receives peers already started
  // into it. Past it (a peer stalled mid-message) those bytes may still land, since UCX 1.13
  // cannot cancel a receive: the region stays mapped until they end, the destructor returns,
  // TransportMetrics::landing_revoke_timeouts counts it and an error is logged.
  absl::Duration revoke_timeout = absl::Seconds(5);

  // Bounds on what a peer can make this node (as a target) keep.
  struct LandingLimits {
    // Per-batch tallies (a few dozen bytes each; one per batch in flight towards us). Past it
    // the least recently touched idle ones are evicted (their writers' fences go unanswered and
    // time out).
    size_t max_batches = 65536;
    // Rendezvous receives in flight; a rendezvous write beyond it is refused.
    size_t max_receives = 4096;
    // A tally untouched this long (its writer died between writes and fence) is dropped.
    absl::Duration batch_idle = absl::Seconds(60);
  };
  LandingLimits landing_limits;
};

class UcxTransport : public Transport {
 public:
  absl::string_view kind() const override { return "ucx"; }

  // What UCX chose for `target`'s endpoint: its lanes and transports (ucp_ep_print_info), for
  // logs and benchmark records. REQUIRES: `target` was made by this transport.
  virtual absl::StatusOr<std::string> DescribeEndpoint(const RemoteTarget& target) = 0;

  // Test hook. While paused the progress thread does not progress the worker: writes into this
  // transport's memory do not land and fences towards it are not answered, as with a hung peer.
  virtual void SetProgressPausedForTesting(bool paused) = 0;

  // Test hook: how many Connect() round trips this transport issued. One per endpoint: further
  // descriptors of a proved peer connect without one.
  virtual uint64_t ConnectProbesForTesting() const = 0;

  // Test hook: batch tallies this transport keeps as a target (bounded by
  // UcxOptions::landing_limits).
  virtual size_t LandingBatchesForTesting() const = 0;
};

// Creates the context, worker and progress thread. Internal (or the UCX error) when UCX cannot
// start, InvalidArgument for an unknown UcxOptions::config key or value.
absl::StatusOr<std::unique_ptr<UcxTransport>> NewUcxTransport(const UcxOptions& options);

}  // namespace fluxion::transfer

#endif  // FLUXION_TRANSFER_UCX_TRANSPORT_H_

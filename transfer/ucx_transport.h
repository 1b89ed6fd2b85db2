// The UCX Transport: one ucp context (RMA + WAKEUP features), one worker, one progress thread.
//
// Progress model (docs/TRANSFER.md has the long form). The worker runs in
// UCS_THREAD_MODE_SERIALIZED and every UCX call is made with one transport-wide lock held, so any
// thread may Register/Connect/Write while the progress thread progresses. The progress thread is
// the only caller of ucp_worker_progress: it progresses until idle, arms the worker and sleeps on
// its event fd (at most UcxOptions::max_idle_sleep), and wakes when a writer signals the worker
// after posting puts or when the network delivers; right after activity it keeps polling
// (UcxOptions::busy_poll), because some progress raises no event. Progress is needed on
// BOTH ends: on one host (shared memory, TCP) UCX 1.13 emulates puts with active messages that
// only the target's progress lands, and a flush completes only when the target answers. Between
// hosts with RDMA the puts are one-sided in hardware and only the writer's progress matters.
//
// A batch = its puts (no per-put callback; requests are released at once) followed by one
// ucp_ep_flush_nbx on the endpoint: the flush completing means every put of the batch reached the
// peer's memory, which is what the handle reports. Endpoints are cached per peer worker address
// with UCP_ERR_HANDLING_MODE_PEER; a peer error fails that endpoint's outstanding batches with
// Unavailable, and the endpoint is never reused (a restarted peer has a new address and gets a
// new endpoint, so no stale key is ever used). The first Connect() of an endpoint ends with a round
// trip (a 1-byte get and a flush) so that an unreachable peer fails there, not in the first write;
// later descriptors of the same peer (per-reservation keys) connect without one. Every byte of a
// descriptor is checked before UCX sees it (transfer/descriptor_check.h): UCX 1.13 parses worker
// addresses and keys without a length and asserts or crashes on malformed ones.
//
// On one host, puts into memory the target registered with Register() are emulated (active
// messages, ~2 GB/s here); into memory from Allocate() (a UCX shared-memory segment) they are
// direct copies by the writer (~8-10 GB/s here). docs/TRANSFER.md has the numbers.
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
};

class UcxTransport : public Transport {
 public:
  absl::string_view kind() const override { return "ucx"; }

  // What UCX chose for `target`'s endpoint: its lanes and transports (ucp_ep_print_info), for
  // logs and benchmark records. REQUIRES: `target` was made by this transport.
  virtual absl::StatusOr<std::string> DescribeEndpoint(const RemoteTarget& target) = 0;

  // Test hook. While paused the progress thread does not progress the worker: puts emulated
  // through active messages into this transport's memory do not land, flushes towards it do not
  // complete, as with a hung peer.
  virtual void SetProgressPausedForTesting(bool paused) = 0;

  // Test hook: how many Connect() round trips (probe get + flush) this transport issued. One per
  // endpoint: further descriptors of a proved peer connect without one.
  virtual uint64_t ConnectProbesForTesting() const = 0;
};

// Creates the context, worker and progress thread. Internal (or the UCX error) when UCX cannot
// start, InvalidArgument for an unknown UcxOptions::config key or value.
absl::StatusOr<std::unique_ptr<UcxTransport>> NewUcxTransport(const UcxOptions& options);

}  // namespace fluxion::transfer

#endif  // FLUXION_TRANSFER_UCX_TRANSPORT_H_

// The router's view of its prefill and decode nodes: where they are (flags or DNS names, so that
// Kubernetes headless services work), whether they are healthy (grpc.health.v1) and how loaded
// they are (GetLoad), refreshed by a background poller. Whether a node is routed to follows the
// run of its checks, not the last one (cluster/backend_health.h: dropped after N misses in a row,
// taken back after M passes in a row).
//
// Thread-safe: every method may be called from any thread (gRPC reactors call Snapshot() and
// NoteDispatch() on the request path; both only take a mutex, never block on the network).
#ifndef FLUXION_CLUSTER_BACKENDS_H_
#define FLUXION_CLUSTER_BACKENDS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cluster/backend_health.h"
#include "common/grpc_transport.h"
#include "common/metrics.h"
#include "fluxion/v1/decode.grpc.pb.h"
#include "fluxion/v1/prefill.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace fluxion::cluster {

enum class Role { kDecode, kPrefill };
const char* RoleName(Role role);

// One node as last seen.
struct BackendState {
  std::string address;  // "host:port"
  Role role = Role::kDecode;
  bool healthy = false;     // routed to: health_state kHealthy or kSuspect
  HealthState health_state = HealthState::kNew;
  int consecutive_failures = 0;  // checks missed in a row (0 after a pass)
  bool has_load = false;    // at least one GetLoad answer
  v1::DecodeLoad decode_load;    // role == kDecode
  v1::PrefillLoad prefill_load;  // role == kPrefill
  // Work the router sent since the last load answer (the answer does not count it yet).
  int64_t pending_requests = 0;
  int64_t pending_prompt_tokens = 0;
  std::string last_error;  // why it is unhealthy, for logs and messages
};

// Splits "host:port"; INVALID_ARGUMENT when the port is missing or not a number.
absl::StatusOr<std::pair<std::string, int>> SplitHostPort(const std::string& address);

// Every IPv4 address of `host` (all A records: a headless service lists one per ready pod), as
// "ip:port", sorted. UNAVAILABLE when the name does not resolve.
absl::StatusOr<std::vector<std::string>> ResolveAll(const std::string& host, int port);

// Asks `channel`'s grpc.health.v1 service about `service` ("" = the whole server): true when
// SERVING, false for any other answer or no answer within `timeout`. Blocks the caller.
bool HealthServing(const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
                   absl::Duration timeout);

class Backends {
 public:
  struct Options {
    std::vector<std::string> decode_addresses;   // "host:port", used as given
    std::vector<std::string> prefill_addresses;
    std::vector<std::string> decode_dns;         // "name:port", re-resolved every resolve_interval
    std::vector<std::string> prefill_dns;
    absl::Duration poll_interval = absl::Milliseconds(200);
    absl::Duration rpc_timeout = absl::Milliseconds(500);  // health check and GetLoad
    absl::Duration resolve_interval = absl::Seconds(5);
    bool start_poller = true;  // tests may drive PollOnce() themselves
    serving::ChannelConfig channel;  // credentials and keepalive of the channels to the nodes
    HealthHysteresisOptions health;  // N misses to drop a node, M passes to take it back
    // Where each node's health state is published (fluxion_router_backend_state and
    // fluxion_router_backend_ejections_total, docs/METRICS.md); nullptr: nowhere.
    metrics::Registry* registry = nullptr;
  };

  // INVALID_ARGUMENT for a malformed address or when no decode node is named at all. DNS names
  // that do not resolve yet are not an error (pods may not exist yet); they are retried.
  static absl::StatusOr<std::unique_ptr<Backends>> Create(Options options);
  ~Backends();  // stops the poller

  // One round: re-resolve DNS names if due, then health-check and load every node concurrently,
  // waiting at most rpc_timeout (plus a little) in total.
  void PollOnce();

  std::vector<BackendState> Snapshot(Role role) const;
  bool has_prefill_nodes() const;
  int HealthyCount(Role role) const;

  // Counts a request sent to `address` until the next load answer from it.
  void NoteDispatch(const std::string& address, int64_t prompt_tokens);
  // The request path saw `address` fail (UNAVAILABLE, no message at all): ejected now, taken back
  // after M passing checks in a row.
  void MarkFailed(const std::string& address, const std::string& why);

  // Stub for a decode node (nullptr if unknown). The stub stays valid while the caller holds it.
  std::shared_ptr<v1::DecodeService::Stub> DecodeStub(const std::string& address) const;

 private:
  struct Node {
    BackendState state;
    HealthHysteresis health;
    int64_t ejections_published = 0;  // of health.ejections(), already added to the counter
    std::shared_ptr<grpc::Channel> channel;
    std::shared_ptr<v1::DecodeService::Stub> decode_stub;
    std::shared_ptr<v1::PrefillService::Stub> prefill_stub;
  };
  explicit Backends(Options options) : options_(std::move(options)) {}
  void Resolve();
  void AddNode(const std::string& address, Role role) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PollerLoop();
  // Copies health.state() into `state` (the fields Snapshot returns).
  static void SyncHealth(Node& node);
  // Publishes every node's health state to options_.registry and removes the series of nodes
  // that left DNS. Takes mu_ itself and never calls the registry while holding it (a scrape runs
  // the HealthyCount callback, which takes mu_, under the registry's lock).
  void PublishHealth();

  const Options options_;
  mutable absl::Mutex mu_;
  std::map<std::string, Node> nodes_ ABSL_GUARDED_BY(mu_);  // by address
  // Channels of nodes that left a DNS answer. Kept until destruction: calls still in flight on
  // them hold references, and gRPC must not destroy a channel from its own callback thread (it
  // would if such a call dropped the last reference).
  std::vector<std::shared_ptr<grpc::Channel>> retired_channels_ ABSL_GUARDED_BY(mu_);
  // Nodes that left a DNS answer whose metric series PublishHealth has not removed yet.
  std::vector<std::pair<std::string, Role>> retired_series_ ABSL_GUARDED_BY(mu_);
  absl::Time last_resolve_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread poller_;
};

}  // namespace fluxion::cluster

#endif  // FLUXION_CLUSTER_BACKENDS_H_

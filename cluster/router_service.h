// The router's gRPC service: serves fluxion.v1.DecodeService (Generate, Abort, GetLoad) to
// clients, so a client cannot tell a router from a decode node, and forwards each Generate to a
// decode node it picks, naming the prefill node it picks in `prefill_address`.
//
// Per request: pick a pair (cluster/router_policy.h), forward with the remaining time budget,
// relay the stream with flow control (the next downstream message is read only after the previous
// one was written to the client). A failure before the first token is retried on another pair (a
// different decode node; another prefill node when there is one); after the first token it is
// relayed to the client as is, never retried. Client cancellation cancels the downstream call;
// the earlier of the client's gRPC deadline and `timeout_ms` bounds the whole request.
//
// Thread-safe. Reactors never block: picking reads a snapshot under a mutex, and every gRPC call
// is asynchronous.
#ifndef FLUXION_CLUSTER_ROUTER_SERVICE_H_
#define FLUXION_CLUSTER_ROUTER_SERVICE_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cluster/backends.h"
#include "common/metrics.h"
#include "fluxion/v1/decode.grpc.pb.h"

namespace fluxion::cluster {

struct RouterOptions {
  // Shed with RESOURCE_EXHAUSTED when every healthy decode node's kv_usage is at or above this.
  double shed_kv_usage = 0.95;
  // Attempts per request (first try plus retries), each on a different decode node.
  int max_attempts = 3;
  // Name reported in GetLoad's ServerInfo.
  std::string node_name = "router";
  // Each attempt's gRPC deadline is the request's deadline plus this, so that a decode node that
  // ends the stream itself when `timeout_ms` runs out (error with usage and timing) is heard
  // before gRPC's own DEADLINE_EXCEEDED, which carries neither (docs/PROTOCOL.md).
  absl::Duration deadline_grace = absl::Milliseconds(500);
};

class RouterService final : public v1::DecodeService::CallbackService {
 public:
  // `backends` and `registry` must outlive the service.
  RouterService(Backends* backends, RouterOptions options, metrics::Registry* registry);
  ~RouterService() override;

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* context, const v1::GenerateRequest* request) override;
  grpc::ServerUnaryReactor* Abort(grpc::CallbackServerContext* context,
                                  const v1::AbortRequest* request,
                                  v1::AbortResponse* response) override;
  grpc::ServerUnaryReactor* GetLoad(grpc::CallbackServerContext* context,
                                    const v1::GetLoadRequest* request,
                                    v1::DecodeLoad* response) override;

  // Requests open now (for tests and the inflight gauge).
  int inflight() const;

  // While draining (SIGTERM), new Generate calls are refused with UNAVAILABLE naming the drain;
  // open ones go on.
  void SetDraining(bool draining) { draining_ = draining; }
  // The drain's timeout passed: every open request is aborted as Abort would (downstream
  // included) with `reason`, so each ends with its tokens and FINISH_REASON_ABORT, or, before its
  // first token, with the abort's ending. Returns how many it aborted.
  int AbortAll(const std::string& reason);

  // Initial-metadata entry with a Generate call's abort token (the router's own, for its
  // clients; the decode node's, read by the router for its downstream Abort).
  static constexpr char kAbortTokenKey[] = "fluxion-abort-token";

 private:
  class Relay;
  friend class Relay;

  struct Metrics {
    metrics::Registry* registry;
    metrics::Gauge* inflight;
    metrics::Counter* attempts_ok;
    metrics::Counter* attempts_retried;
    metrics::Counter* attempts_failed;
    metrics::Counter* shed;
    metrics::Histogram* ttft;
    metrics::Histogram* e2e;
  };

  // One accepted request, as Abort needs it. Shared by its relay and live_.
  struct LiveEntry {
    std::string request_id;
    std::string abort_token;  // the router's, handed to the client; immutable
    absl::Mutex mu;
    std::string decode ABSL_GUARDED_BY(mu);            // node of the current attempt
    std::string downstream_token ABSL_GUARDED_BY(mu);  // its token; "" until its metadata came
    bool aborted ABSL_GUARDED_BY(mu) = false;          // sticky: no retry after it
    std::string abort_reason ABSL_GUARDED_BY(mu);
    std::string abort_sent_to ABSL_GUARDED_BY(mu);     // downstream token Abort went out with
  };
  using LiveMap = std::multimap<std::string, std::shared_ptr<LiveEntry>>;
  // Registers an accepted request (ids may repeat: entries are told apart by token).
  LiveMap::iterator AddLive(std::shared_ptr<LiveEntry> entry);
  // Ends a client call; `entry` is empty for a request rejected before AddLive.
  void CallDone(std::optional<LiveMap::iterator> entry);
  // Sends Abort for `ids_and_tokens` to the decode node `node`; `done` runs once it answered.
  void ForwardAbort(const std::string& node,
                    const std::vector<std::pair<std::string, std::string>>& ids_and_tokens,
                    const std::string& reason, std::function<void()> done);

  // Marks `entry` aborted with `reason`; adds (id, downstream token) to `by_node` when the abort
  // must still go to its decode node. Needs mu_ (for live_).
  static void MarkAborted(LiveEntry& entry, const std::string& reason,
                          std::map<std::string, std::vector<std::pair<std::string, std::string>>>*
                              by_node);

  Backends* const backends_;
  const RouterOptions options_;
  std::atomic<bool> draining_{false};
  Metrics metrics_;
  mutable absl::Mutex mu_;
  LiveMap live_ ABSL_GUARDED_BY(mu_);
  int open_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace fluxion::cluster

#endif  // FLUXION_CLUSTER_ROUTER_SERVICE_H_

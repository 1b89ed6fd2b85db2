// fluxion.v1.PrefillService on a PrefillEngine: Prefill, Abort, GetLoad.
//
// One batch computes at a time (the model's kernels already use every core). A call that finds
// the compute slot free leads a batch: itself and the requests queued behind it, in arrival order
// up to SetMaxBatchTokens() prompt tokens, through one batched forward (PrefillEngine::RunBatch);
// each call replies once the leader hands it its result. Queued and running calls are counted by
// GetLoad (running = in the current batch, or landing).
//
// The compute slot is held for the forward only: once a request's compute is over, the batch hands
// the call its PrefillEngine::Landing and moves on, and the call waits for its own writes on its
// own server thread (bounded by --transfer-timeout-ms). So a decode node that does not take its
// writes (link down, stopped) holds only the requests sent to it, never the slot and the requests
// of other decode nodes queued behind them (docs/FAULTS.md, "Findings").
// A request is cancelled by Abort (by id) or by its caller cancelling the call; both are checked
// while it waits and between layers, and the reply comes only after its writes stopped.
//
// Thread-safe. Uses gRPC's synchronous server: each call holds a server thread while it waits.
#ifndef FLUXION_PREFILL_PREFILL_SERVICE_H_
#define FLUXION_PREFILL_PREFILL_SERVICE_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "fluxion/v1/prefill.grpc.pb.h"
#include "prefill/prefill_engine.h"
#include "prefill/prefill_metrics.h"
#include "prefill/seal_replay_guard.h"
#include "proto/prefill_seal.h"
#include "transfer/transport.h"

namespace fluxion::prefill {

// Counters of the service, a plain snapshot (prefill/prefill_metrics.h exports them).
struct PrefillMetrics {
  uint64_t requests_ok = 0;
  uint64_t requests_cancelled = 0;
  uint64_t requests_failed = 0;
  uint64_t prompt_tokens = 0;
  // Forwards that ran several requests together (prefill batching), and the requests in them.
  uint64_t batches = 0;
  uint64_t batched_requests = 0;
  transfer::TransportMetrics transport;
  StagingStats staging;  // the engine's (prefill_engine.h)
};

class PrefillServiceImpl final : public fluxion::v1::PrefillService::Service {
 public:
  // `engine` and `transport` must outlive the service. `info` is returned in GetLoad. Only
  // requests sealed with `secret` are acted on (proto/prefill_seal.h), each once.
  // `node_metrics` (null: none) gets every call's final status and timings; it must outlive the
  // service.
  PrefillServiceImpl(const PrefillEngine* engine, const transfer::Transport* transport,
                     const fluxion::v1::ServerInfo& info, proto::TransferSecret secret,
                     PrefillNodeMetrics* node_metrics = nullptr);
  ~PrefillServiceImpl() override;  // joins the last batch's thread

  grpc::Status Prefill(grpc::ServerContext* context, const fluxion::v1::PrefillRequest* request,
                       fluxion::v1::PrefillResponse* response) override;
  grpc::Status Abort(grpc::ServerContext* context, const fluxion::v1::AbortRequest* request,
                     fluxion::v1::AbortResponse* response) override;
  grpc::Status GetLoad(grpc::ServerContext* context, const fluxion::v1::GetLoadRequest* request,
                       fluxion::v1::PrefillLoad* response) override;

  PrefillMetrics metrics() const;
  // What GetLoad answers: queued and running calls and their prompt tokens, draining, server.
  fluxion::v1::PrefillLoad Load() const;

  // While draining, new Prefill calls are refused with UNAVAILABLE; running ones finish.
  void SetDraining(bool draining) { draining_ = draining; }
  // Up to this many prompt tokens of queued requests run through one batched forward (a request
  // larger than that still runs, alone); 0 (the default here) runs one request at a time.
  void SetMaxBatchTokens(int64_t tokens) { max_batch_tokens_ = tokens; }
  // A Prefill call arriving while this many calls already wait for the compute slot is refused
  // with RESOURCE_EXHAUSTED naming --max-queued-requests (the decode node frees its pages and the
  // router retries on another pair) instead of holding a server thread and the decode node's
  // reserved pages for an unbounded wait. < 0: no bound.
  void SetMaxQueuedRequests(int64_t requests) { max_queued_requests_ = requests; }
  static constexpr int64_t kDefaultMaxQueuedRequests = 64;
  int64_t live_requests() const;

 private:
  // Prefill without the final-status metric.
  grpc::Status PrefillCall(grpc::ServerContext* context, const fluxion::v1::PrefillRequest* request,
                           fluxion::v1::PrefillResponse* response);

  struct Live {
    std::atomic<bool> aborted{false};
    uint64_t prompt_tokens = 0;
    // Guarded by mu_ (set before the call waits; `result` written by the batch's leader):
    const fluxion::v1::PrefillRequest* request = nullptr;
    std::function<bool()> cancelled;
    uint64_t arrival = 0;
    bool running = false;  // in a batch, or its writes landing
    bool done = false;     // `result` is the reply; its writes stopped
    // Compute over, writes maybe in flight: the call waits on it (off the compute slot).
    std::unique_ptr<PrefillEngine::Landing> landing;
    bool handed_over = false;  // the batch gave it `landing` (which its call then takes)
    absl::StatusOr<fluxion::v1::PrefillResponse> result{absl::UnknownError("no reply yet")};
    std::chrono::steady_clock::time_point t_start;  // its batch started
  };
  // Marks `leader` and the queued requests that fit (arrival order) running; returns them.
  std::vector<std::shared_ptr<Live>> PickBatchLocked(const std::shared_ptr<Live>& leader)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes `live` from live_ if it is still there (a finished batch member leaves at once).
  void EraseLocked(const std::shared_ptr<Live>& live) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs `batch` (its members marked running, busy_ held) and hands each member its Landing as
  // soon as its compute is over; releases busy_ once every member's compute is. Runs on
  // batch_thread_.
  void RunBatch(const std::vector<std::shared_ptr<Live>>& batch) ABSL_LOCKS_EXCLUDED(mu_);

  const PrefillEngine* const engine_;
  const transfer::Transport* const transport_;
  const fluxion::v1::ServerInfo info_;
  const proto::TransferSecret secret_;
  SealReplayGuard seen_seals_;
  PrefillNodeMetrics* const node_metrics_;
  std::atomic<bool> draining_{false};

  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Live>> live_ ABSL_GUARDED_BY(mu_);
  bool busy_ ABSL_GUARDED_BY(mu_) = false;  // a batch is computing
  absl::CondVar batch_cv_;                  // a batch ended or a reply is ready
  uint64_t next_arrival_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<int64_t> max_batch_tokens_{0};
  std::atomic<int64_t> max_queued_requests_{kDefaultMaxQueuedRequests};
  std::thread batch_thread_;  // the running (or last) batch; touched only by busy_'s holder
  PrefillMetrics metrics_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fluxion::prefill

#endif  // FLUXION_PREFILL_PREFILL_SERVICE_H_

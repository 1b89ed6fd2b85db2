// fluxion.v1.DecodeService on the decode node: Generate (server streaming), Abort, GetLoad.
//
// Request lifecycle (docs/SERVING.md; one phase each in decode/serving/generate_call.h): validate
// -> admit (reserve prompt + sparse-state pages in the arena, or wait in a bounded queue until the
// deadline) -> Prefill on a prefill node, which writes the KV into those pages over UCX -> verify
// per-layer checksums, load the sparse state -> join the continuous batch (BatchScheduler) ->
// stream chunks -> complete/error. Pages come back
// at finish, abort and failure, held by decode::Reservation; when the prefill node's call ends
// without proof that its writes stopped (connection lost after sending, Abort unanswered, its own
// transfer timeout) they are quarantined for a lease instead, since writes may still land.
//
// Thread-safe. Uses gRPC's synchronous server: a Generate call holds a server thread, which polls
// for cancellation every 10-20 ms.
#ifndef FLUXION_DECODE_SERVING_DECODE_SERVICE_H_
#define FLUXION_DECODE_SERVING_DECODE_SERVICE_H_

#include <atomic>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "decode/kv/kv_admission.h"
#include "decode/kv/kv_arena.h"
#include "decode/serving/batch_scheduler.h"
#include "decode/serving/decode_metrics.h"
#include "decode/serving/prefill_client.h"
#include "decode/serving/prefill_peers.h"
#include "fluxion/v1/decode.grpc.pb.h"
#include "model/model.h"
#include "proto/prefill_seal.h"
#include "transfer/transport.h"

namespace fluxion::decode {

struct DecodeServiceOptions {
  // The prefill nodes this node trusts with its arena's worker address and remote key: the only
  // ones a request may name in prefill_address, and the ones used when it names none
  // (decode/serving/prefill_peers.h). Null: none (every request is refused with
  // FAILED_PRECONDITION).
  std::shared_ptr<PrefillPeers> prefill_peers;
  // Policy and budget for requests without GenerateRequest.sparse.
  std::string default_policy = "fluxion";
  double default_budget = 0.1;
  // Head-property predictor for requests with policy `fluxion` (decode/sparse/fluxion_predictor.h);
  // null = its rule-based fallback (what `fluxion_rules` always uses).
  std::shared_ptr<const sparse::FluxionPredictor> fluxion_predictor;
  // Host costs for `fluxion`'s granularity choice (the node's measured read bandwidth).
  sparse::HostCostModel host_cost;
  // Where exact_topk, lfps and fluxion choose rows (sparse::Selector): device with --device cuda
  // and compact keys in HBM (a request beyond them computes the same picks on the CPU), else host.
  sparse::Selector selector = sparse::Selector::kHost;
  // The online error guard for lfps / fluxion requests (decode/sparse/error_guard.h; `enabled`
  // from --guard) and the model's W_O it measures e_h with.
  sparse::GuardConfig guard;
  std::shared_ptr<const model::OutputProjection> output_projection;
  int64_t page_tokens = 16;
  // The longest context (prompt plus generated tokens) a request may reach: the model's
  // max_position_embeddings or the node's --max-model-len below it; 0 = the model's.
  int64_t context_limit = 0;
  // Tokens that end a generation (unless ignore_eos) beyond config.json's eos_token_id: the
  // model's generation_config.json's (model/generation_config.h).
  std::vector<int64_t> extra_eos_token_ids;
  // Longest a request waits for KV pages (also bounded by its own deadline).
  absl::Duration admission_timeout = absl::Seconds(10);
  // Bound on the Prefill call (also bounded by the request's deadline).
  absl::Duration prefill_timeout = absl::Seconds(120);
  // The secret shared with the prefill nodes (--transfer-secret-file): every PrefillRequest is
  // sealed with it (proto/prefill_seal.h), valid until the call's own bound plus
  // proto::kSealClockSkew. Null: requests go unsealed, and prefill nodes refuse them.
  std::shared_ptr<const proto::TransferSecret> transfer_secret;
  // After sending Abort to a prefill node, how long to wait for its reply before giving up and
  // quarantining the pages.
  absl::Duration abort_wait = absl::Seconds(2);
  // Credentials and keepalive of the channels to prefill nodes (--prefill-tls-*).
  serving::ChannelConfig prefill_channel;
  // How long pages stay quarantined when a prefill node may still write into them (its call
  // ended without a reply). Must exceed the prefill node's --transfer-timeout-ms plus UCX's
  // keepalive for the guarantee to hold between hosts; on one host a dead process writes nothing.
  absl::Duration quarantine_lease = absl::Seconds(30);
  // Prometheus metrics (decode/serving/decode_metrics.h); null = none. Must outlive the service.
  DecodeNodeMetrics* node_metrics = nullptr;
  // The process's one CPU pool (--cpu-threads), which the BatchScheduler's step executor computes
  // on; null = the executor's own default. Must outlive the service and the scheduler.
  const kernels::cpu::CpuPool* cpu_pool = nullptr;
};

// Counters of the service, a plain snapshot (decode/serving/decode_metrics.h exports them).
struct DecodeMetrics {
  uint64_t requests_started = 0;
  uint64_t finished_stop = 0;
  uint64_t finished_length = 0;
  uint64_t finished_abort = 0;
  uint64_t finished_error = 0;      // preempted requests not included
  uint64_t finished_preempted = 0;
  uint64_t rejected = 0;       // refused before admission (bad arguments, no room)
  uint64_t preempted = 0;
  uint64_t resumed = 0;  // preempted requests whose KV was recomputed and that went on
  uint64_t checksum_failures = 0;
  uint64_t quarantined_reservations = 0;
  uint64_t completion_tokens = 0;
  uint64_t prompt_tokens = 0;  // of admitted requests
  KvArenaCounters pages;
  transfer::TransportMetrics transport;
};

class DecodeServiceImpl final : public fluxion::v1::DecodeService::Service {
 public:
  // Everything passed must outlive the service. `arena_descriptor` describes the arena registered
  // with `transport` (remote_write): its worker address and base go into every Prefill request,
  // its key never does (each reservation registers its own runs, KvTarget.ranges).
  DecodeServiceImpl(const model::Model* model, KvArena* arena, KvAdmission* admission,
                    BatchScheduler* scheduler, transfer::Transport* transport,
                    const transfer::PeerDescriptor& arena_descriptor,
                    const fluxion::v1::ServerInfo& info, const DecodeServiceOptions& options);

  grpc::Status Generate(grpc::ServerContext* context, const fluxion::v1::GenerateRequest* request,
                        grpc::ServerWriter<fluxion::v1::GenerateResponse>* writer) override;
  grpc::Status Abort(grpc::ServerContext* context, const fluxion::v1::AbortRequest* request,
                     fluxion::v1::AbortResponse* response) override;
  grpc::Status GetLoad(grpc::ServerContext* context, const fluxion::v1::GetLoadRequest* request,
                       fluxion::v1::DecodeLoad* response) override;

  DecodeMetrics metrics() const;

  // Name of the initial-metadata entry that carries a Generate call's abort token.
  static constexpr char kAbortTokenKey[] = "fluxion-abort-token";

  // While draining, new Generate calls are refused with UNAVAILABLE and GetLoad says so; running
  // ones finish. The serving command drains on SIGTERM before shutting down.
  void SetDraining(bool draining) { draining_ = draining; }
  // The drain's timeout passed (common/server_main.h, DrainPlan::end_remaining): every live
  // request ends now with UNAVAILABLE naming `why`; one that has not sent a token yet is safe to
  // retry elsewhere, one that has keeps its tokens and gets the error after them. Returns how
  // many it ended.
  int64_t EndLiveRequests(const std::string& why);
  // Generate calls in progress (any phase).
  int64_t live_requests() const;
  // Requests whose pages are reserved and whose Prefill call is in flight.
  int64_t prefilling_requests() const;

 private:
  struct Live {
    // The capability Abort must present with the id (docs/SECURITY.md); immutable once live.
    std::string abort_token;
    std::atomic<bool> aborted{false};
    std::string abort_reason;  // guarded by the service's mu_
    std::atomic<bool> prefilling{false};
    // Set with `aborted` by EndLiveRequests: the call ends with UNAVAILABLE(shutdown_reason)
    // rather than as an abort.
    std::atomic<bool> shut_down{false};
    std::string shutdown_reason;  // guarded by the service's mu_
    std::shared_ptr<DecodeRequest> request;  // once it joined the batch
  };
  class Call;  // one Generate call as its phases (decode/serving/generate_call.h)
  // Generate without the final-status metric: the sequence of the Call's phases.
  grpc::Status GenerateCall(grpc::ServerContext* context,
                            const fluxion::v1::GenerateRequest* request,
                            grpc::ServerWriter<fluxion::v1::GenerateResponse>* writer);

  const model::Model* const model_;
  KvArena* const arena_;
  KvAdmission* const admission_;
  BatchScheduler* const scheduler_;
  transfer::Transport* const transport_;  // registers each reservation's runs
  const transfer::PeerDescriptor arena_descriptor_;
  const fluxion::v1::ServerInfo info_;
  const DecodeServiceOptions options_;
  PrefillClient prefill_client_;
  std::atomic<uint64_t> admission_seq_{0};
  std::atomic<bool> draining_{false};

  mutable absl::Mutex mu_;
  // By client request id. Ids need not be unique (a duplicate from another client must learn
  // nothing), so several live requests may share one; Abort tells them apart by abort token.
  std::multimap<std::string, std::shared_ptr<Live>> live_ ABSL_GUARDED_BY(mu_);
  // Names this process in the ids it sends to prefill nodes (random per start) and numbers the
  // Prefill attempts, so that no two attempts, of this process or another, share an id there.
  const std::string incarnation_;
  // Tokens that end a generation unless ignore_eos: config.json's and generation_config.json's.
  const std::vector<int64_t> eos_token_ids_;
  std::atomic<uint64_t> prefill_serial_{0};
  DecodeMetrics metrics_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_SERVING_DECODE_SERVICE_H_

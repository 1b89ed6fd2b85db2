// The names every Fluxion server exports at /metrics, in one place so that the services, the
// router, dashboards and docs/METRICS.md agree. docs/METRICS.md gives type, unit and labels for
// each, and the mapping to the Gateway API Inference Extension's endpoint picker.
#ifndef FLUXION_COMMON_METRICS_NAMES_H_
#define FLUXION_COMMON_METRICS_NAMES_H_

namespace fluxion::metrics::names {

// Decode node: what the endpoint picker reads (queue, running, KV utilisation, page size).
inline constexpr char kDecodeRequestsRunning[] = "fluxion_decode_requests_running";
// Waiting = queued for KV pages + prefilling (what vLLM's num_requests_waiting counts).
inline constexpr char kDecodeRequestsWaiting[] = "fluxion_decode_requests_waiting";
inline constexpr char kDecodeRequestsAwaitingPages[] = "fluxion_decode_requests_awaiting_pages";
inline constexpr char kDecodeRequestsPrefilling[] = "fluxion_decode_requests_prefilling";
inline constexpr char kKvCacheUsageRatio[] = "fluxion_kv_cache_usage_ratio";
inline constexpr char kKvPagesCapacity[] = "fluxion_kv_pages_capacity";
inline constexpr char kKvPagesFree[] = "fluxion_kv_pages_free";
inline constexpr char kKvPagesQuarantined[] = "fluxion_kv_pages_quarantined";
inline constexpr char kKvPageTokens[] = "fluxion_kv_page_tokens";
inline constexpr char kKvCacheConfigInfo[] = "fluxion_kv_cache_config_info";

// Decode node: requests, tokens, latency, steps, sparse attention.
inline constexpr char kDecodeRequestsTotal[] = "fluxion_decode_requests_total";
inline constexpr char kDecodeFinishedTotal[] = "fluxion_decode_finished_total";
inline constexpr char kDecodePromptTokensTotal[] = "fluxion_decode_prompt_tokens_total";
inline constexpr char kDecodeGenerationTokensTotal[] = "fluxion_decode_generation_tokens_total";
inline constexpr char kDecodeQueueSeconds[] = "fluxion_decode_queue_time_seconds";
inline constexpr char kDecodeTtftSeconds[] = "fluxion_decode_time_to_first_token_seconds";
inline constexpr char kDecodeTpotSeconds[] = "fluxion_decode_time_per_output_token_seconds";
inline constexpr char kDecodeE2eSeconds[] = "fluxion_decode_e2e_request_latency_seconds";
inline constexpr char kDecodeInterTokenLatencySeconds[] =
    "fluxion_decode_inter_token_latency_seconds";
inline constexpr char kDecodeRequestPrefillSeconds[] = "fluxion_decode_request_prefill_time_seconds";
inline constexpr char kDecodeRequestDecodeSeconds[] = "fluxion_decode_request_decode_time_seconds";
inline constexpr char kDecodeRequestPromptTokens[] = "fluxion_decode_request_prompt_tokens";
inline constexpr char kDecodeRequestGenerationTokens[] = "fluxion_decode_request_generation_tokens";
// The served model's name as a label (`model_name`, vLLM's), value 1.
inline constexpr char kModelInfo[] = "fluxion_model_info";
inline constexpr char kDecodeStepSeconds[] = "fluxion_decode_step_seconds";
inline constexpr char kDecodeStepCpuSecondsTotal[] = "fluxion_decode_step_cpu_seconds_total";
inline constexpr char kDecodeStepGpuSecondsTotal[] = "fluxion_decode_step_gpu_seconds_total";
inline constexpr char kDecodePreemptionsTotal[] = "fluxion_decode_preemptions_total";
inline constexpr char kDecodePreemptionsResumedTotal[] =
    "fluxion_decode_preemptions_resumed_total";
inline constexpr char kDecodePrefillExpiredTotal[] = "fluxion_decode_prefill_expired_total";
inline constexpr char kKvQuarantinedReservationsTotal[] =
    "fluxion_kv_quarantined_reservations_total";
inline constexpr char kSparseReadFraction[] = "fluxion_sparse_read_fraction";
inline constexpr char kSparseBudgetRatio[] = "fluxion_sparse_budget_ratio";
inline constexpr char kSparseHeadStepsTotal[] = "fluxion_sparse_head_steps_total";
inline constexpr char kSparseRowsTotal[] = "fluxion_sparse_rows_total";
inline constexpr char kSparseGuardError[] = "fluxion_sparse_guard_error";
inline constexpr char kSparseGuardChecksTotal[] = "fluxion_sparse_guard_checks_total";
inline constexpr char kSparseGuardAdjustmentsTotal[] = "fluxion_sparse_guard_adjustments_total";

// KV transfer (both ends).
inline constexpr char kTransferBytesTotal[] = "fluxion_transfer_bytes_total";
inline constexpr char kTransferSeconds[] = "fluxion_transfer_seconds";
inline constexpr char kTransferFailuresTotal[] = "fluxion_transfer_failures_total";
inline constexpr char kTransferLandingRefusedTotal[] = "fluxion_transfer_landing_refused_total";

// Prefill node.
inline constexpr char kPrefillRequestsQueued[] = "fluxion_prefill_requests_queued";
inline constexpr char kPrefillPromptTokensQueued[] = "fluxion_prefill_prompt_tokens_queued";
inline constexpr char kPrefillRequestsRunning[] = "fluxion_prefill_requests_running";
inline constexpr char kPrefillRequestsTotal[] = "fluxion_prefill_requests_total";
inline constexpr char kPrefillPromptTokensTotal[] = "fluxion_prefill_prompt_tokens_total";
inline constexpr char kPrefillStagingSlotsTotal[] = "fluxion_prefill_staging_slots_total";
inline constexpr char kPrefillStagingFullTotal[] = "fluxion_prefill_staging_full_total";
inline constexpr char kPrefillComputeSeconds[] = "fluxion_prefill_compute_seconds";
inline constexpr char kPrefillTransferTailSeconds[] = "fluxion_prefill_transfer_tail_seconds";

// Router.
inline constexpr char kRouterRequestsTotal[] = "fluxion_router_requests_total";
inline constexpr char kRouterRequestsInflight[] = "fluxion_router_requests_inflight";
inline constexpr char kRouterAttemptsTotal[] = "fluxion_router_attempts_total";
inline constexpr char kRouterShedTotal[] = "fluxion_router_shed_total";
inline constexpr char kRouterBackendsHealthy[] = "fluxion_router_backends_healthy";
inline constexpr char kRouterBackendState[] = "fluxion_router_backend_state";
inline constexpr char kRouterBackendEjectionsTotal[] = "fluxion_router_backend_ejections_total";
inline constexpr char kRouterTtftSeconds[] = "fluxion_router_time_to_first_token_seconds";
inline constexpr char kRouterE2eSeconds[] = "fluxion_router_e2e_request_latency_seconds";
// Router's OpenAI HTTP API: connections closed at accept by its limits, requests refused because
// the CPU work queue (parsing, tokenization) was full.
inline constexpr char kRouterHttpConnectionsRefusedTotal[] =
    "fluxion_router_http_connections_refused_total";
inline constexpr char kRouterHttpRequestsShedTotal[] = "fluxion_router_http_requests_shed_total";

}  // namespace fluxion::metrics::names

#endif  // FLUXION_COMMON_METRICS_NAMES_H_

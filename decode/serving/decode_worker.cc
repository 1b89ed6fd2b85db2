#include "decode/serving/decode_worker.h"

#include <unistd.h>

#include <iostream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/build_version.h"
#include "absl/time/clock.h"
#include "common/read_bandwidth.h"
#include "common/served_model_name.h"
#include "common/status_macros.h"
#include "model/generation_config.h"
#include "proto/convert.h"
#include "proto/prefill_seal.h"

namespace fluxion::decode {
namespace {

constexpr char kDecodeServiceName[] = "fluxion.v1.DecodeService";

// Create's two kinds of failure, told apart by code (serving::ReportStartError): the config
// (InvalidArgument) or a part that cannot be had (FailedPrecondition), with the message given.
absl::Status ConfigError(absl::string_view message) { return absl::InvalidArgumentError(message); }
absl::Status StartError(absl::string_view message) {
  return absl::FailedPreconditionError(message);
}

double BudgetOf(const DecodeWorkerConfig& config) {
  return config.default_policy == "full" ? 1.0 : config.default_budget;
}

}  // namespace

absl::Status ValidateDecodeWorkerConfig(const DecodeWorkerConfig& c) {
  FLUXION_RETURN_IF_ERROR(serving::ValidateDrainTimeoutMs(c.drain_timeout_ms));
  if (c.step_delay_ms < 0 || c.step_delay_ms > 60000) {
    return ConfigError(
        absl::StrCat("--test-step-delay-ms must be in [0, 60000], got ", c.step_delay_ms));
  }
  if (absl::Milliseconds(c.prefill_timeout_ms) + proto::kSealClockSkew > proto::kMaxSealLifetime) {
    return ConfigError(
        absl::StrCat("--prefill-timeout-ms ", c.prefill_timeout_ms, " plus the seal's ",
                     absl::FormatDuration(proto::kSealClockSkew),
                     " clock-skew allowance exceeds the longest seal prefill nodes accept (",
                     absl::FormatDuration(proto::kMaxSealLifetime), ")"));
  }
  if (absl::StatusOr<sparse::PolicyConfig> parsed =
          sparse::ParsePolicy(c.default_policy, BudgetOf(c));
      !parsed.ok()) {
    return ConfigError(absl::StrCat("--default-policy: ", parsed.status().message()));
  }
  if (c.device_selection_gib < 0) {
    return ConfigError(
        absl::StrCat("--device-selection-gib must be >= 0, got ", c.device_selection_gib));
  }
  if (c.max_model_len < 0) {
    return ConfigError(absl::StrCat("--max-model-len must be >= 0 (0 = the model's), got ",
                                    c.max_model_len));
  }
  if (c.host_read_gbps < 0) {
    return ConfigError(
        absl::StrCat("--host-read-gbps must be >= 0 (0 = measure), got ", c.host_read_gbps));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DecodeWorker>> DecodeWorker::Create(DecodeWorkerConfig config) {
  FLUXION_RETURN_IF_ERROR(ValidateDecodeWorkerConfig(config));
  std::unique_ptr<DecodeWorker> worker(new DecodeWorker(std::move(config)));
  FLUXION_RETURN_IF_ERROR(worker->ReadSecretsAndPeers());
  FLUXION_RETURN_IF_ERROR(worker->LoadModel());
  FLUXION_RETURN_IF_ERROR(worker->CreateArena());
  FLUXION_RETURN_IF_ERROR(worker->BuildService());
  return worker;
}

DecodeWorker::~DecodeWorker() { Shutdown(); }

absl::Status DecodeWorker::ReadSecretsAndPeers() {
  absl::StatusOr<proto::TransferSecret> secret =
      proto::TransferSecret::FromFile(config_.transfer_secret_file);
  if (!secret.ok()) return ConfigError(secret.status().message());
  transfer_secret_ = std::make_shared<const proto::TransferSecret>(*std::move(secret));
  auto server_credentials = serving::ServerCredentials(config_.tls);
  auto prefill_channel = serving::ClientChannelConfig(config_.prefill_tls);
  for (const absl::Status& s : {server_credentials.status(), prefill_channel.status()}) {
    if (!s.ok()) return ConfigError(s.message());
  }
  config_.serve.credentials = *server_credentials;
  prefill_channel_ = *prefill_channel;
  if (config_.node_name.empty()) {
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    config_.node_name =
        absl::StrCat("decode@", host, "/", getpid(), "/", absl::ToUnixMillis(absl::Now()));
  }
  PrefillPeers::Options peer_options;
  peer_options.addresses = config_.prefill_addresses;
  peer_options.dns = config_.prefill_dns;
  absl::StatusOr<std::unique_ptr<PrefillPeers>> peers =
      PrefillPeers::Create(std::move(peer_options));
  if (!peers.ok()) return ConfigError(peers.status().message());
  prefill_peers_ = std::move(*peers);
  return absl::OkStatus();
}

absl::Status DecodeWorker::LoadModel() {
  if (config_.host_read_gbps == 0) {
    // One thread: a head's selection and attention run on one core (granularity.h).
    config_.host_read_gbps = common::MeasureReadBandwidthGbps(size_t{64} << 20, 1, 3);
  }
  // Any request may name `fluxion` (and it is the default policy): the worker refuses to start
  // rather than serve it without its predictor.
  auto predictor = sparse::RequirePredictor(config_.fluxion_predictor, config_.model_dir);
  if (!predictor.ok()) return StartError(predictor.status().message());
  predictor_ = *std::move(predictor);
  auto model = model::Model::Load(config_.model_dir);
  if (!model.ok()) {
    return StartError(absl::StrCat("cannot load model from ", config_.model_dir, ": ",
                                   model.status().ToString()));
  }
  model_ = std::move(*model);
  const int64_t model_limit = model_->config().max_position_embeddings;
  if (config_.max_model_len > model_limit) {
    return StartError(absl::StrCat("--max-model-len ", config_.max_model_len,
                                   " exceeds the model's max_position_embeddings (", model_limit,
                                   "): positions beyond it were never trained"));
  }
  context_limit_ = config_.max_model_len > 0 ? config_.max_model_len : model_limit;
  auto generation = model::LoadGenerationConfig(config_.model_dir);
  if (!generation.ok()) return StartError(generation.status().message());
  generation_eos_ids_ = generation->eos_token_ids;
  auto hash = proto::ModelFingerprint(config_.model_dir);
  if (!hash.ok()) return StartError(hash.status().ToString());
  layout_ = proto::LayoutFor(model_->config(), config_.model_dir, *hash, config_.page_tokens);
  return absl::OkStatus();
}

absl::Status DecodeWorker::CreateArena() {
  auto transport = transfer::NewUcxTransport(
      config_.ucx.ToOptions(config_.node_name, proto::CompatibilityOf(layout_, 1)));
  if (!transport.ok()) {
    return StartError(absl::StrCat("cannot start UCX: ", transport.status().ToString()));
  }
  transport_ = std::move(*transport);
  // The arena is registered once; its descriptor gives every Prefill request the worker address
  // and the arena's base (the writable ranges are the reservation's own registrations).
  const model::AttentionShape shape = model_->attention_shape();
  const KvShape kv_shape{shape.num_layers, shape.num_kv_heads, shape.head_dim, config_.page_tokens};
  KvArenaOptions arena_options;
  arena_options.huge_pages = config_.huge_pages;
  auto arena = KvArena::Create(kv_shape.page_bytes(), config_.kv_pages, arena_options);
  if (!arena.ok()) {
    return StartError(
        absl::StrCat("KV arena of ", config_.kv_pages, " pages: ", arena.status().ToString()));
  }
  arena_ = std::move(*arena);
  auto registration = transport_->Register({arena_->base(), arena_->bytes()}, {true});
  if (!registration.ok()) {
    return StartError(absl::StrCat("registering the KV arena: ", registration.status().ToString()));
  }
  registration_ = std::move(*registration);
  auto descriptor = registration_->Describe();
  if (!descriptor.ok()) {
    return StartError(absl::StrCat("describing the KV arena: ", descriptor.status().ToString()));
  }
  descriptor_ = *std::move(descriptor);
  return absl::OkStatus();
}

absl::Status DecodeWorker::BuildService() {
  const model::AttentionShape shape = model_->attention_shape();
  const int64_t page_tokens = config_.page_tokens;
  const int64_t growth_pages = shape.num_layers * shape.num_kv_heads;
  node_metrics_ = std::make_unique<DecodeNodeMetrics>(
      &metrics::Registry::Default(),
      DecodeMetricsConfig{page_tokens, shape.num_layers, shape.num_kv_heads, config_.default_policy,
                          BudgetOf(config_),
                          ServedModelName(config_.served_model_name, config_.model_dir)});
  KvAdmissionOptions admission_options;
  admission_options.headroom_pages =
      growth_pages * ((config_.headroom_tokens + page_tokens - 1) / page_tokens);
  admission_options.max_waiting = config_.max_waiting;
  admission_ = std::make_unique<KvAdmission>(arena_.get(), admission_options);
  const kernels::cpu::CpuPool* pool = &config_.cpu_pool;
  StepExecutorOptions steps = config_.steps;
  const bool on_cuda = steps.device == StepDevice::kCuda;
  if (on_cuda && config_.selector == sparse::Selector::kDevice) {
    steps.cuda.compact_slots =
        CompactSlotsFor(shape, steps.cuda.max_context_tokens, config_.device_selection_gib,
                        steps.cuda.max_requests);
    // Without a place no request could select on the device: every fluxion / exact_topk request
    // would quietly take the CPU's scan, a step as slow as full attention over host KV.
    if (steps.cuda.compact_slots == 0 && steps.cuda.max_context_tokens > 0) {
      return ConfigError(absl::StrCat(
          "--device-selection-gib ", config_.device_selection_gib,
          " holds the compact keys of no request of --device-max-context ",
          steps.cuda.max_context_tokens, " tokens (",
          absl::StrFormat("%.2f", CompactGibPerRequest(shape, steps.cuda.max_context_tokens)),
          " GiB each): raise it, lower --device-max-context, or pass --selector host"));
    }
  }
  compact_places_ = steps.cuda.compact_slots;
  auto executor = NewStepExecutor(model_.get(), pool, arena_.get(), steps);
  if (!executor.ok()) {
    return StartError(absl::StrCat("--device cuda: ", executor.status().ToString()));
  }
  executor_ = std::move(*executor);
  scheduler_ =
      std::make_unique<BatchScheduler>(model_.get(), admission_.get(), growth_pages, page_tokens,
                                       node_metrics_.get(), executor_.get(), pool);
  scheduler_->SetStepDelayForTesting(absl::Milliseconds(config_.step_delay_ms));
  DecodeServiceOptions options;
  options.cpu_pool = pool;
  options.prefill_peers = prefill_peers_;
  options.prefill_channel = prefill_channel_;
  options.default_policy = config_.default_policy;
  options.default_budget = config_.default_budget;
  options.fluxion_predictor = predictor_;
  options.host_cost.read_gbps = config_.host_read_gbps;
  options.selector = on_cuda ? config_.selector : sparse::Selector::kHost;
  options.guard = config_.guard;
  options.output_projection =
      std::make_shared<const model::OutputProjection>(model_->output_projection());
  options.page_tokens = page_tokens;
  options.admission_timeout = absl::Milliseconds(config_.admission_timeout_ms);
  options.prefill_timeout = absl::Milliseconds(config_.prefill_timeout_ms);
  options.transfer_secret = transfer_secret_;
  options.abort_wait = absl::Milliseconds(config_.abort_wait_ms);
  options.quarantine_lease = absl::Milliseconds(config_.quarantine_ms);
  options.node_metrics = node_metrics_.get();
  options.context_limit = context_limit_;
  options.extra_eos_token_ids = generation_eos_ids_;
  fluxion::v1::ServerInfo info;
  info.set_role(fluxion::v1::SERVER_ROLE_DECODE);
  info.set_node_name(config_.node_name);
  *info.mutable_layout() = layout_;
  info.set_protocol_version(1);
  info.set_build_version(BuildVersion());
  info.set_max_context_tokens(static_cast<uint32_t>(context_limit_));
  service_ = std::make_unique<DecodeServiceImpl>(model_.get(), arena_.get(), admission_.get(),
                                                 scheduler_.get(), transport_.get(), descriptor_,
                                                 info, options);
  node_metrics_->Attach(service_.get(), scheduler_.get(), admission_.get(), arena_.get());
  return absl::OkStatus();
}

absl::Status DecodeWorker::Start() {
  // /readyz follows the health service: ready from SERVING until the drain starts.
  FLUXION_ASSIGN_OR_RETURN(serve_,
                           serving::GrpcServe::Start(config_.serve, {service_.get()},
                                                     &metrics::Registry::Default(), nullptr));
  // Ready: the model is loaded and the arena registered (docs/PROTOCOL.md, Health).
  serve_->SetServing({kDecodeServiceName}, true);
  PrintServing();
  serve_->WritePortFiles();
  return absl::OkStatus();
}

void DecodeWorker::PrintServing() const {
  const int metrics_port = serve_->metrics_port();
  std::cerr << "fluxion decode " << config_.node_name << " serving on port " << serve_->port()
            << ", " << config_.kv_pages << " KV pages of " << arena_->page_bytes() << " bytes"
            << (arena_->explicit_huge_pages() ? " (huge pages)" : "")
            << (metrics_port != 0 ? absl::StrCat(", /metrics on port ", metrics_port) : "")
            << "; fluxion policy: "
            << (predictor_ != nullptr ? "trained head-property predictor" : "rule-based fallback")
            << ", host read " << absl::StrFormat("%.1f", config_.host_read_gbps)
            << " GB/s per core, " << config_.cpu_pool.threads()
            << " CPU thread(s), decode steps: " << executor_->name()
            << (config_.steps.device == StepDevice::kCuda
                    ? " (CUDA dense halves and resident window)"
                    : "")
            << (compact_places_ > 0
                    ? absl::StrCat("; device selection: ", compact_places_,
                                   " requests at once (more wait for a place)")
                    : "")
            << "\n";
}

absl::Status DecodeWorker::Serve() { return serving::ServeUntilStopped(*this); }

int64_t DecodeWorker::Shutdown() {
  if (serve_ == nullptr) return 0;
  // Drain: NOT_SERVING (liveness stays SERVING), UNAVAILABLE for new requests, running ones
  // may finish; at the timeout the rest end with UNAVAILABLE naming it.
  const int64_t drain_timeout_ms = config_.drain_timeout_ms;
  serving::DrainPlan drain;
  drain.service_names = {kDecodeServiceName};
  drain.start_draining = [this] { service_->SetDraining(true); };
  drain.live_requests = [this] { return service_->live_requests(); };
  drain.end_remaining = [this, drain_timeout_ms] {
    service_->EndLiveRequests(absl::StrCat("the drain after SIGTERM ran past --drain-timeout-ms (",
                                           drain_timeout_ms, " ms)"));
  };
  drain.timeout = absl::Milliseconds(drain_timeout_ms);
  // A request in prefill ends once its prefill node answered the Abort (or --abort-wait-ms).
  drain.end_grace = absl::Milliseconds(config_.abort_wait_ms) + absl::Seconds(1);
  std::cerr << "fluxion decode " << config_.node_name << " draining: " << service_->live_requests()
            << " requests live, up to " << drain_timeout_ms << " ms\n";
  const int64_t left = serve_->Drain(drain);
  std::cerr << "fluxion decode " << config_.node_name << " stopped; " << left
            << " requests were still live at the drain timeout\n";
  serve_.reset();
  node_metrics_->Detach();
  return left;
}

}  // namespace fluxion::decode

#include "prefill/prefill_worker.h"

#include <unistd.h>

#include <iostream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/build_version.h"
#include "common/status_macros.h"
#include "model/cuda_dense_ops.h"
#include "proto/convert.h"
#include "proto/prefill_seal.h"
#include "transfer/kv_pages.h"

namespace fluxion::prefill {
namespace {

constexpr char kPrefillServiceName[] = "fluxion.v1.PrefillService";
// --max-batch-tokens' defaults. On the CPU the batched forward pays up to a few thousand rows
// (docs/SERVING.md, "Batching"). On the GPU one 512-token prompt's GEMMs already run at ~90% of a
// 2K-row batch's rate (Llama-3.1-8B shapes on an H100: 34.5K vs 37.9K tokens/s,
// bench/results/prefill-batch-8b-h100-20261206.json), while every request of a batch waits for
// the whole batch: larger device batches would raise the mean TTFT for nothing, so only short
// prompts go together.
constexpr int64_t kCpuMaxBatchTokens = 4096;
constexpr int64_t kDeviceMaxBatchTokens = 512;

// Create's two kinds of failure, told apart by code (serving::ReportStartError): the config
// (InvalidArgument) or a part that cannot be had (FailedPrecondition), with the message given.
absl::Status ConfigError(absl::string_view message) { return absl::InvalidArgumentError(message); }
absl::Status StartError(absl::string_view message) {
  return absl::FailedPreconditionError(message);
}

std::string DefaultNodeName() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return absl::StrCat("prefill@", host, "/", getpid(), "/", absl::ToUnixMillis(absl::Now()));
}

// The model's weights uploaded to GPU 0 as the device prefill's.
absl::StatusOr<std::unique_ptr<DevicePrefill>> MakeDevicePrefill(
    const model::Model& model, const DevicePrefillOptions& options) {
  FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<model::DenseOps> ops, model::NewCudaDenseOps(0));
  FLUXION_ASSIGN_OR_RETURN(model::ModelParams params, model.UploadParams(*ops));
  return DevicePrefill::Create(model.config(), std::move(ops), std::move(params), options);
}

const char* NameOf(ForwardDevice device) { return device == ForwardDevice::kCuda ? "cuda" : "cpu"; }

}  // namespace

absl::StatusOr<ForwardDevice> ParseForwardDevice(const std::string& name) {
  if (name == "cpu") return ForwardDevice::kCpu;
  if (name == "cuda") return ForwardDevice::kCuda;
  return ConfigError(absl::StrCat("--device must be cpu or cuda, not '", name, "'"));
}

absl::StatusOr<std::unique_ptr<PrefillWorker>> PrefillWorker::Create(PrefillWorkerConfig config) {
  FLUXION_RETURN_IF_ERROR(serving::ValidateDrainTimeoutMs(config.drain_timeout_ms));
  std::unique_ptr<PrefillWorker> worker(new PrefillWorker(std::move(config)));
  PrefillWorkerConfig& c = worker->config_;
  // Secrets and certificates are read now, before the model: a bad path fails in a second, not a
  // minute.
  absl::StatusOr<proto::TransferSecret> secret =
      proto::TransferSecret::FromFile(c.transfer_secret_file);
  if (!secret.ok()) return ConfigError(secret.status().message());
  auto server_credentials = serving::ServerCredentials(c.tls);
  if (!server_credentials.ok()) return ConfigError(server_credentials.status().message());
  c.serve.credentials = *std::move(server_credentials);
  if (c.node_name.empty()) c.node_name = DefaultNodeName();
  FLUXION_RETURN_IF_ERROR(worker->LoadModel());
  PrefillEngineOptions options;
  options.layerwise = c.layerwise;
  options.transfer_timeout = absl::Milliseconds(c.transfer_timeout_ms);
  options.layer_delay = absl::Milliseconds(c.layer_delay_ms);
  options.piece_tokens = c.piece_tokens;
  if (c.staging_ring_mib < 1) {
    return StartError(
        absl::StrCat("--staging-ring-mib must be at least 1, got ", c.staging_ring_mib));
  }
  options.staging_ring_bytes = static_cast<uint64_t>(c.staging_ring_mib) << 20;
  FLUXION_RETURN_IF_ERROR(worker->StartDevice(options));
  worker->engine_ =
      worker->gpu_ != nullptr
          ? std::make_unique<PrefillEngine>(worker->gpu_.get(), worker->transport_.get(),
                                            worker->layout_, options)
          : std::make_unique<PrefillEngine>(worker->model_.get(), worker->transport_.get(),
                                            worker->layout_, options);
  fluxion::v1::ServerInfo info;
  info.set_role(fluxion::v1::SERVER_ROLE_PREFILL);
  info.set_node_name(c.node_name);
  *info.mutable_layout() = worker->layout_;
  info.set_protocol_version(1);
  info.set_build_version(BuildVersion());
  info.set_max_context_tokens(static_cast<uint32_t>(worker->model_config_.max_position_embeddings));
  worker->node_metrics_ = std::make_unique<PrefillNodeMetrics>(&metrics::Registry::Default());
  worker->service_ =
      std::make_unique<PrefillServiceImpl>(worker->engine_.get(), worker->transport_.get(), info,
                                           *std::move(secret), worker->node_metrics_.get());
  worker->service_->SetMaxBatchTokens(worker->MaxBatchTokens());
  worker->service_->SetMaxQueuedRequests(c.max_queued_requests);
  worker->node_metrics_->Attach(worker->service_.get());
  return worker;
}

PrefillWorker::~PrefillWorker() { Shutdown(); }

absl::Status PrefillWorker::LoadModel() {
  auto model = model::Model::Load(config_.model_dir);
  if (!model.ok()) {
    return StartError(absl::StrCat("cannot load model from ", config_.model_dir, ": ",
                                   model.status().ToString()));
  }
  model_ = std::move(*model);
  model_config_ = model_->config();
  auto hash = proto::ModelFingerprint(config_.model_dir);
  if (!hash.ok()) return StartError(hash.status().ToString());
  layout_ = proto::LayoutFor(model_config_, config_.model_dir, *hash, config_.page_tokens);
  auto transport = transfer::NewUcxTransport(
      config_.ucx.ToOptions(config_.node_name, proto::CompatibilityOf(layout_, 1)));
  if (!transport.ok()) {
    return StartError(absl::StrCat("cannot start UCX: ", transport.status().ToString()));
  }
  transport_ = std::move(*transport);
  return absl::OkStatus();
}

absl::Status PrefillWorker::StartDevice(const PrefillEngineOptions& options) {
  if (config_.device != ForwardDevice::kCuda) return absl::OkStatus();
  absl::StatusOr<std::unique_ptr<DevicePrefill>> made = MakeDevicePrefill(
      *model_, DevicePrefillOptions{config_.device_chunk_tokens, model::SparseStateParams{}});
  if (!made.ok()) return StartError(absl::StrCat("--device cuda: ", made.status().ToString()));
  gpu_ = std::move(*made);
  const model::ModelConfig& m = model_config_;
  const int64_t staged = config_.device_staging_tokens >= 0 ? config_.device_staging_tokens
                                                            : m.max_position_embeddings;
  const transfer::KvPageGeometry geo{m.num_layers, m.num_kv_heads, m.head_dim, config_.page_tokens};
  if (staged > 0) {
    if (auto pinned = gpu_->HostStaging(DeviceStagingBytes(options, geo, staged)); !pinned.ok()) {
      return StartError(
          absl::StrCat("--device-staging-tokens ", staged, ": ", pinned.status().ToString()));
    }
  }
  model_.reset();  // the GPU holds its own bf16 copy; the fp32 host weights are not needed
  return absl::OkStatus();
}

int64_t PrefillWorker::MaxBatchTokens() const {
  if (config_.max_batch_tokens >= 0) return config_.max_batch_tokens;
  return gpu_ != nullptr ? kDeviceMaxBatchTokens : kCpuMaxBatchTokens;
}

absl::Status PrefillWorker::Start() {
  // /readyz follows the health service: ready from SERVING until the drain starts.
  FLUXION_ASSIGN_OR_RETURN(serve_,
                           serving::GrpcServe::Start(config_.serve, {service_.get()},
                                                     &metrics::Registry::Default(), nullptr));
  // Ready: the model is loaded and UCX is up (docs/PROTOCOL.md, Health).
  serve_->SetServing({kPrefillServiceName}, true);
  const int metrics_port = serve_->metrics_port();
  const int64_t arenas = config_.malloc_arenas;
  std::cerr << "fluxion prefill " << config_.node_name << " serving on port " << serve_->port()
            << (metrics_port != 0 ? absl::StrCat(", /metrics on port ", metrics_port) : "") << ", "
            << config_.cpu_pool.threads() << " CPU thread(s), forward on " << NameOf(config_.device)
            << ", malloc arenas "
            << (arenas > 0 ? absl::StrCat("<= ", arenas) : std::string("glibc default")) << "\n";
  serve_->WritePortFiles();
  return absl::OkStatus();
}

absl::Status PrefillWorker::Serve() { return serving::ServeUntilStopped(*this); }

int64_t PrefillWorker::Shutdown() {
  if (serve_ == nullptr) return 0;
  // Calls still open at the timeout are cancelled by the shutdown (no end_remaining): their
  // decode nodes retry them elsewhere before the first token.
  serving::DrainPlan drain;
  drain.service_names = {kPrefillServiceName};
  drain.start_draining = [this] { service_->SetDraining(true); };
  drain.live_requests = [this] { return service_->live_requests(); };
  drain.timeout = absl::Milliseconds(config_.drain_timeout_ms);
  const int64_t left = serve_->Drain(drain);
  std::cerr << "fluxion prefill " << config_.node_name << " stopped; " << left
            << " calls were still live at the drain timeout\n";
  serve_.reset();
  node_metrics_->Detach();
  return left;
}

}  // namespace fluxion::prefill

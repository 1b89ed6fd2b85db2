#include "prefill/commands.h"

#include <malloc.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <iostream>
#include <memory>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/cpu_threads.h"
#include "common/flag_set.h"
#include "common/grpc_security.h"
#include "common/metrics_http.h"
#include "common/server_main.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "kernels/cpu/process_cpu.h"
#include "common/status_macros.h"
#include "model/cuda_dense_ops.h"
#include "model/model.h"
#include "prefill/device_prefill.h"
#include "prefill/prefill_engine.h"
#include "prefill/prefill_service.h"
#include "proto/convert.h"
#include "proto/prefill_seal.h"
#include "transfer/kv_pages.h"
#include "transfer/page_meta.h"
#include "transfer/ucx_flags.h"

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


std::string DefaultNodeName(const std::string& role) {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return absl::StrCat(role, "@", host, "/", getpid(), "/", absl::ToUnixMillis(absl::Now()));
}

// The model's weights uploaded to GPU 0 as the device prefill's.
absl::StatusOr<std::unique_ptr<DevicePrefill>> MakeDevicePrefill(
    const model::Model& model, const DevicePrefillOptions& options) {
  FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<model::DenseOps> ops, model::NewCudaDenseOps(0));
  FLUXION_ASSIGN_OR_RETURN(model::ModelParams params, model.UploadParams(*ops));
  return DevicePrefill::Create(model.config(), std::move(ops), std::move(params), options);
}

}  // namespace

absl::StatusOr<int64_t> ApplyMallocArenaMax(int64_t requested, const char* env_value) {
  if (env_value != nullptr) {
    int64_t from_env = 0;
    // glibc took it at startup; report what it took (non-numbers it ignores: its default).
    return absl::SimpleAtoi(env_value, &from_env) && from_env > 0 ? from_env : 0;
  }
  if (requested == 0) return 0;
  if (requested < 1 || requested > 64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--malloc-arena-max is ", requested,
        "; give 1 to 64 malloc arenas, or 0 for glibc's default (8 per core)"));
  }
  if (mallopt(M_ARENA_MAX, static_cast<int>(requested)) != 1) {
    return absl::InternalError(absl::StrCat("mallopt(M_ARENA_MAX, ", requested, ") failed"));
  }
  return requested;
}

int RunPrefillCommand(const std::vector<std::string>& args) {
  std::string model_dir, listen = serving::LoopbackAddress(7001), port_file, node_name;
  std::string metrics_listen, metrics_port_file;
  int64_t page_tokens = 16, transfer_timeout_ms = 30000, layer_delay_ms = 0;
  int64_t drain_timeout_ms = 30000, piece_tokens = 512, max_batch_tokens = -1;
  int64_t max_queued_requests = PrefillServiceImpl::kDefaultMaxQueuedRequests;
  int64_t malloc_arena_max = kDefaultMallocArenaMax;
  bool layerwise = true;
  std::string device = "cpu";
  int64_t device_chunk_tokens = DevicePrefillOptions{}.chunk_tokens;
  int64_t device_staging_tokens = -1;
  int64_t staging_ring_mib = static_cast<int64_t>(PrefillEngineOptions{}.staging_ring_bytes >> 20);
  transfer::UcxFlags ucx;
  FlagSet flags("fluxion prefill",
                "Serves fluxion.v1.PrefillService: computes prompts and writes their KV into "
                "decode nodes' host memory over UCX, layer by layer.");
  flags.String("model", &model_dir, "model directory (config.json + safetensors)");
  flags.String("listen", &listen,
               "gRPC address to serve on (0.0.0.0:7001: every interface); port 0 picks a free "
               "port");
  flags.String("port-file", &port_file, "write the bound port into this file once serving");
  flags.String("node-name", &node_name, "unique name of this process (default: host/pid/time)");
  flags.String("metrics-listen", &metrics_listen,
               "HTTP address for Prometheus /metrics, host:port (port 0 picks a free port; "
               "empty: no endpoint)");
  flags.String("metrics-port-file", &metrics_port_file,
               "write the bound /metrics port into this file once serving");
  CpuThreadsFlag cpu_threads(flags, CpuRole::kServing);
  flags.String("device", &device,
               "where the forward runs: cpu, or cuda (GPU 0: bf16 weights in HBM, flash-style "
               "attention, KV copied to the host piece by piece and sent while the next layer "
               "computes; requests run one at a time)");
  flags.Int("device-chunk-tokens", &device_chunk_tokens,
            "with --device cuda: prompt rows per pass through the layers (activations scale with "
            "it; a piece's pages are sent after each chunk of each layer)");
  flags.Int("device-staging-tokens", &device_staging_tokens,
            "with --device cuda: pin, at start-up, the staging ring and the page records of a "
            "prompt of this many tokens (a longer prompt grows the records then). Default -1: "
            "the model's context length");
  flags.Int("staging-ring-mib", &staging_ring_mib,
            "host memory each request's KV pages pass through on their way to the decode node "
            "(pinned with --device cuda); pages that do not fit wait in the model's cache or "
            "HBM until earlier writes land, so the compute never waits on the link. At least "
            "one page of every KV head is used");
  flags.Int("page-tokens", &page_tokens, "tokens per KV page (must match the decode nodes)");
  flags.Bool("layerwise", &layerwise,
             "send each layer's KV as soon as it is computed (off: after the last layer)");
  flags.Int("transfer-timeout-ms", &transfer_timeout_ms,
            "bound on waiting for a request's KV writes to land");
  flags.Int("test-layer-delay-ms", &layer_delay_ms,
            "fault injection for tests: sleep after each layer's send");
  flags.Int("piece-tokens", &piece_tokens,
            "run the forward in pieces of this many tokens: cancellation is checked and pages are "
            "sent after each piece of each layer");
  flags.Int("max-batch-tokens", &max_batch_tokens,
            "queued requests run through one batched forward up to this many prompt tokens "
            "together (a larger request runs alone); 0 = one request at a time; -1 = 4096 on the "
            "CPU, 512 on the GPU (where one prompt's GEMMs already run near their batched rate)");
  flags.Int("max-queued-requests", &max_queued_requests,
            "Prefill calls that may wait for the compute slot; one more is refused with "
            "RESOURCE_EXHAUSTED (the decode node frees its pages, the router retries elsewhere); "
            "-1 = no bound. Default 64, the decode node's --max-waiting: a longer queue only "
            "holds KV pages reserved on decode nodes for a wait a retry elsewhere beats");
  flags.Int("drain-timeout-ms", &drain_timeout_ms,
            "on SIGTERM: refuse new requests (UNAVAILABLE) and wait this long for running ones "
            "to finish; calls still open then are cancelled and the process exits within 1 s "
            "more");
  flags.Int("malloc-arena-max", &malloc_arena_max,
            "cap on glibc malloc arenas, set before any thread starts: every server thread "
            "running a prompt would get an arena of its own and keep what it freed (RSS swung "
            "~720-1,340 MiB in the soak; flat ~380 MiB with 2); 0 = glibc's default; the "
            "MALLOC_ARENA_MAX environment variable, if set, wins");
  ucx.Register(flags);
  std::string transfer_secret_file;
  flags.String("transfer-secret-file", &transfer_secret_file,
               "file holding the secret this node shares with its decode nodes (32 to 4096 "
               "bytes; make one with `openssl rand -hex 32`): only prefill requests a decode "
               "node sealed with it are acted on, each once and before its expiry, so no one "
               "else can direct this node's KV writes (docs/SECURITY.md)");
  serving::ServerTlsOptions tls;
  serving::RegisterServerTlsFlags(flags, &tls);
  flags.Require("model");
  flags.Require("transfer-secret-file");
  if (int rc = ParseFlagsOrExit(flags, args); rc >= 0) return rc;
  if (absl::Status valid = serving::ValidateDrainTimeoutMs(drain_timeout_ms); !valid.ok()) {
    std::cerr << "error: " << valid.message() << "\n";
    return 2;
  }
  // First, while this is the only thread: arenas are handed out as threads first allocate.
  absl::StatusOr<int64_t> arenas =
      ApplyMallocArenaMax(malloc_arena_max, std::getenv("MALLOC_ARENA_MAX"));
  if (!arenas.ok()) {
    std::cerr << "error: " << arenas.status().message() << "\n";
    return 2;
  }
  // Before anything else (it may restart the process): the threads the forward runs on (a
  // handler's, the batch thread) start later and get the pool's size (kernels/cpu/process_cpu.h).
  absl::StatusOr<kernels::cpu::CpuPool> pool = kernels::cpu::SetUpProcessCpu(cpu_threads);
  if (!pool.ok()) {
    std::cerr << "error: " << pool.status().message() << "\n";
    return 2;
  }
  // Secrets and certificates are read now, before the model: a bad path fails in a second, not a
  // minute.
  absl::StatusOr<proto::TransferSecret> transfer_secret =
      proto::TransferSecret::FromFile(transfer_secret_file);
  if (!transfer_secret.ok()) {
    std::cerr << "error: " << transfer_secret.status().message() << "\n";
    return 2;
  }
  auto server_credentials = serving::ServerCredentials(tls);
  if (!server_credentials.ok()) {
    std::cerr << "error: " << server_credentials.status().message() << "\n";
    return 2;
  }
  if (node_name.empty()) node_name = DefaultNodeName("prefill");
  if (device != "cpu" && device != "cuda") {
    std::cerr << "error: --device must be cpu or cuda, not '" << device << "'\n";
    return 2;
  }

  auto model = model::Model::Load(model_dir);
  if (!model.ok()) {
    std::cerr << "error: cannot load model from " << model_dir << ": " << model.status() << "\n";
    return 1;
  }
  auto hash = proto::ModelFingerprint(model_dir);
  if (!hash.ok()) {
    std::cerr << "error: " << hash.status() << "\n";
    return 1;
  }
  const fluxion::v1::ModelLayout layout =
      proto::LayoutFor((*model)->config(), model_dir, *hash, page_tokens);
  auto transport =
      transfer::NewUcxTransport(ucx.ToOptions(node_name, proto::CompatibilityOf(layout, 1)));
  if (!transport.ok()) {
    std::cerr << "error: cannot start UCX: " << transport.status() << "\n";
    return 1;
  }
  PrefillEngineOptions options;
  options.layerwise = layerwise;
  options.transfer_timeout = absl::Milliseconds(transfer_timeout_ms);
  options.layer_delay = absl::Milliseconds(layer_delay_ms);
  options.piece_tokens = piece_tokens;
  if (staging_ring_mib < 1) {
    std::cerr << "error: --staging-ring-mib must be at least 1, got " << staging_ring_mib << "\n";
    return 1;
  }
  options.staging_ring_bytes = static_cast<uint64_t>(staging_ring_mib) << 20;
  const model::ModelConfig config = (*model)->config();
  std::unique_ptr<DevicePrefill> gpu;
  if (device == "cuda") {
    absl::StatusOr<std::unique_ptr<DevicePrefill>> made = MakeDevicePrefill(
        **model, DevicePrefillOptions{device_chunk_tokens, model::SparseStateParams{}});
    if (!made.ok()) {
      std::cerr << "error: --device cuda: " << made.status() << "\n";
      return 1;
    }
    gpu = std::move(*made);
    const int64_t staged =
        device_staging_tokens >= 0 ? device_staging_tokens : config.max_position_embeddings;
    const transfer::KvPageGeometry geo{config.num_layers, config.num_kv_heads, config.head_dim,
                                       page_tokens};
    if (staged > 0) {
      if (auto pinned = gpu->HostStaging(DeviceStagingBytes(options, geo, staged)); !pinned.ok()) {
        std::cerr << "error: --device-staging-tokens " << staged << ": " << pinned.status() << "\n";
        return 1;
      }
    }
    model->reset();  // the GPU holds its own bf16 copy; the fp32 host weights are not needed
  }
  PrefillEngine engine = gpu != nullptr
                             ? PrefillEngine(gpu.get(), transport->get(), layout, options)
                             : PrefillEngine(model->get(), transport->get(), layout, options);
  fluxion::v1::ServerInfo info;
  info.set_role(fluxion::v1::SERVER_ROLE_PREFILL);
  info.set_node_name(node_name);
  *info.mutable_layout() = layout;
  info.set_protocol_version(1);
  info.set_max_context_tokens(static_cast<uint32_t>(config.max_position_embeddings));
  PrefillNodeMetrics node_metrics(&metrics::Registry::Default());
  PrefillServiceImpl service(&engine, transport->get(), info, *std::move(transfer_secret),
                             &node_metrics);
  service.SetMaxBatchTokens(max_batch_tokens >= 0 ? max_batch_tokens
                            : gpu != nullptr       ? kDeviceMaxBatchTokens
                                                   : kCpuMaxBatchTokens);
  service.SetMaxQueuedRequests(max_queued_requests);
  node_metrics.Attach(&service);
  // /readyz (common/metrics_http.h): ready from SERVING until the drain starts.
  std::atomic<bool> ready{false};
  // Declared after everything its callbacks read, so it stops serving before they go away.
  auto metrics_started =
      serving::StartMetricsIfRequested(metrics_listen, &metrics::Registry::Default());
  if (!metrics_started.ok()) {
    std::cerr << "error: --metrics-listen " << metrics_listen << ": " << metrics_started.status()
              << "\n";
    return 1;
  }
  std::unique_ptr<metrics::MetricsHttpServer> metrics_server = std::move(*metrics_started);

  int port = 0;
  serving::GrpcServerOptions server_options;
  server_options.credentials = *server_credentials;
  auto server_started = serving::StartGrpcServer(listen, &service, &port, server_options);
  if (!server_started.ok()) {
    std::cerr << "error: " << server_started.status().message() << "\n";
    return 1;
  }
  std::unique_ptr<grpc::Server> server = std::move(*server_started);
  // Ready: the model is loaded and UCX is up (docs/PROTOCOL.md, Health).
  server->GetHealthCheckService()->SetServingStatus(kPrefillServiceName, true);
  ready = true;
  if (metrics_server) metrics_server->SetReadiness([&ready] { return ready.load(); });
  std::cerr << "fluxion prefill " << node_name << " serving on port " << port
            << (metrics_server ? absl::StrCat(", /metrics on port ", metrics_server->port()) : "")
            << ", " << pool->threads() << " CPU thread(s), forward on " << device
            << ", malloc arenas "
            << (*arenas > 0 ? absl::StrCat("<= ", *arenas) : std::string("glibc default"))
            << "\n";
  serving::WritePortFiles(port_file, port, metrics_port_file, metrics_server.get());
  serving::WaitForStopSignal();
  // Drain: NOT_SERVING (liveness stays SERVING), UNAVAILABLE for new Prefill calls, running ones
  // may finish; calls still open at the timeout are cancelled by the shutdown, which their decode
  // nodes see as a failed Prefill call (UNAVAILABLE, retried by the router before the first token;
  // docs/SERVING.md, "How a Prefill call ends").
  serving::DrainPlan drain;
  drain.service_names = {kPrefillServiceName};
  drain.start_draining = [&] {
    ready = false;
    service.SetDraining(true);
  };
  drain.live_requests = [&] { return service.live_requests(); };
  drain.timeout = absl::Milliseconds(drain_timeout_ms);
  const int64_t left = serving::DrainAndShutdown(server.get(), drain);
  std::cerr << "fluxion prefill " << node_name << " stopped; " << left
            << " calls were still live at the drain timeout\n";
  metrics_server.reset();
  node_metrics.Detach();
  return 0;
}

}  // namespace fluxion::prefill

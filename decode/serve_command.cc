#include "decode/serve_command.h"

#ifdef FLUXION_HAVE_CUDA
#include "decode/cuda_resident_window.h"
#endif

#include <unistd.h>

#include <atomic>
#include <iostream>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/cpu_threads.h"
#include "common/flag_set.h"
#include "common/grpc_security.h"
#include "common/metrics_http.h"
#include "common/server_main.h"
#include "decode/decode_metrics.h"
#include "decode/batch_scheduler.h"
#include "decode/decode_service.h"
#include "decode/kv_admission.h"
#include "decode/kv_arena.h"
#include "decode/paged_kv.h"
#include "decode/prefill_peers.h"
#include "common/read_bandwidth.h"
#include "decode/sparse/fluxion_predictor.h"
#include "decode/sparse/guard_flags.h"
#include "decode/sparse/policy.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "kernels/cpu/process_cpu.h"
#include "model/model.h"
#include "proto/convert.h"
#include "proto/prefill_seal.h"
#include "transfer/ucx_flags.h"

namespace fluxion::decode {
namespace {

constexpr char kDecodeServiceName[] = "fluxion.v1.DecodeService";


}  // namespace

int RunDecodeCommand(const std::vector<std::string>& args) {
  std::string model_dir, listen = serving::LoopbackAddress(7002), port_file, node_name;
  std::vector<std::string> prefill_addresses, prefill_dns;
  std::string metrics_listen, metrics_port_file;
  std::string default_policy = "fluxion";
  double default_budget = 0.1;
  int64_t page_tokens = 16, kv_pages = 65536, headroom_tokens = 64, max_waiting = 64;
  int64_t admission_timeout_ms = 10000, prefill_timeout_ms = 120000, abort_wait_ms = 2000;
  int64_t quarantine_ms = 30000, drain_timeout_ms = 30000, step_delay_ms = 0;
  bool huge_pages = true;
  transfer::UcxFlags ucx;
  FlagSet flags("fluxion decode",
                "Serves fluxion.v1.DecodeService: admits requests into a host KV arena that "
                "prefill nodes write over UCX, decodes them in a continuous batch with sparse "
                "attention, streams tokens.");
  flags.String("model", &model_dir, "model directory (config.json + safetensors)");
  std::string device = "cpu";
  int64_t device_max_requests = 128, device_max_context = 32768;
  // 0.5: faster than 0 at every 8B point measured (e.g. 1 x 128K 30.7 -> 26.7 ms, 4 x 32K 45.2
  // -> 29.2 ms: bench/results/decode-block-scores-zerocopy-8b-h200-20261202.json); shapes the
  // zero-copy kernel lacks read on the CPU anyway.
  double device_read_share = 0.5;
  // 2: the ping-pong step (decode/ping_pong_step_executor.h), the GPU's dense work of one
  // micro-batch overlapping the CPU's sparse attention of the other.
  // One pipeline by default: two micro-batches lose at batch <= 8 (each half reads every weight,
  // so the GPU's dense work doubles, and it delays the other half's block scores), and at
  // 16 x 32K they paid on one host and lost on another (docs/EXECUTOR.md section 8).
  int64_t micro_batches = 1;
  bool admit_off_step = false;
  // Dynamic degradation is opt-in: it spends less than the requested budget (decode/stall_guard.h).
  bool degrade_on_stall = false;
  double degrade_slack = 0.2, degrade_floor = 0.4;
  // Device selection's compact keys (kernels/compact_keys.h): 132 bytes per token, layer and KV
  // head at 8B shapes, so 16 GiB hold ~3.6 requests of 128K or ~14 of 32K beside 8B weights on an
  // 80 GB card (docs/SPARSE.md, "Device selection").
  double device_selection_gib = 16;
  std::string selector_flag = "device";
  flags.String("device", &device,
               "where decode steps run: cpu (the batched CPU step), or cuda (the hybrid step: "
               "dense halves and each request's sinks + recent window on GPU 0 in bf16, the rest "
               "of every policy's plan on the CPU over the host pages; docs/EXECUTOR.md section 7)");
  flags.Int("device-max-requests", &device_max_requests,
            "with --device cuda: requests the GPU's resident window holds at once (a request "
            "beyond them waits for a slot)");
  flags.Int("device-max-context", &device_max_context,
            "with --device cuda: tokens per request whose page bounds the GPU keeps to score "
            "quest's and fixed_*'s blocks (device memory: device-max-requests x this x "
            "layers x kv_heads x head_dim x 4 bytes / page-tokens); longer requests, and 0, "
            "score on the CPU");
  flags.Double("device-selection-gib", &device_selection_gib,
               "with --device cuda: GPU memory for the compact keys exact_topk and fluxion select "
               "from (132 bytes per token, layer and KV head at head_dim 128; requests of up to "
               "--device-max-context tokens); requests beyond it select on the CPU");
  flags.String("selector", &selector_flag,
               "where exact_topk and fluxion choose their rows: device (with --device cuda: the "
               "top-k of int8 compact keys in GPU memory; docs/SPARSE.md \"Device selection\") "
               "or host (the policies' own CPU selection; always with --device cpu)");
  flags.Double("device-read-share", &device_read_share,
               "with --device cuda: share in [0, 1] of every (request, KV head)'s host rows the "
               "GPU reads itself from the pinned arena while the CPU reads the rest");
  flags.Bool("admit-off-step", &admit_off_step,
             "with --device cuda and one micro-batch: load a joining request's window on a "
             "thread beside the steps instead of inside its first step (leave it a core: "
             "--cpu-threads below the machine's; docs/EXECUTOR.md section 7)");
  flags.Int("micro-batches", &micro_batches,
            "with --device cuda: 1 (one pipeline) or 2 (ping-pong: the batch split in two "
            "halves whose GPU and CPU work overlap, each half holding half of "
            "--device-max-requests; docs/EXECUTOR.md section 8; measured slower at batch <= 8 "
            "at 8B shapes)");
  flags.Bool("degrade-on-stall", &degrade_on_stall,
             "with --device cuda: when a step's CPU phase outlasts the GPU's work by more than "
             "--degrade-slack, the next steps' policies spend a smaller share (down to "
             "--degrade-floor) of their middle budget, recovering when the CPU is early again "
             "(trades attention quality for time per token; off by default)");
  flags.Double("degrade-slack", &degrade_slack,
               "with --degrade-on-stall: how much longer than the GPU's work the CPU phase may "
               "take before the budget shrinks (0.2: 20%)");
  flags.Double("degrade-floor", &degrade_floor,
               "with --degrade-on-stall: the smallest share of the middle budget, in (0, 1]");
  flags.String("listen", &listen,
               "gRPC address to serve on (0.0.0.0:7002: every interface); port 0 picks a free "
               "port");
  flags.String("port-file", &port_file, "write the bound port into this file once serving");
  flags.String("node-name", &node_name, "unique name of this process (default: host/pid/time)");
  flags.String("metrics-listen", &metrics_listen,
               "HTTP address for Prometheus /metrics, host:port (port 0 picks a free port; "
               "empty: no endpoint)");
  flags.String("metrics-port-file", &metrics_port_file,
               "write the bound /metrics port into this file once serving");
  flags.StringList("prefill-address", &prefill_addresses,
                   "prefill nodes this node trusts, host:port, comma-separated: the only ones a "
                   "request's prefill_address may name (else PERMISSION_DENIED), used in turn "
                   "for requests that name none");
  flags.StringList("prefill-dns", &prefill_dns,
                   "DNS names of trusted prefill nodes, name:port (every A record, e.g. the "
                   "headless service the router's --prefill-dns names); re-resolved on a miss at "
                   "most once a second");
  flags.String("default-policy", &default_policy,
               "sparse policy for requests that name none: " + sparse::PolicyNamesHelp());
  flags.Double("default-budget", &default_budget, "budget for requests that name none");
  std::string predictor_flag;
  flags.String("fluxion-predictor", &predictor_flag,
               "head-property predictor for the `fluxion` policy (JSON from "
               "tools/fluxion_predictor/train.py); default: <model>/fluxion_predictor.json if "
               "present (the worker refuses to start without one); `none`: fluxion runs its "
               "rule-based per-head budgets");
  double host_read_gbps = 0;
  flags.Double("host-read-gbps", &host_read_gbps,
               "one core's read bandwidth (GB/s) for the `fluxion` granularity cost model; "
               "0 = measure at start-up (a 64 MiB read probe, ~0.1 s)");
  sparse::GuardFlags guard_flags(flags);
  CpuThreadsFlag cpu_threads(flags, CpuRole::kServing);
  flags.Int("page-tokens", &page_tokens, "tokens per KV page");
  flags.Int("kv-pages", &kv_pages, "pages in the host KV arena (each layer x KV head x page)");
  flags.Int("headroom-tokens", &headroom_tokens,
            "tokens of growth per layer and head kept free when admitting a request");
  flags.Int("max-waiting", &max_waiting, "requests waiting for KV pages at most");
  flags.Int("admission-timeout-ms", &admission_timeout_ms, "longest wait for KV pages");
  flags.Int("prefill-timeout-ms", &prefill_timeout_ms, "bound on one Prefill call");
  std::string transfer_secret_file;
  flags.String("transfer-secret-file", &transfer_secret_file,
               "file holding the secret this node shares with its prefill nodes (32 to 4096 "
               "bytes; make one with `openssl rand -hex 32`): every prefill request is sealed "
               "with it, so prefill nodes write only where this node asked (docs/SECURITY.md)");
  flags.Require("transfer-secret-file");
  flags.Int("abort-wait-ms", &abort_wait_ms,
            "after aborting a prefill, how long to wait for its reply before quarantining");
  flags.Int("quarantine-ms", &quarantine_ms,
            "how long pages a prefill node may still write stay out of use");
  flags.Int("drain-timeout-ms", &drain_timeout_ms,
            "on SIGTERM: refuse new requests (UNAVAILABLE) and wait this long for running ones "
            "to finish; then the rest end with UNAVAILABLE naming the drain and the process "
            "exits within --abort-wait-ms + 2 s more (k8s/: terminationGracePeriodSeconds "
            "covers the sum)");
  flags.Int("test-step-delay-ms", &step_delay_ms,
            "fault injection for tests: sleep after each decode step (a lower bound on a "
            "request's decode time that no machine beats)");
  flags.Bool("huge-pages", &huge_pages, "back the arena with huge pages when available");
  ucx.Register(flags);
  serving::ServerTlsOptions tls;
  serving::RegisterServerTlsFlags(flags, &tls);
  serving::ClientTlsOptions prefill_tls;
  serving::RegisterClientTlsFlags(flags, "prefill-tls", "prefill nodes", &prefill_tls);
  flags.Require("model");
  if (int rc = ParseFlagsOrExit(flags, args); rc >= 0) return rc;
  if (absl::Status valid = serving::ValidateDrainTimeoutMs(drain_timeout_ms); !valid.ok()) {
    std::cerr << "error: " << valid.message() << "\n";
    return 2;
  }
  if (step_delay_ms < 0 || step_delay_ms > 60000) {
    std::cerr << "error: --test-step-delay-ms must be in [0, 60000], got " << step_delay_ms << "\n";
    return 2;
  }
  // Before anything else (it may restart the process): the batch scheduler's thread, gRPC's and
  // the read probe's all start with the pool's size (kernels/cpu/process_cpu.h).
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
  if (absl::Milliseconds(prefill_timeout_ms) + proto::kSealClockSkew > proto::kMaxSealLifetime) {
    std::cerr << "error: --prefill-timeout-ms " << prefill_timeout_ms << " plus the seal's "
              << absl::FormatDuration(proto::kSealClockSkew)
              << " clock-skew allowance exceeds the longest seal prefill nodes accept ("
              << absl::FormatDuration(proto::kMaxSealLifetime) << ")\n";
    return 2;
  }
  auto server_credentials = serving::ServerCredentials(tls);
  auto prefill_channel = serving::ClientChannelConfig(prefill_tls);
  for (const absl::Status& s : {server_credentials.status(), prefill_channel.status()}) {
    if (!s.ok()) {
      std::cerr << "error: " << s.message() << "\n";
      return 2;
    }
  }
  if (node_name.empty()) {
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    node_name = absl::StrCat("decode@", host, "/", getpid(), "/", absl::ToUnixMillis(absl::Now()));
  }
  PrefillPeers::Options peer_options;
  peer_options.addresses = prefill_addresses;
  peer_options.dns = prefill_dns;
  absl::StatusOr<std::unique_ptr<PrefillPeers>> prefill_peers =
      PrefillPeers::Create(std::move(peer_options));
  if (!prefill_peers.ok()) {
    std::cerr << "error: " << prefill_peers.status().message() << "\n";
    return 2;
  }
  {
    const double b = default_policy == "full" ? 1.0 : default_budget;
    auto parsed = sparse::ParsePolicy(default_policy, b);
    if (!parsed.ok()) {
      std::cerr << "error: --default-policy: " << parsed.status().message() << "\n";
      return 2;
    }
  }

  const absl::StatusOr<sparse::Selector> selector_parsed = sparse::ParseSelector(selector_flag);
  if (!selector_parsed.ok()) {
    std::cerr << "error: --selector: " << selector_parsed.status().message() << "\n";
    return 2;
  }
  const sparse::Selector selector = *selector_parsed;
  if (device_selection_gib < 0) {
    std::cerr << "error: --device-selection-gib must be >= 0, got " << device_selection_gib
              << "\n";
    return 2;
  }
  if (host_read_gbps < 0) {
    std::cerr << "error: --host-read-gbps must be >= 0 (0 = measure), got " << host_read_gbps
              << "\n";
    return 2;
  }
  if (host_read_gbps == 0) {
    // One thread: a head's selection and attention run on one core (granularity.h).
    host_read_gbps = common::MeasureReadBandwidthGbps(size_t{64} << 20, 1, 3);
  }
  // Any request may name `fluxion` (and it is the default policy): the worker refuses to start
  // rather than serve it without its predictor.
  auto predictor = sparse::RequirePredictor(predictor_flag, model_dir);
  if (!predictor.ok()) {
    std::cerr << "error: " << predictor.status().message() << "\n";
    return 1;
  }

  const absl::StatusOr<decode::sparse::GuardFlags::Parsed> guard_read = guard_flags.Read();
  if (!guard_read.ok()) {
    std::cerr << "error: " << guard_read.status().message() << "\n";
    return 2;
  }
  const std::vector<bool>* guard_modes = &guard_read->modes;
  const decode::sparse::GuardConfig* guard = &guard_read->config;
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
  const model::AttentionShape shape = (*model)->attention_shape();
  const fluxion::v1::ModelLayout layout =
      proto::LayoutFor((*model)->config(), model_dir, *hash, page_tokens);
  const KvShape kv_shape{shape.num_layers, shape.num_kv_heads, shape.head_dim, page_tokens};
  auto transport =
      transfer::NewUcxTransport(ucx.ToOptions(node_name, proto::CompatibilityOf(layout, 1)));
  if (!transport.ok()) {
    std::cerr << "error: cannot start UCX: " << transport.status() << "\n";
    return 1;
  }
  // The arena is registered once; its descriptor gives every Prefill request the worker address
  // and the arena's base (the writable ranges are the reservation's own registrations).
  KvArenaOptions arena_options;
  arena_options.huge_pages = huge_pages;
  auto created = KvArena::Create(kv_shape.page_bytes(), kv_pages, arena_options);
  if (!created.ok()) {
    std::cerr << "error: KV arena of " << kv_pages << " pages: " << created.status() << "\n";
    return 1;
  }
  std::unique_ptr<KvArena> arena = std::move(*created);
  absl::StatusOr<std::unique_ptr<transfer::Registration>> registration =
      (*transport)->Register({arena->base(), arena->bytes()}, {true});
  if (!registration.ok()) {
    std::cerr << "error: registering the KV arena: " << registration.status() << "\n";
    return 1;
  }
  auto descriptor = (*registration)->Describe();
  if (!descriptor.ok()) {
    std::cerr << "error: describing the KV arena: " << descriptor.status() << "\n";
    return 1;
  }
  const int64_t growth_pages = shape.num_layers * shape.num_kv_heads;
  KvAdmissionOptions admission_options;
  admission_options.headroom_pages = growth_pages * ((headroom_tokens + page_tokens - 1) / page_tokens);
  admission_options.max_waiting = max_waiting;
  {
    DecodeMetricsConfig metrics_config;
    metrics_config.page_tokens = page_tokens;
    metrics_config.num_layers = shape.num_layers;
    metrics_config.num_kv_heads = shape.num_kv_heads;
    metrics_config.default_policy = default_policy;
    metrics_config.default_budget = default_policy == "full" ? 1.0 : default_budget;
    DecodeNodeMetrics node_metrics(&metrics::Registry::Default(), metrics_config);
    KvAdmission admission(arena.get(), admission_options);
    DecodeServiceOptions options;
    options.cpu_pool = &*pool;
    std::unique_ptr<StepExecutor> executor;
    if (device == "cuda") {
#ifdef FLUXION_HAVE_CUDA
      if (!(device_read_share >= 0 && device_read_share <= 1)) {
        std::cerr << "error: --device-read-share must be in [0, 1], got " << device_read_share
                  << "\n";
        return 2;
      }
      if (micro_batches != 1 && micro_batches != 2) {
        std::cerr << "error: --micro-batches must be 1 or 2, got " << micro_batches << "\n";
        return 2;
      }
      if (micro_batches == 2 && admit_off_step) {
        std::cerr << "error: --admit-off-step works with one micro-batch only (the ping-pong "
                     "executor chooses a request's pipeline per step)\n";
        return 2;
      }
      if (micro_batches == 2 && device_max_requests < 2) {
        std::cerr << "error: --micro-batches 2 needs --device-max-requests >= 2 (one slot per "
                     "half), got " << device_max_requests << "; use --micro-batches 1\n";
        return 2;
      }
      // Locking a large arena takes a while (64 GiB: 18-32 s on the H200 host): say so.
      std::cerr << "pinning the " << (arena->bytes() >> 20) << " MiB KV arena for the GPU\n";
      if (absl::Status pinned = PinArenaForCuda(arena.get()); !pinned.ok()) {
        // Still serves: copies go through staging and the CPU reads every host row.
        std::cerr << "warning: " << pinned << "\n";
        device_read_share = 0;
      }
      CudaHybridOptions cuda_options;
      cuda_options.max_requests = device_max_requests;
      cuda_options.max_context_tokens = device_max_context;
      if (selector == sparse::Selector::kDevice) {
        cuda_options.compact_slots =
            CompactSlotsFor((*model)->attention_shape(), device_max_context,
                            device_selection_gib, device_max_requests);
      }
      cuda_options.page_tokens = page_tokens;
      cuda_options.device_read_share = device_read_share;
      cuda_options.micro_batches = static_cast<int>(micro_batches);
      cuda_options.off_step_admission = admit_off_step;
      cuda_options.stall_guard.enabled = degrade_on_stall;
      cuda_options.stall_guard.slack = degrade_slack;
      cuda_options.stall_guard.min_scale = degrade_floor;
      if (absl::Status valid = ValidateStallGuardOptions(cuda_options.stall_guard); !valid.ok()) {
        std::cerr << "error: --degrade-*: " << valid.message() << "\n";
        return 2;
      }
      auto hybrid = NewCudaHybridStepExecutor(model->get(), options.cpu_pool, cuda_options);
      if (!hybrid.ok()) {
        std::cerr << "error: --device cuda: " << hybrid.status() << "\n";
        return 1;
      }
      executor = std::move(*hybrid);
#else
      std::cerr << "error: --device cuda: this binary was built without CUDA; use --device cpu\n";
      return 1;
#endif
    } else if (device != "cpu") {
      std::cerr << "error: --device must be cpu or cuda, got '" << device << "'\n";
      return 2;
    } else {
      // The hybrid step's settings mean nothing to the CPU step: say so instead of ignoring them.
      if (micro_batches != 1 || degrade_on_stall || admit_off_step) {
        std::cerr << "error: --micro-batches, --degrade-on-stall and --admit-off-step take effect "
                     "with --device cuda only (the hybrid step); drop them or add --device cuda\n";
        return 2;
      }
      executor = NewCpuStepExecutor(model->get(), options.cpu_pool);
    }
    BatchScheduler scheduler(model->get(), &admission, growth_pages, page_tokens, &node_metrics,
                             executor.get(), options.cpu_pool);
    scheduler.SetStepDelayForTesting(absl::Milliseconds(step_delay_ms));
    options.prefill_peers = std::move(*prefill_peers);
    options.prefill_channel = *prefill_channel;
    options.default_policy = default_policy;
    options.default_budget = default_budget;
    options.fluxion_predictor = *predictor;
    options.host_cost.read_gbps = host_read_gbps;
    options.selector = device == "cuda" ? selector : sparse::Selector::kHost;
    options.guard = *guard;
    options.guard.enabled = (*guard_modes)[0];
    options.output_projection =
        std::make_shared<const model::OutputProjection>((*model)->output_projection());
    options.page_tokens = page_tokens;
    options.admission_timeout = absl::Milliseconds(admission_timeout_ms);
    options.prefill_timeout = absl::Milliseconds(prefill_timeout_ms);
    options.transfer_secret =
        std::make_shared<const proto::TransferSecret>(*std::move(transfer_secret));
    options.abort_wait = absl::Milliseconds(abort_wait_ms);
    options.quarantine_lease = absl::Milliseconds(quarantine_ms);
    options.node_metrics = &node_metrics;
    fluxion::v1::ServerInfo info;
    info.set_role(fluxion::v1::SERVER_ROLE_DECODE);
    info.set_node_name(node_name);
    *info.mutable_layout() = layout;
    info.set_protocol_version(1);
    info.set_max_context_tokens(
        static_cast<uint32_t>((*model)->config().max_position_embeddings));
    DecodeServiceImpl service(model->get(), arena.get(), &admission, &scheduler, transport->get(),
                              *descriptor, info, options);
    node_metrics.Attach(&service, &scheduler, &admission, arena.get());
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
    // Ready: the model is loaded and the arena registered (docs/PROTOCOL.md, Health).
    server->GetHealthCheckService()->SetServingStatus(kDecodeServiceName, true);
    ready = true;
    if (metrics_server) metrics_server->SetReadiness([&ready] { return ready.load(); });
    std::cerr << "fluxion decode " << node_name << " serving on port " << port << ", "
              << kv_pages << " KV pages of " << kv_shape.page_bytes() << " bytes"
              << (arena->explicit_huge_pages() ? " (huge pages)" : "")
              << (metrics_server ? absl::StrCat(", /metrics on port ", metrics_server->port()) : "")
              << "; fluxion policy: "
              << (*predictor != nullptr ? "trained head-property predictor" : "rule-based fallback")
              << ", host read " << absl::StrFormat("%.1f", host_read_gbps) << " GB/s per core"
              << ", " << pool->threads() << " CPU thread(s), decode steps: " << executor->name()
              << (device == "cuda" ? " (CUDA dense halves and resident window)" : "") << "\n";
    serving::WritePortFiles(port_file, port, metrics_port_file, metrics_server.get());
    serving::WaitForStopSignal();
    // Drain: NOT_SERVING (liveness stays SERVING), UNAVAILABLE for new requests, running ones
    // may finish; at the timeout the rest end with UNAVAILABLE naming it.
    serving::DrainPlan drain;
    drain.service_names = {kDecodeServiceName};
    drain.start_draining = [&] {
      ready = false;
      service.SetDraining(true);
    };
    drain.live_requests = [&] { return service.live_requests(); };
    drain.end_remaining = [&] {
      service.EndLiveRequests(absl::StrCat("the drain after SIGTERM ran past --drain-timeout-ms (",
                                           drain_timeout_ms, " ms)"));
    };
    drain.timeout = absl::Milliseconds(drain_timeout_ms);
    // A request in prefill ends once its prefill node answered the Abort (or --abort-wait-ms).
    drain.end_grace = absl::Milliseconds(abort_wait_ms) + absl::Seconds(1);
    std::cerr << "fluxion decode " << node_name << " draining: " << service.live_requests()
              << " requests live, up to " << drain_timeout_ms << " ms\n";
    const int64_t left = serving::DrainAndShutdown(server.get(), drain);
    std::cerr << "fluxion decode " << node_name << " stopped; " << left
              << " requests were still live at the drain timeout\n";
    metrics_server.reset();
    node_metrics.Detach();
  }
  return 0;
}

}  // namespace fluxion::decode

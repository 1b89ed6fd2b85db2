#include "decode/serving/serve_command.h"

#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/cpu_threads.h"
#include "common/flag_set.h"
#include "common/grpc_security.h"
#include "common/grpc_serve.h"
#include "decode/serving/decode_worker.h"
#include "decode/sparse/guard_flags.h"
#include "decode/sparse/policy.h"
#include "kernels/cpu/process_cpu.h"

namespace fluxion::decode {
namespace {

// The flags that do not land in DecodeWorkerConfig as they are: how steps run.
struct StepFlags {
  std::string device = "cpu";
  std::string selector = "device";
  int64_t max_requests = 128, max_context = 32768;
  // 0.5: faster than 0 at every 8B point measured (e.g. 1 x 128K 30.7 -> 26.7 ms, 4 x 32K 45.2
  // -> 29.2 ms: bench/results/decode-block-scores-zerocopy-8b-h200-20261202.json); shapes the
  // zero-copy kernel lacks read on the CPU anyway.
  double read_share = 0.5;
  // 2: the ping-pong step (decode/step/ping_pong_step_executor.h), the GPU's dense work of one
  // micro-batch overlapping the CPU's sparse attention of the other.
  // One pipeline by default: two micro-batches lose at batch <= 8 (each half reads every weight,
  // so the GPU's dense work doubles, and it delays the other half's block scores), and at
  // 16 x 32K they paid on one host and lost on another (docs/EXECUTOR.md section 8).
  int64_t micro_batches = 1;
  // Dynamic degradation is opt-in: it spends less than the requested budget
  // (decode/step/stall_guard.h).
  bool degrade_on_stall = false;
  double degrade_slack = 0.2, degrade_floor = 0.4;
};

void RegisterStepFlags(FlagSet& flags, StepFlags* s, DecodeWorkerConfig* c) {
  flags.String(
      "device", &s->device,
      "where decode steps run: cpu (the batched CPU step), or cuda (the hybrid step: "
      "dense halves and each request's sinks + recent window on GPU 0 in bf16, the rest "
      "of every policy's plan on the CPU over the host pages; docs/EXECUTOR.md section 7)");
  flags.Int("device-max-requests", &s->max_requests,
            "with --device cuda: requests the GPU's resident window holds at once (a request "
            "beyond them waits for a slot)");
  flags.Int("device-max-context", &s->max_context,
            "with --device cuda: tokens per request whose page bounds the GPU keeps to score "
            "quest's and fixed_*'s blocks (device memory: device-max-requests x this x "
            "layers x kv_heads x head_dim x 4 bytes / page-tokens); longer requests, and 0, "
            "score on the CPU");
  // Device selection's compact keys (kernels/compact_keys.h): 132 bytes per token, layer and KV
  // head at 8B shapes, so 16 GiB hold ~3.6 requests of 128K or ~14 of 32K beside 8B weights on an
  // 80 GB card (docs/SPARSE.md, "Device selection").
  flags.Double("device-selection-gib", &c->device_selection_gib,
               "with --device cuda: GPU memory for the compact keys exact_topk, lfps and fluxion "
               "select from (132 bytes per token, layer and KV head at head_dim 128; requests of "
               "up to --device-max-context tokens); a request beyond it waits for a place, and a "
               "value that holds no request is refused");
  flags.String("selector", &s->selector,
               "where exact_topk, lfps and fluxion choose their rows: device (with --device cuda: "
               "the top-k of int8 compact keys in GPU memory, lfps among its tables' candidates; "
               "docs/SPARSE.md \"Device selection\") or host (the policies' own CPU selection; "
               "always with --device cpu)");
  flags.Double("device-read-share", &s->read_share,
               "with --device cuda: share in [0, 1] of every (request, KV head)'s host rows the "
               "GPU reads itself from the pinned arena while the CPU reads the rest");
  flags.Int("micro-batches", &s->micro_batches,
            "with --device cuda: 1 (one pipeline) or 2 (ping-pong: the batch split in two "
            "halves whose GPU and CPU work overlap, each half holding half of "
            "--device-max-requests; docs/EXECUTOR.md section 8; measured slower at batch <= 8 "
            "at 8B shapes)");
  flags.Bool("degrade-on-stall", &s->degrade_on_stall,
             "with --device cuda: when a step's CPU phase outlasts the GPU's work by more than "
             "--degrade-slack, the next steps' policies spend a smaller share (down to "
             "--degrade-floor) of their middle budget, recovering when the CPU is early again "
             "(trades attention quality for time per token; off by default)");
  flags.Double("degrade-slack", &s->degrade_slack,
               "with --degrade-on-stall: how much longer than the GPU's work the CPU phase may "
               "take before the budget shrinks (0.2: 20%)");
  flags.Double("degrade-floor", &s->degrade_floor,
               "with --degrade-on-stall: the smallest share of the middle budget, in (0, 1]");
}

void RegisterServingFlags(FlagSet& flags, DecodeWorkerConfig* c) {
  serving::RegisterServeFlags(flags,
                              "gRPC address to serve on (0.0.0.0:7002: every interface); port 0 "
                              "picks a free port",
                              &c->serve);
  flags.String("node-name", &c->node_name, "unique name of this process (default: host/pid/time)");
  flags.StringList("prefill-address", &c->prefill_addresses,
                   "prefill nodes this node trusts, host:port, comma-separated: the only ones a "
                   "request's prefill_address may name (else PERMISSION_DENIED), used in turn "
                   "for requests that name none");
  flags.StringList("prefill-dns", &c->prefill_dns,
                   "DNS names of trusted prefill nodes, name:port (every A record, e.g. the "
                   "headless service the router's --prefill-dns names); re-resolved on a miss at "
                   "most once a second");
}

void RegisterPolicyFlags(FlagSet& flags, DecodeWorkerConfig* c) {
  flags.String("default-policy", &c->default_policy,
               "sparse policy for requests that name none: " + sparse::PolicyNamesHelp());
  flags.Double("default-budget", &c->default_budget, "budget for requests that name none");
  flags.String("fluxion-predictor", &c->fluxion_predictor,
               "head-property predictor for the `fluxion` policy (JSON from "
               "`fluxion calibrate`); default: <model>/fluxion_predictor.json if "
               "present (the worker refuses to start without one); `none`: fluxion runs its "
               "rule-based per-head budgets");
  flags.Double("host-read-gbps", &c->host_read_gbps,
               "one core's read bandwidth (GB/s) for the `fluxion` granularity cost model; "
               "0 = measure at start-up (a 64 MiB read probe, ~0.1 s)");
}

void RegisterKvFlags(FlagSet& flags, DecodeWorkerConfig* c) {
  flags.Int("page-tokens", &c->page_tokens, "tokens per KV page");
  flags.Int("kv-pages", &c->kv_pages, "pages in the host KV arena (each layer x KV head x page)");
  flags.Int("headroom-tokens", &c->headroom_tokens,
            "tokens of growth per layer and head kept free when admitting a request");
  flags.Int("max-waiting", &c->max_waiting, "requests waiting for KV pages at most");
  flags.Int("admission-timeout-ms", &c->admission_timeout_ms, "longest wait for KV pages");
  flags.Int("prefill-timeout-ms", &c->prefill_timeout_ms, "bound on one Prefill call");
  flags.String("transfer-secret-file", &c->transfer_secret_file,
               "file holding the secret this node shares with its prefill nodes (32 to 4096 "
               "bytes; make one with `openssl rand -hex 32`): every prefill request is sealed "
               "with it, so prefill nodes write only where this node asked (docs/SECURITY.md)");
  flags.Require("transfer-secret-file");
  flags.Int("abort-wait-ms", &c->abort_wait_ms,
            "after aborting a prefill, how long to wait for its reply before quarantining");
  flags.Int("quarantine-ms", &c->quarantine_ms,
            "how long pages a prefill node may still write stay out of use");
  flags.Int("drain-timeout-ms", &c->drain_timeout_ms,
            "on SIGTERM: refuse new requests (UNAVAILABLE) and wait this long for running ones "
            "to finish; then the rest end with UNAVAILABLE naming the drain and the process "
            "exits within --abort-wait-ms + 2 s more (k8s/: terminationGracePeriodSeconds "
            "covers the sum)");
  flags.Int("test-step-delay-ms", &c->step_delay_ms,
            "fault injection for tests: sleep after each decode step (a lower bound on a "
            "request's decode time that no machine beats)");
  flags.Bool("huge-pages", &c->huge_pages, "back the arena with huge pages when available");
}

// The step flags as StepExecutorOptions and the selector; InvalidArgument naming the flag.
absl::Status ResolveStepFlags(const StepFlags& s, DecodeWorkerConfig* c) {
  const absl::StatusOr<sparse::Selector> selector = sparse::ParseSelector(s.selector);
  if (!selector.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--selector: ", selector.status().message()));
  }
  c->selector = *selector;
  if (s.device != "cpu" && s.device != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("--device must be cpu or cuda, got '", s.device, "'"));
  }
  c->steps.device = *ParseStepDevice(s.device);
  if (c->steps.device == StepDevice::kCpu) {
    // The hybrid step's settings mean nothing to the CPU step: say so instead of ignoring them.
    if (s.micro_batches != 1 || s.degrade_on_stall) {
      return absl::InvalidArgumentError(
          "--micro-batches and --degrade-on-stall take effect with --device cuda only (the "
          "hybrid step); drop them or add --device cuda");
    }
    return absl::OkStatus();
  }
  if (!(s.read_share >= 0 && s.read_share <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--device-read-share must be in [0, 1], got ", s.read_share));
  }
  if (s.micro_batches != 1 && s.micro_batches != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("--micro-batches must be 1 or 2, got ", s.micro_batches));
  }
  if (s.micro_batches == 2 && s.max_requests < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("--micro-batches 2 needs --device-max-requests >= 2 (one slot per half), got ",
                     s.max_requests, "; use --micro-batches 1"));
  }
  CudaHybridOptions& cuda = c->steps.cuda;
  cuda.max_requests = s.max_requests;
  cuda.max_context_tokens = s.max_context;
  cuda.page_tokens = c->page_tokens;
  cuda.device_read_share = s.read_share;
  cuda.micro_batches = static_cast<int>(s.micro_batches);
  cuda.stall_guard = {s.degrade_on_stall, s.degrade_slack, s.degrade_floor};
  if (absl::Status valid = ValidateStallGuardOptions(cuda.stall_guard); !valid.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--degrade-*: ", valid.message()));
  }
  return absl::OkStatus();
}

}  // namespace

int RunDecodeCommand(const std::vector<std::string>& args) {
  DecodeWorkerConfig config;
  config.serve.listen = serving::LoopbackAddress(7002);
  StepFlags steps;
  FlagSet flags("fluxion decode",
                "Serves fluxion.v1.DecodeService: admits requests into a host KV arena that "
                "prefill nodes write over UCX, decodes them in a continuous batch with sparse "
                "attention, streams tokens.");
  flags.String("model", &config.model_dir, "model directory (config.json + safetensors)");
  flags.String("served-model-name", &config.served_model_name,
               "the model's name in /metrics (fluxion_model_info's model_name label): the "
               "router's --served-model-name (default: the model directory's name)");
  flags.Int("max-model-len", &config.max_model_len,
            "longest context (prompt plus generated tokens) a request may reach, at most the "
            "model's max_position_embeddings (0: that); longer prompts get INVALID_ARGUMENT in "
            "OpenAI's context-length words, and ServerInfo reports it");
  RegisterStepFlags(flags, &steps, &config);
  RegisterServingFlags(flags, &config);
  RegisterPolicyFlags(flags, &config);
  sparse::GuardFlags guard_flags(flags);
  CpuThreadsFlag cpu_threads(flags, CpuRole::kServing);
  RegisterKvFlags(flags, &config);
  config.ucx.Register(flags);
  serving::RegisterServerTlsFlags(flags, &config.tls);
  serving::RegisterClientTlsFlags(flags, "prefill-tls", "prefill nodes", &config.prefill_tls);
  flags.Require("model");
  if (int rc = ParseFlagsOrExit(flags, args); rc >= 0) return rc;
  if (absl::Status valid = ValidateDecodeWorkerConfig(config); !valid.ok()) {
    return serving::ReportStartError(valid);
  }
  if (absl::Status valid = ResolveStepFlags(steps, &config); !valid.ok()) {
    return serving::ReportStartError(valid);
  }
  const absl::StatusOr<sparse::GuardFlags::Parsed> guard = guard_flags.Read();
  if (!guard.ok()) {
    return serving::ReportStartError(absl::InvalidArgumentError(guard.status().message()));
  }
  config.guard = guard->config;
  config.guard.enabled = guard->modes[0];
  // Before anything that starts a thread (it may restart the process): the batch scheduler's
  // thread, gRPC's and the read probe's all start with the pool's size (process_cpu.h).
  absl::StatusOr<kernels::cpu::CpuPool> pool = kernels::cpu::SetUpProcessCpu(cpu_threads);
  if (!pool.ok()) {
    return serving::ReportStartError(absl::InvalidArgumentError(pool.status().message()));
  }
  config.cpu_pool = *std::move(pool);
  return serving::CreateAndServe<DecodeWorker>(std::move(config));
}

}  // namespace fluxion::decode

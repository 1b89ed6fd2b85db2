#include "prefill/commands.h"

#include <malloc.h>

#include <cstdlib>
#include <iostream>
#include <memory>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/cpu_threads.h"
#include "common/flag_set.h"
#include "common/grpc_security.h"
#include "common/grpc_serve.h"
#include "kernels/cpu/process_cpu.h"
#include "prefill/prefill_worker.h"

namespace fluxion::prefill {
namespace {

void RegisterServingFlags(FlagSet& flags, PrefillWorkerConfig* c) {
  flags.String("model", &c->model_dir, "model directory (config.json + safetensors)");
  serving::RegisterServeFlags(flags,
                              "gRPC address to serve on (0.0.0.0:7001: every interface); port 0 "
                              "picks a free port",
                              &c->serve);
  flags.String("node-name", &c->node_name, "unique name of this process (default: host/pid/time)");
}

void RegisterForwardFlags(FlagSet& flags, std::string* device, PrefillWorkerConfig* c) {
  flags.String("device", device,
               "where the forward runs: cpu, or cuda (GPU 0: bf16 weights in HBM, flash-style "
               "attention, KV copied to the host piece by piece and sent while the next layer "
               "computes; requests run one at a time)");
  flags.Int("device-chunk-tokens", &c->device_chunk_tokens,
            "with --device cuda: prompt rows per pass through the layers (activations scale with "
            "it; a piece's pages are sent after each chunk of each layer)");
  flags.Int("device-staging-tokens", &c->device_staging_tokens,
            "with --device cuda: pin, at start-up, the staging ring and the page records of a "
            "prompt of this many tokens (a longer prompt grows the records then). Default -1: "
            "the model's context length");
  flags.Int("staging-ring-mib", &c->staging_ring_mib,
            "host memory each request's KV pages pass through on their way to the decode node "
            "(pinned with --device cuda); pages that do not fit wait in the model's cache or "
            "HBM until earlier writes land, so the compute never waits on the link. At least "
            "one page of every KV head is used");
  flags.Int("page-tokens", &c->page_tokens, "tokens per KV page (must match the decode nodes)");
  flags.Bool("layerwise", &c->layerwise,
             "send each layer's KV as soon as it is computed (off: after the last layer)");
  flags.Int("transfer-timeout-ms", &c->transfer_timeout_ms,
            "bound on waiting for a request's KV writes to land");
  flags.Int("test-layer-delay-ms", &c->layer_delay_ms,
            "fault injection for tests: sleep after each layer's send");
  flags.Int("piece-tokens", &c->piece_tokens,
            "run the forward in pieces of this many tokens: cancellation is checked and pages are "
            "sent after each piece of each layer");
}

void RegisterQueueFlags(FlagSet& flags, int64_t* malloc_arena_max, PrefillWorkerConfig* c) {
  flags.Int("max-batch-tokens", &c->max_batch_tokens,
            "queued requests run through one batched forward up to this many prompt tokens "
            "together (a larger request runs alone); 0 = one request at a time; -1 = 4096 on the "
            "CPU, 512 on the GPU (where one prompt's GEMMs already run near their batched rate)");
  flags.Int("max-queued-requests", &c->max_queued_requests,
            "Prefill calls that may wait for the compute slot; one more is refused with "
            "RESOURCE_EXHAUSTED (the decode node frees its pages, the router retries elsewhere); "
            "-1 = no bound. Default 64, the decode node's --max-waiting: a longer queue only "
            "holds KV pages reserved on decode nodes for a wait a retry elsewhere beats");
  flags.Int("drain-timeout-ms", &c->drain_timeout_ms,
            "on SIGTERM: refuse new requests (UNAVAILABLE) and wait this long for running ones "
            "to finish; calls still open then are cancelled and the process exits within 1 s "
            "more");
  flags.Int("malloc-arena-max", malloc_arena_max,
            "cap on glibc malloc arenas, set before any thread starts: every server thread "
            "running a prompt would get an arena of its own and keep what it freed (RSS swung "
            "~720-1,340 MiB in the soak; flat ~380 MiB with 2); 0 = glibc's default; the "
            "MALLOC_ARENA_MAX environment variable, if set, wins");
}

void RegisterSecurityFlags(FlagSet& flags, PrefillWorkerConfig* c) {
  c->ucx.Register(flags);
  flags.String("transfer-secret-file", &c->transfer_secret_file,
               "file holding the secret this node shares with its decode nodes (32 to 4096 "
               "bytes; make one with `openssl rand -hex 32`): only prefill requests a decode "
               "node sealed with it are acted on, each once and before its expiry, so no one "
               "else can direct this node's KV writes (docs/SECURITY.md)");
  serving::RegisterServerTlsFlags(flags, &c->tls);
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
  PrefillWorkerConfig config;
  config.serve.listen = serving::LoopbackAddress(7001);
  std::string device = "cpu";
  int64_t malloc_arena_max = kDefaultMallocArenaMax;
  FlagSet flags("fluxion prefill",
                "Serves fluxion.v1.PrefillService: computes prompts and writes their KV into "
                "decode nodes' host memory over UCX, layer by layer.");
  RegisterServingFlags(flags, &config);
  CpuThreadsFlag cpu_threads(flags, CpuRole::kServing);
  RegisterForwardFlags(flags, &device, &config);
  RegisterQueueFlags(flags, &malloc_arena_max, &config);
  RegisterSecurityFlags(flags, &config);
  flags.Require("model");
  flags.Require("transfer-secret-file");
  if (int rc = ParseFlagsOrExit(flags, args); rc >= 0) return rc;
  absl::StatusOr<ForwardDevice> forward = ParseForwardDevice(device);
  if (!forward.ok()) return serving::ReportStartError(forward.status());
  config.device = *forward;
  // First, while this is the only thread: arenas are handed out as threads first allocate.
  absl::StatusOr<int64_t> arenas =
      ApplyMallocArenaMax(malloc_arena_max, std::getenv("MALLOC_ARENA_MAX"));
  if (!arenas.ok()) return serving::ReportStartError(arenas.status());
  config.malloc_arenas = *arenas;
  // Before anything else (it may restart the process): the threads the forward runs on (a
  // handler's, the batch thread) start later and get the pool's size (kernels/cpu/process_cpu.h).
  absl::StatusOr<kernels::cpu::CpuPool> pool = kernels::cpu::SetUpProcessCpu(cpu_threads);
  if (!pool.ok()) {
    return serving::ReportStartError(absl::InvalidArgumentError(pool.status().message()));
  }
  config.cpu_pool = *std::move(pool);
  return serving::CreateAndServe<PrefillWorker>(std::move(config));
}

}  // namespace fluxion::prefill

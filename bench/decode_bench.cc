#include "bench/decode_bench.h"

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <iostream>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "bench/bench_util.h"
#include "bench/executor_bench.h"
#include "bench/hybrid_bench.h"
#include "common/cpu_threads.h"
#include "common/flag_set.h"
#include "decode/sparse/guard_flags.h"
#include "decode/sparse/policy.h"
#include "kernels/cpu/process_cpu.h"
#include "model/random_model.h"
#ifdef FLUXION_HAVE_CUDA
#include "kernels/cuda/paged_decode.h"
#endif

namespace fluxion::bench {
namespace {

// Flags only one of the two measurements takes: given to the other, they are a usage error rather
// than silently ignored.
constexpr const char* kExecutorOnlyFlags[] = {"model", "kv"};
constexpr const char* kHybridOnlyFlags[] = {
    "profile",         "device-read-share", "micro-batches", "block-scores",     "selector",
    "host-memory-gib", "hbm-kernels",       "degrade-on-stall", "layers"};

// Every flag of the command. The flags both measurements take but with different defaults start
// unset (empty, 0) and get the chosen measurement's default after parsing (ApplyDefaults).
struct DecodeBenchFlags {
  ExecutorBenchOptions executor;                 // the CPU executors' own flags land here
  HybridBenchOptions hybrid;                     // the hybrid step's own flags land here
  DecodeBenchFlags() { hybrid.device.clear(); }  // no default: --device picks the measurement
  std::string preset;
  std::vector<int64_t> contexts;
  std::vector<int64_t> batches = {1, 4, 8, 16};
  std::vector<int64_t> cpu_threads;
  std::vector<std::string> policies;
  std::vector<double> budgets = {0.05};
  int64_t steps = 0;
  std::string json_path;
};

constexpr char kSummary[] =
    "Times the decode step of a batch of requests. Without --device: the batched CPU step "
    "executor against the per-request loop, in the same run over the same host pages (a --model "
    "or random weights of a --preset). With --device cpu|cuda: the hybrid step (dense halves and "
    "the resident window on the device, the rest of each policy's plan on the CPU over host "
    "pages) at real model shapes with random weights, per context, batch and policy, with the "
    "GPU-only step of the same run. Flags marked [executors] or [--device] apply to that one "
    "only.";

void RegisterSharedFlags(FlagSet& flags, DecodeBenchFlags& f) {
  flags.String("device", &f.hybrid.device,
               "cuda, or cpu (the host stand-in of the device half): time the hybrid step; "
               "absent: time the CPU step executors");
  flags.String("preset", &f.preset,
               "model shape with random weights: " + absl::StrJoin(model::PresetNames(), ", ") +
                   " (default: qwen2.5-0.5b, when --model is not given; with --device: "
                   "llama3.1-8b)");
  flags.IntList("contexts", &f.contexts,
                "tokens each request holds before the timed steps (default: 1024,4096,16384; with "
                "--device: 32768,65536,131072)");
  flags.IntList("batch", &f.batches, "batch sizes");
  flags.IntList("cpu-threads", &f.cpu_threads,
                "CPU threads of the one pool for BLAS and attention: the executors time each "
                "value (default: 1); --device takes one value (default 0: every CPU this process "
                "may use)");
  flags.StringList("policy", &f.policies,
                   "policies: " + decode::sparse::PolicyNamesHelp() +
                       "; with --device lfps / fluxion run under each --profile, and policies "
                       "needing a prefill's sparse state are refused (default: full,fluxion; with "
                       "--device: full,fixed_32_0.05,fixed_32_0.02,fixed_16_0.05)");
  flags.DoubleList("budget", &f.budgets, "read budgets for the sparse policies");
  flags.Int("steps", &f.steps,
            "timed steps per point, after the warm-up (median); 0: 3, or 5 with --device");
}

void RegisterExecutorFlags(FlagSet& flags, ExecutorBenchOptions& o) {
  flags.String("model", &o.model_dir,
               "[executors] model directory (default: random weights of --preset)");
  flags.String("kv", &o.kv,
               "[executors] prompt KV: prefill (the model over random tokens), random (random "
               "rows: any shape, no prefill compute) or auto (prefill for --model, random for "
               "--preset)");
}

void RegisterHybridFlags(FlagSet& flags, HybridBenchOptions& o) {
  flags.StringList("profile", &o.profiles,
                   "[--device] decision profiles lfps and fluxion replay (each policy once per "
                   "profile): conservative (every head a retrieval head at the full budget) or a "
                   "profile file from fluxion eval tasks --record-profile (bench/profiles/)");
  flags.DoubleList("device-read-share", &o.device_read_shares,
                   "[--device] shares of every (request, KV head)'s host rows the GPU reads itself "
                   "from pinned host pages while the CPU reads the rest; each value a row");
  flags.IntList("micro-batches", &o.micro_batches,
                "[--device] 1 (one hybrid pipeline) and/or 2 (the ping-pong executor: the batch in "
                "two halves, one's GPU work overlapping the other's CPU attention); each value a "
                "row");
  flags.StringList("block-scores", &o.block_scores,
                   "[--device] where quest's and fixed_*'s block scores come from: device (the "
                   "window's page bounds next to the dense halves) and/or cpu (the CPU scans the "
                   "host pages' bounds); with both, each is a row");
  flags.StringList("selector", &o.selectors,
                   "[--device] where exact_topk, lfps and fluxion choose their rows: device (the "
                   "top-k of the int8 compact keys the window keeps in HBM, docs/SPARSE.md "
                   "\"Device selection\") and/or host (the policy's own selection on the CPU); "
                   "with both, each is a row");
  flags.Double("host-memory-gib", &o.host_memory_gib,
               "[--device] host memory the requests' KV may take (points beyond it are skipped); "
               "0 = 80% of MemAvailable");
  flags.StringList("hbm-kernels", &o.hbm_kernels,
                   "[--device] paged kernels of the HBM-resident reference row (v3, v5; "
                   "kernels/cuda/paged_decode.h); each a row");
  flags.Bool("degrade-on-stall", &o.degrade_on_stall,
             "[--device] every row with dynamic degradation on (fluxion decode "
             "--degrade-on-stall: the budget shrinks while the CPU phase outlasts the GPU's "
             "work); the JSON records the budget share the last step ran at");
  flags.Int("layers", &o.layers,
            "[--device] run only the preset's first N layers (0: all): to profile the CPU half at "
            "real head shapes where the whole model does not fit; not the model's step time");
}

// A flag of the other measurement is refused, naming it.
absl::Status CheckFlagsApply(const FlagSet& flags, bool hybrid) {
  if (hybrid) {
    for (const char* name : kExecutorOnlyFlags) {
      if (flags.WasSet(name)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name, " applies to the CPU executors only (without --device)"));
      }
    }
    return absl::OkStatus();
  }
  for (const char* name : kHybridOnlyFlags) {
    if (flags.WasSet(name)) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, " needs --device cpu|cuda"));
    }
  }
  return absl::OkStatus();
}


bool AllIn(const std::vector<int64_t>& v, int64_t lo, int64_t hi) {
  return !v.empty() &&
         std::all_of(v.begin(), v.end(), [lo, hi](int64_t x) { return x >= lo && x <= hi; });
}

// The CPU executors' options from the flags, their defaults and their checks.
absl::StatusOr<ExecutorBenchOptions> ExecutorOptions(const DecodeBenchFlags& f,
                                                     std::vector<int64_t> threads) {
  ExecutorBenchOptions o = f.executor;
  if (!f.preset.empty()) o.preset = f.preset;
  if (!f.contexts.empty()) o.contexts = f.contexts;
  if (!threads.empty()) o.threads = std::move(threads);
  if (!f.policies.empty()) o.policies = f.policies;
  if (f.steps != 0) o.steps = f.steps;
  o.batches = f.batches;
  o.budgets = f.budgets;
  if (o.kv != "auto" && o.kv != "prefill" && o.kv != "random") {
    return absl::InvalidArgumentError("--kv must be auto, prefill or random");
  }
  if (!AllIn(o.contexts, 1, 1 << 20) || !AllIn(o.batches, 1, 256) || !AllIn(o.threads, 1, 1024) ||
      o.steps < 1 || o.steps > 1000) {
    return absl::InvalidArgumentError(
        "--contexts in [1, 1048576], --batch in [1, 256], --cpu-threads in [1, 1024], --steps in [1, "
        "1000]");
  }
  return o;
}

// The hybrid step's options from the flags, their defaults and their checks.
absl::StatusOr<HybridBenchOptions> HybridOptions(const DecodeBenchFlags& f) {
  HybridBenchOptions o = f.hybrid;
  if (!f.preset.empty()) o.preset = f.preset;
  if (!f.contexts.empty()) o.contexts = f.contexts;
  if (!f.policies.empty()) o.policies = f.policies;
  if (f.steps != 0) o.steps = f.steps;
  o.batches = f.batches;
  o.budgets = f.budgets;
#ifdef FLUXION_HAVE_CUDA
  for (const std::string& k : o.hbm_kernels) {
    kernels::cuda::PagedKernel kernel;
    if (!kernels::cuda::PagedKernelFromName(k, &kernel)) {
      return absl::InvalidArgumentError(absl::StrCat("--hbm-kernels: unknown kernel '", k, "'"));
    }
  }
#endif
  if (!AllIn(o.contexts, 1, 1 << 21) || !AllIn(o.batches, 1, 256) || o.steps < 1 ||
      o.steps > 1000 || o.layers < 0) {
    return absl::InvalidArgumentError(
        "--contexts in [1, 2097152], --batch in [1, 256], --steps in [1, 1000], --layers >= 0");
  }
  if (!AllIn(o.micro_batches, 1, 2)) {
    return absl::InvalidArgumentError("--micro-batches takes 1 and/or 2");
  }
  return o;
}

// The hybrid step's one pool: one --cpu-threads value, 0 (or none) for every CPU it may use.
absl::StatusOr<int> HybridPoolThreads(const std::vector<int64_t>& threads) {
  if (threads.size() > 1) {
    return absl::InvalidArgumentError("--cpu-threads takes one value with --device");
  }
  const int64_t n = threads.empty() ? 0 : threads[0];
  if (n < 0 || n > kMaxCpuThreads) {
    return absl::InvalidArgumentError(absl::StrCat("--cpu-threads must be in [0, ", kMaxCpuThreads,
                                                   "] (0 = the default), got ", n));
  }
  return n == 0 ? DefaultCpuThreads(CpuRole::kOffline, AvailableCpus()) : static_cast<int>(n);
}

int UsageError(const absl::Status& s) {
  std::cerr << "error: " << s.message() << "\n";
  return 2;
}

// Runs the CPU executors and writes --json at the end.
int RunExecutors(const ExecutorBenchOptions& o, const std::string& json_path,
                 const std::string& command) {
  // The sweep's points size their own pools; until then the process holds every CPU it may use,
  // set before any compute (kernels/cpu/process_cpu.h).
  kernels::cpu::SetUpProcessCpu(AvailableCpus());
  nlohmann::json results = nlohmann::json::array();
  if (absl::Status s = RunExecutorBench(o, &results); !s.ok()) {
    std::cerr << "error: " << s << "\n";
    return 1;
  }
  if (!json_path.empty()) {
    if (absl::Status s = WriteJson(json_path, ResultEnvelope(command, {}, results)); !s.ok()) {
      std::cerr << "error: " << s << "\n";
      return 1;
    }
  }
  return 0;
}

// Runs the hybrid step, writing --json after every point (a run cut short keeps what it measured)
// and after an error.
int RunHybrid(const HybridBenchOptions& o, int threads, const std::string& json_path,
              const std::string& command) {
  const kernels::cpu::CpuPool pool = kernels::cpu::SetUpProcessCpu(threads);
  nlohmann::json results = nlohmann::json::array();
  absl::Status written;
  auto write = [&] {
    if (json_path.empty() || !written.ok()) return;
    written = WriteJson(json_path, ResultEnvelope(command, {}, results));
  };
  if (absl::Status s = RunHybridBench(o, pool, &results, write); !s.ok()) {
    std::cerr << "error: " << s << "\n";
    write();
    return 1;
  }
  write();
  if (!written.ok()) {
    std::cerr << "error: " << written << "\n";
    return 1;
  }
  return 0;
}

}  // namespace

int RunDecodeBench(const std::vector<std::string>& args) {
  DecodeBenchFlags f;
  FlagSet flags("fluxion bench decode", kSummary);
  RegisterSharedFlags(flags, f);
  RegisterExecutorFlags(flags, f.executor);
  RegisterHybridFlags(flags, f.hybrid);
  flags.String("json", &f.json_path, "also write results to this file");
  decode::sparse::GuardFlags guard_flags(flags, /*allow_both=*/true);
  if (int rc = ParseFlagsOrExit(flags, args); rc >= 0) return rc;
  const bool hybrid = flags.WasSet("device");
  if (absl::Status s = CheckFlagsApply(flags, hybrid); !s.ok()) return UsageError(s);
  auto guard = guard_flags.Read();
  if (!guard.ok()) return UsageError(guard.status());
  const std::vector<int64_t>& threads = f.cpu_threads;
  const std::string command = JoinCommand("fluxion bench decode", args);
  if (!hybrid) {
    f.executor.guard_modes = guard->modes;
    f.executor.guard = guard->config;
    absl::StatusOr<ExecutorBenchOptions> o = ExecutorOptions(f, threads);
    if (!o.ok()) return UsageError(o.status());
    return RunExecutors(*o, f.json_path, command);
  }
  f.hybrid.guard_modes = guard->modes;
  f.hybrid.guard = guard->config;
  absl::StatusOr<HybridBenchOptions> o = HybridOptions(f);
  if (!o.ok()) return UsageError(o.status());
  absl::StatusOr<int> pool_threads = HybridPoolThreads(threads);
  if (!pool_threads.ok()) return UsageError(pool_threads.status());
  return RunHybrid(*o, *pool_threads, f.json_path, command);
}

}  // namespace fluxion::bench

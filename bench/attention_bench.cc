// `fluxion bench attention`: one decode step of one (layer, KV head) with its GQA group over host
// KV pages, per policy and read budget, at several contexts, single- and multi-threaded: the
// policy's selection plus the attention kernel, against the read bandwidth measured by the same
// command. Bytes counted: attended K/V rows, K rows read only for scoring (exact top-k) and page
// metadata read for scoring (Quest's min/max bounds).
//
// Caches are defeated by keeping a pool of distinct structured heads (bench/synthetic_heads.h)
// far larger than the last-level cache and attending a different one on every repeat.
#include "bench/attention_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <map>
#include <numeric>
#include <optional>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "bench/attention_quality.h"
#include "bench/bench_util.h"
#include "bench/synthetic_heads.h"
#include "common/cpu_threads.h"
#include "common/flag_set.h"
#include "common/status_macros.h"
#include "decode/kv/paged_kv.h"
#include "decode/sparse/guard_flags.h"
#include "decode/sparse/policy.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/paged_attention_cpu.h"
#include "kernels/cpu/process_cpu.h"
#include "kernels/reference/compare.h"
#include "kernels/reference/reference_ops.h"
#include "model/output_projection.h"

namespace fluxion::bench {
namespace {

double RelErr(const std::vector<float>& got, const std::vector<float>& want) {
  return kernels::reference::RelativeL2Error(got, want);
}

struct AttentionBenchOptions {
  std::vector<int64_t> contexts = {4096, 16384, 65536, 131072};
  std::vector<double> budgets = {0.05, 0.02};
  std::vector<std::string> policies = {"full", "exact_topk", "quest", "fixed_32_0.05"};
  std::vector<int64_t> threads_list = {1, 0};
  int64_t head_dim = 128, group = 4, page_tokens = 16, repeats = 30, seed = 0;
  int64_t warm_steps = 3, query_steps = 1;
  double pool_gib = 1.0;
  std::string json_path, head_kind_name = "retrieval";
  // After the checks: --head-kind parsed, and every policy x budget (x guard mode) to time.
  HeadKind head_kind = HeadKind::kRetrieval;
  std::vector<decode::sparse::PolicyConfig> configs;
};

// Registers every flag but the two flag objects (--cpu-threads, the guard's), which the command
// places in the --help order.
void RegisterLeadingFlags(FlagSet& flags, AttentionBenchOptions& o) {
  flags.IntList("contexts", &o.contexts, "context lengths in tokens");
  flags.DoubleList("budget", &o.budgets, "read budgets for the sparse policies");
  flags.StringList("policy", &o.policies,
                   "policies: " + decode::sparse::PolicyNamesHelp());
}

void RegisterShapeFlags(FlagSet& flags, AttentionBenchOptions& o) {
  flags.Int("head-dim", &o.head_dim, "head dimension");
  flags.Int("group", &o.group, "query heads per KV head (GQA)");
  flags.Int("page-tokens", &o.page_tokens, "tokens per page");
  flags.Int("repeats", &o.repeats, "timed steps per point (median reported)");
  flags.Int("seed", &o.seed, "random seed for data");
  flags.Double("pool-gib", &o.pool_gib, "KV bytes the steps rotate through (defeats the caches)");
  flags.String("json", &o.json_path, "also write results to this file");
  // A history policy's cost depends on how full its tables are: one query repeated (the default)
  // keeps them as sparse as the head's attention; distinct queries over a diffuse head fill them
  // over the whole context, as random-weight models do on the device (docs/SPARSE.md).
  flags.String("head-kind", &o.head_kind_name,
               "synthetic head: retrieval, copy, streaming or diffuse (bench/synthetic_heads.h)");
  flags.Int("warm-steps", &o.warm_steps, "untimed steps per head before the timed ones");
  flags.Int("query-steps", &o.query_steps,
            "distinct decode queries per head, used in turn (1: the same query every step)");
}

// The checks of the flags (InvalidArgument: a usage error), --head-kind parsed and the policies
// expanded by budget and guard mode.
absl::Status CheckOptions(const decode::sparse::GuardFlags& guard_flags, AttentionBenchOptions& o) {
  const std::optional<HeadKind> head_kind = HeadKindFromName(o.head_kind_name);
  if (!head_kind.has_value()) {
    std::vector<std::string> names;
    for (HeadKind kind : AllHeadKinds()) names.push_back(HeadKindName(kind));
    return absl::InvalidArgumentError(absl::StrCat("--head-kind ", o.head_kind_name,
                                                   " is not one of ", absl::StrJoin(names, ", ")));
  }
  o.head_kind = *head_kind;
  if (o.warm_steps < 0 || o.query_steps < 1 || o.repeats < 1) {
    return absl::InvalidArgumentError(
        "--warm-steps must be >= 0, --query-steps and --repeats >= 1");
  }
  // A synthetic head's decode queries sit at the last query_steps positions of its context.
  if (!o.contexts.empty() &&
      o.query_steps >= *std::min_element(o.contexts.begin(), o.contexts.end())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--query-steps ", o.query_steps, " must be smaller than every context in --contexts"));
  }
  if (!kernels::cpu::PagedAttentionSupported(o.head_dim, o.group, o.page_tokens)) {
    return absl::InvalidArgumentError(absl::StrCat("head_dim ", o.head_dim, ", group ", o.group,
                                                   ", page_tokens ", o.page_tokens,
                                                   " is not supported by the CPU kernel"));
  }
  FLUXION_ASSIGN_OR_RETURN(decode::sparse::GuardFlags::Parsed guard, guard_flags.Read());
  FLUXION_ASSIGN_OR_RETURN(o.configs, decode::sparse::ExpandPolicies(o.policies, o.budgets));
  o.configs =
      decode::sparse::ExpandGuard(o.configs, guard.modes, guard.config,
                                  std::make_shared<const model::OutputProjection>(
                                      model::OutputProjection::Identity(1, o.group * o.head_dim)));
  return absl::OkStatus();
}

// The structured heads of one context (--head-kind; retrieval: sinks, needles, columns), enough
// to fill the pool, each its own contiguous run of pages; steps rotate through them.
struct Heads {
  std::vector<std::unique_ptr<decode::PagedKv>> kvs;
  std::vector<std::vector<float>> queries;  // per head: [query_steps][group][head_dim]
};

absl::StatusOr<Heads> MakeHeads(const AttentionBenchOptions& o, decode::KvArena* arena,
                                int64_t pool_pages, int64_t context) {
  const decode::KvShape shape{1, 1, o.head_dim, o.page_tokens};
  const int64_t pages_per_head = (context + o.page_tokens - 1) / o.page_tokens;
  const int64_t num_heads =
      std::max<int64_t>(1, std::min<int64_t>(64, pool_pages / pages_per_head - 1));
  Heads heads;
  for (int64_t h = 0; h < num_heads; ++h) {
    SyntheticHead sh = MakeSyntheticHead(o.head_kind, context, o.head_dim, o.group, o.query_steps,
                                         o.seed * 1000 + h);
    auto kv = *decode::PagedKv::Create(arena, shape);
    if (!kv->Append(0, context, sh.keys.data(), sh.values.data(), o.head_dim).ok()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("page pool too small for ", num_heads, " heads"));
    }
    heads.kvs.push_back(std::move(kv));
    heads.queries.push_back(sh.queries);
  }
  return heads;
}

// What the timed steps of one (context, policy, threads) point add up to.
struct PointTotals {
  std::vector<double> ms, attend_ms;  // whole step; its attention alone
  double err = 0;                     // the first step's output against the reference
  // Means over the timed steps: bytes read (attended K/V rows, K rows scored, metadata), attended
  // bytes, the share of the context attended, the candidate share, and the guard's checks.
  double bytes = 0, attend_bytes = 0, read = 0, candidates = 0, guard_bytes = 0;
  double guard_ms = 0;  // the guard's time summed over the timed steps
  double recall = 0;    // mean over the first timed step of each head
  int64_t recall_steps = 0;
};

// Correctness in the same run, before any timing counts: the kernel's output for `spans` against
// the reference's. Internal if it differs beyond the ISA's tolerance.
absl::StatusOr<double> CheckKernel(const decode::PagedKv& kv,
                                   const std::vector<kernels::PageSpan>& spans, const float* q,
                                   const AttentionBenchOptions& o, float scale,
                                   const std::vector<float>& out) {
  std::vector<float> ref(out.size()), ref_lse(o.group);
  kernels::reference::PagedAttention(kv.view(), spans.data(), spans.size(), {q, o.group, scale},
                                     {ref.data(), ref_lse.data()});
  const double err = RelErr(out, ref);
  // The bf16 kernels round the query to bf16 (docs/KV_LAYOUT.md: 2-3e-3 on the conformance
  // grid); the fp32 ones agree with the reference to ~1e-6.
  const double tolerance =
      kernels::cpu::ActiveCpuIsa() == kernels::cpu::CpuIsa::kAvx512Bf16 ? 1e-2 : 1e-4;
  if (err > tolerance) {
    return absl::InternalError(
        absl::StrCat("kernel output differs from the reference (rel err ", err, ")"));
  }
  return err;
}

// The error guard's exact check of one head as SparseAttention::CheckLayer makes it (one head:
// the layer's output is this head's), reported to `guard`.
void GuardCheck(const decode::PagedKv& kv, const float* q, const AttentionBenchOptions& o,
                float scale, int64_t context, int nthreads,
                const decode::sparse::PolicyConfig& config, int head, const std::vector<float>& out,
                decode::sparse::ErrorGuard* guard) {
  std::vector<kernels::PageSpan> check_spans;
  std::vector<float> exact(o.group * o.head_dim), exact_lse(o.group);
  decode::sparse::AppendTokenRange(kv, 0, 0, 0, context, &check_spans);
  kernels::cpu::PagedAttentionSplit(kv.view(), check_spans.data(), check_spans.size(),
                                    {q, o.group, scale}, {exact.data(), exact_lse.data()},
                                    nthreads);
  const model::OutputProjection& proj = *config.output_projection;
  const double total = proj.Norm(0, exact.data());
  guard->Report(
      0, head,
      model::HeadOutputError(proj, 0, 0, exact.data(), out.data(), o.group * o.head_dim, total),
      context);
}

// Attention-mass recall of `spans` against full attention, untimed (a speedup counts only at
// >= 0.95 recall).
double SelectionRecall(const decode::PagedKv& kv, const float* q, const AttentionBenchOptions& o,
                       float scale, int64_t context, const std::vector<kernels::PageSpan>& spans,
                       const decode::sparse::PolicyConfig& config, int64_t rows_attended) {
  std::vector<kernels::PageSpan> all;
  std::vector<float> ref(o.group * o.head_dim), ref_lse(o.group);
  decode::sparse::AppendTokenRange(kv, 0, 0, 0, context, &all);
  kernels::cpu::PagedAttention(kv.view(), all.data(), all.size(), {q, o.group, scale},
                               {ref.data(), ref_lse.data()});
  Metrics m;
  AddSelectionQuality(kv, 0, 0, q, o.group, scale, context, spans, config, ref_lse.data(),
                      rows_attended, &m);
  return m.recall;
}

// --warm-steps untimed and --repeats timed steps of `config` rotating over `heads`, each step the
// policy's selection, the attention and what a history policy does after the step (Observe), plus
// the guard's checks when due.
absl::StatusOr<PointTotals> TimePoint(const AttentionBenchOptions& o, const Heads& heads,
                                      const decode::sparse::PolicyConfig& config, int64_t context,
                                      int nthreads) {
  const int64_t num_heads = static_cast<int64_t>(heads.kvs.size());
  const float scale = 1.0f / std::sqrt(static_cast<float>(o.head_dim));
  const double row_bytes = o.head_dim * sizeof(bf16);
  // One policy per head: history policies (LFPS, Fluxion) keep per-head state. Each is warmed
  // with --warm-steps untimed steps so the timed ones show the steady state, its periodic exact
  // refresh included.
  std::vector<std::unique_ptr<decode::sparse::SparsePolicy>> policies;
  for (int64_t h = 0; h < num_heads; ++h) policies.push_back(decode::sparse::MakePolicy(config));
  // The guard sees the bench's heads as one request of num_heads KV heads; a "step" is one round
  // over them.
  std::unique_ptr<decode::sparse::ErrorGuard> guard;
  if (decode::sparse::GuardActive(config)) {
    guard = std::make_unique<decode::sparse::ErrorGuard>(decode::sparse::GuardFor(config), 1,
                                                         static_cast<int>(num_heads),
                                                         [](int, int) { return 1.0; });
  }
  PointTotals t;
  std::vector<kernels::PageSpan> spans;
  std::vector<float> out(o.group * o.head_dim), lse(o.group);
  const int64_t warm = o.warm_steps * num_heads;
  const double n = static_cast<double>(o.repeats);
  for (int64_t r = 0; r < warm + o.repeats; ++r) {
    const int head = static_cast<int>(r % num_heads);
    const decode::PagedKv& kv = *heads.kvs[head];
    // Round r / num_heads of this head: its query of that step, in turn.
    const float* q =
        heads.queries[head].data() + (r / num_heads) % o.query_steps * o.group * o.head_dim;
    decode::sparse::SelectionStats stats;
    spans.clear();
    if (guard != nullptr && head == 0) guard->BeginStep();
    decode::sparse::SelectionInput in{&kv, 0, 0, q, o.group, scale, context};
    if (guard != nullptr) in.budget_shift = guard->Shift(0, head);
    const auto t0 = std::chrono::steady_clock::now();
    policies[head]->Select(in, &spans, &stats);
    const auto t_attend = std::chrono::steady_clock::now();
    kernels::cpu::PagedAttentionSplit(kv.view(), spans.data(), spans.size(), {q, o.group, scale},
                                      {out.data(), lse.data()}, nthreads);
    const auto t_attended = std::chrono::steady_clock::now();
    policies[head]->Observe(in, spans);
    const auto t_check = std::chrono::steady_clock::now();
    if (guard != nullptr && guard->Due(0, head)) {
      GuardCheck(kv, q, o, scale, context, nthreads, config, head, out, guard.get());
      if (r >= warm) t.guard_bytes += context * 2.0 * row_bytes / n;
    }
    const auto t_end = std::chrono::steady_clock::now();
    if (r >= warm) t.guard_ms += std::chrono::duration<double>(t_end - t_check).count() * 1e3;
    if (r == 0) {
      FLUXION_ASSIGN_OR_RETURN(t.err, CheckKernel(kv, spans, q, o, scale, out));
    }
    if (r < warm) continue;
    t.ms.push_back(std::chrono::duration<double>(t_end - t0).count() * 1e3);
    t.attend_ms.push_back(std::chrono::duration<double>(t_attended - t_attend).count() * 1e3);
    t.bytes += (stats.rows_attended * 2.0 * row_bytes + stats.k_rows_scored * row_bytes +
                stats.metadata_bytes) /
               n;
    t.attend_bytes += stats.rows_attended * 2.0 * row_bytes / n;
    t.read += static_cast<double>(stats.rows_attended) / context / n;
    // Candidate fraction: K rows scored exactly (all of the middle for exact top-k, the table
    // candidates for LFPS, none for Quest, which scores page metadata).
    t.candidates += static_cast<double>(stats.k_rows_scored) / context / n;
    if (r < warm + num_heads) {  // the first timed step of each head
      t.recall += SelectionRecall(kv, q, o, scale, context, spans, config, stats.rows_attended);
      ++t.recall_steps;
    }
  }
  t.recall /= std::max<int64_t>(1, t.recall_steps);
  return t;
}

// Prints one point's row and appends its JSON record.
void ReportPoint(const decode::sparse::PolicyConfig& config, int64_t context, int nthreads,
                 double probe_gbps, const AttentionBenchOptions& o, PointTotals t,
                 nlohmann::json* results) {
  const std::string label = decode::sparse::PolicyLabel(config);
  const Stats st = Summarize(t.ms);
  // Against the mean time: history policies alternate cheap steps with exact refreshes.
  const double mean_ms = std::accumulate(t.ms.begin(), t.ms.end(), 0.0) / t.ms.size();
  // The guard's share of the step time and of the bytes read (its checks included).
  const double guard_time_share = t.guard_ms / std::max(1e-12, mean_ms * o.repeats);
  const double guard_byte_share = t.guard_bytes / std::max(1.0, t.bytes + t.guard_bytes);
  const double bytes = t.bytes + t.guard_bytes;
  const double gbps = bytes / 1e9 / (mean_ms / 1e3);
  // The attention kernel's own rate over the rows it attended: token-level spans (one-row picks)
  // against page spans shows what scattered rows cost the CPU's reads.
  const double attend_mean_ms =
      std::accumulate(t.attend_ms.begin(), t.attend_ms.end(), 0.0) / t.attend_ms.size();
  const double attend_gbps = t.attend_bytes / 1e9 / (attend_mean_ms / 1e3);
  std::printf(
      "%7d %8lld %-22s | %9.4f %9.4f %9.4f | %8.2f %7.4f %7.2f %6.0f%% | %8.4f %7.2f | "
      "%6.4f %6.4f | %8.1e | %5.3f %5.3f\n",
      nthreads, static_cast<long long>(context), label.c_str(), st.median, st.p10, st.p90,
      bytes / 1e6, t.read, gbps, 100 * gbps / probe_gbps, attend_mean_ms, attend_gbps, t.candidates,
      t.recall, t.err, guard_time_share, guard_byte_share);
  results->push_back({{"policy", config.name},
                      {"context", context},
                      {"budget", config.budget},
                      {"budget_spent", t.read},
                      {"threads", nthreads},
                      {"ms", st.median},
                      {"ms_mean", mean_ms},
                      {"ms_p10", st.p10},
                      {"ms_p90", st.p90},
                      {"bytes_read", bytes},
                      {"gbps", gbps},
                      {"attention_ms_mean", attend_mean_ms},
                      {"attention_gbps", attend_gbps},
                      {"pct_of_read_probe", 100 * gbps / probe_gbps},
                      {"candidate_fraction", t.candidates},
                      {"recall", t.recall},
                      {"rel_err", t.err},
                      {"guard", decode::sparse::GuardActive(config)},
                      {"guard_rate", config.guard.sample_rate},
                      {"guard_time_share", guard_time_share},
                      {"guard_byte_share", guard_byte_share}});
}

// The read probe per thread count (what each row's GB/s is compared with), into `limits` too.
std::map<int, double> MeasureProbes(const std::vector<int64_t>& threads_list,
                                    nlohmann::json* limits) {
  std::map<int, double> probes;
  for (int64_t t : threads_list) {
    kernels::cpu::SetNumThreads(static_cast<int>(t));
    const int nthreads = kernels::cpu::NumThreads();
    probes[nthreads] = MeasureReadBandwidthGbps(size_t{1} << 30, nthreads);
    (*limits)[std::to_string(nthreads) + "_threads"] = {{"host_read_gbps", probes[nthreads]}};
  }
  return probes;
}

void PrintHeader(const AttentionBenchOptions& o, int64_t pool_pages, size_t page_bytes) {
  std::printf(
      "kernels: %s | head_dim %lld, group %lld, %lld-token pages (%zu bytes), "
      "pool %.2f GiB\n",
      kernels::cpu::CpuIsaName(kernels::cpu::ActiveCpuIsa()), static_cast<long long>(o.head_dim),
      static_cast<long long>(o.group), static_cast<long long>(o.page_tokens), page_bytes,
      pool_pages * page_bytes / double(1 << 30));
}

void PrintColumns() {
  std::printf(
      "%7s %8s %-22s | %9s %9s %9s | %8s %7s %7s %7s | %8s %7s | %6s %6s | %8s | %5s "
      "%5s\n",
      "threads", "context", "policy", "ms", "ms p10", "ms p90", "MB read", "read", "GB/s",
      "% probe", "att ms", "att GB/s", "cand", "recall", "rel err", "guard", "g.MB");
  std::printf(
      "(guard: the error guard's share of step time and of bytes read, MB read "
      "including its exact checks)\n");
}

// Every (context, policy, threads) point, then --json. Returns the exit code.
int RunPoints(const AttentionBenchOptions& o, const std::vector<std::string>& args) {
  const size_t page_bytes = decode::KvShape{1, 1, o.head_dim, o.page_tokens}.page_bytes();
  const int64_t max_context = *std::max_element(o.contexts.begin(), o.contexts.end());
  const int64_t pool_pages =
      std::max<int64_t>(2 * (max_context / o.page_tokens + 2),
                        static_cast<int64_t>(o.pool_gib * (1 << 30)) / page_bytes);
  auto arena = decode::KvArena::Create(page_bytes, pool_pages);
  if (!arena.ok()) {
    std::cerr << "error: " << arena.status() << "\n";
    return 1;
  }
  nlohmann::json results = nlohmann::json::array(), limits = nlohmann::json::object();
  PrintHeader(o, pool_pages, page_bytes);
  const std::map<int, double> probes = MeasureProbes(o.threads_list, &limits);
  PrintColumns();
  for (int64_t context : o.contexts) {
    absl::StatusOr<Heads> heads = MakeHeads(o, arena->get(), pool_pages, context);
    if (!heads.ok()) {
      std::cerr << "error: " << heads.status().message() << "\n";
      return 1;
    }
    for (const decode::sparse::PolicyConfig& config : o.configs) {
      for (int64_t t : o.threads_list) {
        kernels::cpu::SetNumThreads(static_cast<int>(t));
        const int nthreads = kernels::cpu::NumThreads();
        absl::StatusOr<PointTotals> point = TimePoint(o, *heads, config, context, nthreads);
        if (!point.ok()) {
          std::cerr << "error: " << point.status().message() << "\n";
          return 1;
        }
        ReportPoint(config, context, nthreads, probes.at(nthreads), o, *std::move(point), &results);
      }
    }
  }
  if (!o.json_path.empty()) {
    nlohmann::json doc =
        ResultEnvelope(JoinCommand("fluxion bench attention", args), limits, results);
    doc["shape"] = {{"head_dim", o.head_dim}, {"group", o.group}, {"page_tokens", o.page_tokens}};
    if (absl::Status s = WriteJson(o.json_path, doc); !s.ok()) {
      std::cerr << "error: " << s << "\n";
      return 1;
    }
    std::cout << "wrote " << o.json_path << "\n";
  }
  return 0;
}

}  // namespace

int RunAttentionBench(const std::vector<std::string>& args) {
  AttentionBenchOptions o;
  FlagSet flags("fluxion bench attention",
                "Times one decode step of one KV head (with its GQA group) over host KV pages for "
                "each policy and budget: selection plus attention, against the measured read "
                "bandwidth.");
  RegisterLeadingFlags(flags, o);
  CpuThreadsListFlag cpu_threads(flags, o.threads_list);
  RegisterShapeFlags(flags, o);
  // The error guard's cost: its exact checks at --guard-rate of the heads per step, e_h through
  // the identity (synthetic heads have no W_O), feeding the guard's budget shifts.
  decode::sparse::GuardFlags guard_flags(flags, /*allow_both=*/true);
  if (int rc = ParseFlagsOrExit(flags, args); rc >= 0) return rc;
  absl::StatusOr<std::vector<int64_t>> sweep = kernels::cpu::SetUpProcessCpuSweep(cpu_threads);
  if (!sweep.ok()) {
    std::cerr << "error: " << sweep.status().message() << "\n";
    return 2;
  }
  o.threads_list = *std::move(sweep);
  if (absl::Status s = CheckOptions(guard_flags, o); !s.ok()) {
    std::cerr << "error: " << s.message() << "\n";
    return 2;
  }
  return RunPoints(o, args);
}

}  // namespace fluxion::bench

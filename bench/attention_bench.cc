// `fluxion bench attention`: one decode step of one (layer, KV head) with its GQA group over host
// KV pages, per policy and read budget, at several contexts, single- and multi-threaded: the
// policy's selection plus the attention kernel, against the read bandwidth measured by the same
// command. Bytes counted: attended K/V rows, K rows read only for scoring (exact top-k) and page
// metadata read for scoring (Quest's min/max bounds).
//
// Caches are defeated by keeping a pool of distinct structured heads (bench/synthetic_heads.h)
// far larger than the last-level cache and attending a different one on every repeat.
#include "absl/strings/str_join.h"
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

#include "bench/attention_quality.h"
#include "bench/bench_util.h"
#include "bench/synthetic_heads.h"
#include "common/cpu_threads.h"
#include "common/flag_set.h"
#include "decode/paged_kv.h"
#include "decode/sparse/guard_flags.h"
#include "decode/sparse/policy.h"
#include "model/output_projection.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/paged_attention_cpu.h"
#include "kernels/cpu/process_cpu.h"
#include "kernels/reference/reference_ops.h"
#include "kernels/reference/compare.h"

namespace fluxion::bench {
namespace {

double RelErr(const std::vector<float>& got, const std::vector<float>& want) {
  return kernels::reference::RelativeL2Error(got, want);
}

}  // namespace

int RunAttentionBench(const std::vector<std::string>& args) {
  std::vector<int64_t> contexts = {4096, 16384, 65536, 131072};
  std::vector<double> budgets = {0.05, 0.02};
  std::vector<std::string> policies = {"full", "exact_topk", "quest", "fixed_32_0.05"};
  std::vector<int64_t> threads_list = {1, 0};
  int64_t head_dim = 128, group = 4, page_tokens = 16, repeats = 30, seed = 0;
  int64_t warm_steps = 3, query_steps = 1;
  double pool_gib = 1.0;
  std::string json_path, head_kind_name = "retrieval";
  FlagSet flags("fluxion bench attention",
                "Times one decode step of one KV head (with its GQA group) over host KV pages for "
                "each policy and budget: selection plus attention, against the measured read "
                "bandwidth.");
  flags.IntList("contexts", &contexts, "context lengths in tokens");
  flags.DoubleList("budget", &budgets, "read budgets for the sparse policies");
  flags.StringList("policy", &policies,
                   "policies: " + decode::sparse::PolicyNamesHelp());
  CpuThreadsListFlag cpu_threads(flags, threads_list);
  flags.Int("head-dim", &head_dim, "head dimension");
  flags.Int("group", &group, "query heads per KV head (GQA)");
  flags.Int("page-tokens", &page_tokens, "tokens per page");
  flags.Int("repeats", &repeats, "timed steps per point (median reported)");
  flags.Int("seed", &seed, "random seed for data");
  flags.Double("pool-gib", &pool_gib, "KV bytes the steps rotate through (defeats the caches)");
  flags.String("json", &json_path, "also write results to this file");
  // A history policy's cost depends on how full its tables are: one query repeated (the default)
  // keeps them as sparse as the head's attention; distinct queries over a diffuse head fill them
  // over the whole context, as random-weight models do on the device (docs/SPARSE.md).
  flags.String("head-kind", &head_kind_name,
               "synthetic head: retrieval, copy, streaming or diffuse (bench/synthetic_heads.h)");
  flags.Int("warm-steps", &warm_steps, "untimed steps per head before the timed ones");
  flags.Int("query-steps", &query_steps,
            "distinct decode queries per head, used in turn (1: the same query every step)");
  // The error guard's cost: its exact checks at --guard-rate of the heads per step, e_h through
  // the identity (synthetic heads have no W_O), feeding the guard's budget shifts.
  decode::sparse::GuardFlags guard_flags(flags, /*allow_both=*/true);
  if (int rc = ParseFlagsOrExit(flags, args); rc >= 0) return rc;
  {
    absl::StatusOr<std::vector<int64_t>> sweep = kernels::cpu::SetUpProcessCpuSweep(cpu_threads);
    if (!sweep.ok()) {
      std::cerr << "error: " << sweep.status().message() << "\n";
      return 2;
    }
    threads_list = *std::move(sweep);
  }
  const std::optional<HeadKind> head_kind = HeadKindFromName(head_kind_name);
  if (!head_kind.has_value()) {
    std::vector<std::string> names;
    for (HeadKind kind : AllHeadKinds()) names.push_back(HeadKindName(kind));
    std::cerr << "error: --head-kind " << head_kind_name << " is not one of "
              << absl::StrJoin(names, ", ") << "\n";
    return 2;
  }
  if (warm_steps < 0 || query_steps < 1 || repeats < 1) {
    std::cerr << "error: --warm-steps must be >= 0, --query-steps and --repeats >= 1\n";
    return 2;
  }
  // A synthetic head's decode queries sit at the last query_steps positions of its context.
  if (!contexts.empty() && query_steps >= *std::min_element(contexts.begin(), contexts.end())) {
    std::cerr << "error: --query-steps " << query_steps
              << " must be smaller than every context in --contexts\n";
    return 2;
  }
  if (!kernels::cpu::PagedAttentionSupported(head_dim, group, page_tokens)) {
    std::cerr << "error: head_dim " << head_dim << ", group " << group << ", page_tokens "
              << page_tokens << " is not supported by the CPU kernel\n";
    return 2;
  }
  const absl::StatusOr<decode::sparse::GuardFlags::Parsed> guard_read = guard_flags.Read();
  if (!guard_read.ok()) {
    std::cerr << "error: " << guard_read.status().message() << "\n";
    return 2;
  }
  const std::vector<bool>* guard_modes = &guard_read->modes;
  const decode::sparse::GuardConfig* guard = &guard_read->config;
  auto configs = decode::sparse::ExpandPolicies(policies, budgets);
  if (configs.ok()) {
    *configs = decode::sparse::ExpandGuard(
        *configs, *guard_modes, *guard,
        std::make_shared<const model::OutputProjection>(
            model::OutputProjection::Identity(1, group * head_dim)));
  }
  if (!configs.ok()) {
    std::cerr << "error: " << configs.status().message() << "\n";
    return 2;
  }
  const decode::KvShape shape{1, 1, head_dim, page_tokens};
  const size_t page_bytes = shape.page_bytes();
  const int64_t max_context = *std::max_element(contexts.begin(), contexts.end());
  const int64_t pool_pages = std::max<int64_t>(
      2 * (max_context / page_tokens + 2), static_cast<int64_t>(pool_gib * (1 << 30)) / page_bytes);
  auto arena = decode::KvArena::Create(page_bytes, pool_pages);
  if (!arena.ok()) {
    std::cerr << "error: " << arena.status() << "\n";
    return 1;
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  nlohmann::json results = nlohmann::json::array(), limits = nlohmann::json::object();
  std::printf(
      "kernels: %s | head_dim %lld, group %lld, %lld-token pages (%zu bytes), "
      "pool %.2f GiB\n",
      kernels::cpu::CpuIsaName(kernels::cpu::ActiveCpuIsa()), static_cast<long long>(head_dim),
      static_cast<long long>(group), static_cast<long long>(page_tokens), page_bytes,
      pool_pages * page_bytes / double(1 << 30));
  std::map<int, double> probes;
  for (int64_t t : threads_list) {
    kernels::cpu::SetNumThreads(static_cast<int>(t));
    const int nthreads = kernels::cpu::NumThreads();
    probes[nthreads] = MeasureReadBandwidthGbps(size_t{1} << 30, nthreads);
    limits[std::to_string(nthreads) + "_threads"] = {{"host_read_gbps", probes[nthreads]}};
  }
  std::printf("%7s %8s %-22s | %9s %9s %9s | %8s %7s %7s %7s | %8s %7s | %6s %6s | %8s | %5s "
              "%5s\n",
              "threads", "context", "policy", "ms", "ms p10", "ms p90", "MB read", "read", "GB/s",
              "% probe", "att ms", "att GB/s", "cand", "recall", "rel err", "guard", "g.MB");
  std::printf("(guard: the error guard's share of step time and of bytes read, MB read "
              "including its exact checks)\n");
  for (int64_t context : contexts) {
    // Enough structured heads (--head-kind; retrieval: sinks, needles, columns) to fill the
    // pool, each its own contiguous run of pages; steps rotate through them.
    const int64_t pages_per_head = (context + page_tokens - 1) / page_tokens;
    const int64_t num_heads =
        std::max<int64_t>(1, std::min<int64_t>(64, pool_pages / pages_per_head - 1));
    std::vector<std::unique_ptr<decode::PagedKv>> heads;
    std::vector<std::vector<float>> queries;
    for (int64_t h = 0; h < num_heads; ++h) {
      SyntheticHead sh =
          MakeSyntheticHead(*head_kind, context, head_dim, group, query_steps, seed * 1000 + h);
      auto kv = *decode::PagedKv::Create(arena->get(), shape);
      if (!kv->Append(0, context, sh.keys.data(), sh.values.data(), head_dim).ok()) {
        std::cerr << "error: page pool too small for " << num_heads << " heads\n";
        return 1;
      }
      heads.push_back(std::move(kv));
      queries.push_back(sh.queries);
    }
    for (const decode::sparse::PolicyConfig& config : *configs) {
      const std::string label = decode::sparse::PolicyLabel(config);
      for (int64_t t : threads_list) {
        kernels::cpu::SetNumThreads(static_cast<int>(t));
        const int nthreads = kernels::cpu::NumThreads();
        // One policy per head: history policies (LFPS, Fluxion) keep per-head state. Each is
        // warmed with --warm-steps untimed steps so the timed ones show the steady state, its
        // periodic exact refresh included.
        std::vector<std::unique_ptr<decode::sparse::SparsePolicy>> policies;
        for (int64_t h = 0; h < num_heads; ++h)
          policies.push_back(decode::sparse::MakePolicy(config));
        // The guard sees the bench's heads as one request of num_heads KV heads; a "step" is one
        // round over them.
        std::unique_ptr<decode::sparse::ErrorGuard> guard_state;
        if (decode::sparse::GuardActive(config)) {
          guard_state = std::make_unique<decode::sparse::ErrorGuard>(
              decode::sparse::GuardFor(config), 1, static_cast<int>(num_heads),
              [](int, int) { return 1.0; });
        }
        double guard_ms = 0, guard_bytes = 0;
        std::vector<kernels::PageSpan> check_spans;
        std::vector<float> exact(group * head_dim), exact_lse(group);
        std::vector<double> ms, attend_ms;  // whole step; its attention alone
        std::vector<kernels::PageSpan> spans;
        std::vector<float> out(group * head_dim), lse(group), ref(out.size()), ref_lse(group);
        double err = 0, bytes = 0, attend_bytes = 0, read = 0, candidates = 0, recall = 0;
        int64_t recall_steps = 0;
        const int64_t warm = warm_steps * num_heads;
        for (int64_t r = 0; r < warm + repeats; ++r) {
          const decode::PagedKv& kv = *heads[r % num_heads];
          decode::sparse::SparsePolicy& policy = *policies[r % num_heads];
          // Round r / num_heads of this head: its query of that step, in turn.
          const float* q = queries[r % num_heads].data() +
                           (r / num_heads) % query_steps * group * head_dim;
          decode::sparse::SelectionStats stats;
          spans.clear();
          const int head = static_cast<int>(r % num_heads);
          if (guard_state != nullptr && head == 0) guard_state->BeginStep();
          decode::sparse::SelectionInput in{&kv, 0, 0, q, group, scale, context};
          if (guard_state != nullptr) in.budget_shift = guard_state->Shift(0, head);
          auto t0 = std::chrono::steady_clock::now();
          // Selection, attention and what a history policy does after the step (Observe).
          policy.Select(in, &spans, &stats);
          const auto t_attend = std::chrono::steady_clock::now();
          kernels::cpu::PagedAttentionSplit(kv.view(), spans.data(), spans.size(),
                                            {q, group, scale}, {out.data(), lse.data()}, nthreads);
          const auto t_attended = std::chrono::steady_clock::now();
          policy.Observe(in, spans);
          const auto t_check = std::chrono::steady_clock::now();
          if (guard_state != nullptr && guard_state->Due(0, head)) {
            // The exact check as SparseAttention::CheckLayer makes it (one head: the layer's
            // output is this head's).
            check_spans.clear();
            decode::sparse::AppendTokenRange(kv, 0, 0, 0, context, &check_spans);
            kernels::cpu::PagedAttentionSplit(kv.view(), check_spans.data(), check_spans.size(),
                                              {q, group, scale}, {exact.data(), exact_lse.data()},
                                              nthreads);
            const model::OutputProjection& proj = *config.output_projection;
            const double total = proj.Norm(0, exact.data());
            guard_state->Report(0, head,
                                model::HeadOutputError(proj, 0, 0, exact.data(), out.data(),
                                                       group * head_dim, total),
                                context);
            if (r >= warm) guard_bytes += context * 2.0 * head_dim * sizeof(bf16) / repeats;
          }
          const auto t_end = std::chrono::steady_clock::now();
          const double elapsed = std::chrono::duration<double>(t_end - t0).count();
          if (r >= warm) guard_ms += std::chrono::duration<double>(t_end - t_check).count() * 1e3;
          if (r == 0) {
            // Correctness in the same run, before any timing counts.
            kernels::reference::PagedAttention(kv.view(), spans.data(), spans.size(),
                                               {q, group, scale}, {ref.data(), ref_lse.data()});
            err = RelErr(out, ref);
            // The bf16 kernels round the query to bf16 (docs/KV_LAYOUT.md: 2-3e-3 on the
            // conformance grid); the fp32 ones agree with the reference to ~1e-6.
            const double tolerance =
                kernels::cpu::ActiveCpuIsa() == kernels::cpu::CpuIsa::kAvx512Bf16 ? 1e-2 : 1e-4;
            if (err > tolerance) {
              std::cerr << "error: kernel output differs from the reference (rel err " << err
                        << ")\n";
              return 1;
            }
          }
          if (r < warm) continue;
          ms.push_back(elapsed * 1e3);
          attend_ms.push_back(std::chrono::duration<double>(t_attended - t_attend).count() * 1e3);
          // Mean bytes of the timed steps: attended K/V rows, K rows scored, metadata.
          bytes += (stats.rows_attended * 2.0 * head_dim * sizeof(bf16) +
                    stats.k_rows_scored * 1.0 * head_dim * sizeof(bf16) + stats.metadata_bytes) /
                   repeats;
          attend_bytes += stats.rows_attended * 2.0 * head_dim * sizeof(bf16) / repeats;
          read += static_cast<double>(stats.rows_attended) / context / repeats;
          // Candidate fraction: K rows scored exactly (all of the middle for exact top-k, the
          // table candidates for LFPS, none for Quest, which scores page metadata).
          candidates += static_cast<double>(stats.k_rows_scored) / context / repeats;
          // Recall on the timed inputs, untimed: the first timed step of each head (a speedup
          // counts only at >= 0.95 attention-mass recall).
          if (r < warm + num_heads) {
            std::vector<kernels::PageSpan> all;
            decode::sparse::AppendTokenRange(kv, 0, 0, 0, context, &all);
            kernels::cpu::PagedAttention(kv.view(), all.data(), all.size(), {q, group, scale},
                                         {ref.data(), ref_lse.data()});
            Metrics m;
            AddSelectionQuality(kv, 0, 0, q, group, scale, context, spans, config, ref_lse.data(),
                                stats.rows_attended, &m);
            recall += m.recall;
            ++recall_steps;
          }
        }
        recall /= std::max<int64_t>(1, recall_steps);
        const Stats st = Summarize(ms);
        // Against the mean time: history policies alternate cheap steps with exact refreshes.
        const double mean_ms = std::accumulate(ms.begin(), ms.end(), 0.0) / ms.size();
        // The guard's share of the step time and of the bytes read (its checks included).
        const double guard_time_share = guard_ms / std::max(1e-12, mean_ms * repeats);
        const double guard_byte_share = guard_bytes / std::max(1.0, bytes + guard_bytes);
        bytes += guard_bytes;
        const double gbps = bytes / 1e9 / (mean_ms / 1e3);
        // The attention kernel's own rate over the rows it attended: token-level spans (one-row
        // picks) against page spans shows what scattered rows cost the CPU's reads.
        const double attend_mean_ms =
            std::accumulate(attend_ms.begin(), attend_ms.end(), 0.0) / attend_ms.size();
        const double attend_gbps = attend_bytes / 1e9 / (attend_mean_ms / 1e3);
        std::printf(
            "%7d %8lld %-22s | %9.4f %9.4f %9.4f | %8.2f %7.4f %7.2f %6.0f%% | %8.4f %7.2f | "
            "%6.4f %6.4f | %8.1e | %5.3f %5.3f\n",
            nthreads, static_cast<long long>(context), label.c_str(), st.median, st.p10, st.p90,
            bytes / 1e6, read, gbps, 100 * gbps / probes[nthreads], attend_mean_ms, attend_gbps,
            candidates, recall, err, guard_time_share, guard_byte_share);
        results.push_back({{"policy", config.name},
                           {"context", context},
                           {"budget", config.budget},
                           {"budget_spent", read},
                           {"threads", nthreads},
                           {"ms", st.median},
                           {"ms_mean", mean_ms},
                           {"ms_p10", st.p10},
                           {"ms_p90", st.p90},
                           {"bytes_read", bytes},
                           {"gbps", gbps},
                           {"attention_ms_mean", attend_mean_ms},
                           {"attention_gbps", attend_gbps},
                           {"pct_of_read_probe", 100 * gbps / probes[nthreads]},
                           {"candidate_fraction", candidates},
                           {"recall", recall},
                           {"rel_err", err},
                           {"guard", decode::sparse::GuardActive(config)},
                           {"guard_rate", config.guard.sample_rate},
                           {"guard_time_share", guard_time_share},
                           {"guard_byte_share", guard_byte_share}});
      }
    }
  }
  if (!json_path.empty()) {
    nlohmann::json doc =
        ResultEnvelope(JoinCommand("fluxion bench attention", args), limits, results);
    doc["shape"] = {{"head_dim", head_dim}, {"group", group}, {"page_tokens", page_tokens}};
    if (absl::Status s = WriteJson(json_path, doc); !s.ok()) {
      std::cerr << "error: " << s << "\n";
      return 1;
    }
    std::cout << "wrote " << json_path << "\n";
  }
  return 0;
}

}  // namespace fluxion::bench

// `fluxion bench attention`: one decode step of one (layer, KV head) with its GQA group over host
// KV pages, at several contexts and read budgets, single- and multi-threaded, against the read
// bandwidth measured by the same command. Today it measures the paged kernel under dense reads
// (budget 1) and random page subsets (the page selection a block-sparse policy makes); the
// policies themselves (full, exact_topk, quest, lfps, fluxion) join as they land (issues 4-5).
//
// Caches are defeated by keeping a pool of distinct "heads" (page ranges) far larger than the
// last-level cache and attending a different one on every repeat.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <numeric>
#include <random>

#include "bench/attention_bench.h"
#include "bench/bench_util.h"
#include "common/flag_set.h"
#include "decode/kv_arena.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/paged_attention_cpu.h"
#include "kernels/reference/reference_ops.h"

namespace fluxion::bench {
namespace {

using kernels::DecodeQuery;
using kernels::PageSpan;
using kernels::PagedKvView;

double RelErr(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    den += double(want[i]) * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

}  // namespace

int RunAttentionBench(const std::vector<std::string>& args) {
  std::vector<int64_t> contexts = {4096, 16384, 65536, 131072};
  std::vector<double> budgets = {1.0, 0.05, 0.02};
  std::vector<int64_t> threads_list = {1, 0};
  int64_t head_dim = 128, group = 4, page_tokens = 16, repeats = 30, seed = 0;
  double pool_gib = 2.0;
  std::string json_path;
  FlagSet flags("fluxion bench attention",
                "Times one decode step of one KV head (with its GQA group) over host KV pages, "
                "dense and at read budgets, against the measured read bandwidth.");
  flags.IntList("contexts", &contexts, "context lengths in tokens");
  flags.DoubleList("budget", &budgets, "fractions of context rows read (1 = dense)");
  flags.IntList("threads", &threads_list, "thread counts; 0 = all cores");
  flags.Int("head-dim", &head_dim, "head dimension");
  flags.Int("group", &group, "query heads per KV head (GQA)");
  flags.Int("page-tokens", &page_tokens, "tokens per page");
  flags.Int("repeats", &repeats, "timed steps per point (median reported)");
  flags.Int("seed", &seed, "random seed for data and selections");
  flags.Double("pool-gib", &pool_gib, "size of the page pool the steps rotate through");
  flags.String("json", &json_path, "also write results to this file");
  if (absl::Status s = flags.Parse(args); !s.ok()) {
    std::cerr << "error: " << s.message() << "\n";
    return 2;
  }
  if (flags.help_requested()) {
    std::cout << flags.Usage();
    return 0;
  }
  if (!kernels::cpu::PagedAttentionSupported(head_dim, group, page_tokens)) {
    std::cerr << "error: head_dim " << head_dim << ", group " << group << ", page_tokens "
              << page_tokens << " is not supported by the CPU kernel\n";
    return 2;
  }
  const size_t page_bytes = 2 * page_tokens * head_dim * sizeof(bf16);
  const int64_t max_context = *std::max_element(contexts.begin(), contexts.end());
  const int64_t pages_per_head = (max_context + page_tokens - 1) / page_tokens;
  const int64_t pool_pages =
      std::max<int64_t>(pages_per_head * 2, static_cast<int64_t>(pool_gib * (1 << 30)) / page_bytes);
  auto arena = decode::KvArena::Create(page_bytes, pool_pages);
  if (!arena.ok()) {
    std::cerr << "error: " << arena.status() << "\n";
    return 1;
  }
  std::mt19937_64 rng(seed);
  {
    // Random bf16 K/V (never zeros), written once; every thread fills its share.
    auto* base = reinterpret_cast<bf16*>((*arena)->base());
    const int64_t n = pool_pages * page_bytes / sizeof(bf16);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int64_t i = 0; i < n; ++i) base[i] = FloatToBf16(normal(rng));
  }
  PagedKvView kv{(*arena)->base(), page_bytes, page_tokens, head_dim};
  std::vector<float> q(group * head_dim);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& x : q) x = normal(rng);
  DecodeQuery query{q.data(), group, 1.0f / std::sqrt(static_cast<float>(head_dim))};
  std::vector<float> out(group * head_dim), lse(group), ref_out(out.size()), ref_lse(group);

  nlohmann::json results = nlohmann::json::array(), limits = nlohmann::json::object();
  std::printf("pool %.2f GiB, head_dim %lld, group %lld, %lld-token pages (%zu bytes)\n",
              pool_pages * page_bytes / double(1 << 30), static_cast<long long>(head_dim),
              static_cast<long long>(group), static_cast<long long>(page_tokens), page_bytes);
  std::printf("%7s %8s %7s | %9s %9s %9s | %8s %8s %7s | %8s\n", "threads", "context", "budget",
              "ms", "ms p10", "ms p90", "MB read", "GB/s", "% probe", "rel err");
  for (int64_t t : threads_list) {
    kernels::cpu::SetNumThreads(static_cast<int>(t));
    const int nthreads = kernels::cpu::NumThreads();
    const double probe = MeasureReadBandwidthGbps(size_t{1} << 30, nthreads);
    limits[std::to_string(nthreads) + "_threads"] = {{"host_read_gbps", probe}};
    for (int64_t context : contexts) {
      const int64_t pages = (context + page_tokens - 1) / page_tokens;
      for (double budget : budgets) {
        const int64_t selected = std::max<int64_t>(1, std::llround(budget * pages));
        std::vector<double> ms;
        double err = 0;
        for (int64_t r = 0; r < repeats + 1; ++r) {
          // A different head's pages every repeat: a contiguous run, as the arena allocates.
          const int64_t first = static_cast<int64_t>(rng() % (pool_pages - pages));
          std::vector<int32_t> ids(pages);
          std::iota(ids.begin(), ids.end(), static_cast<int32_t>(first));
          if (selected < pages) {
            std::shuffle(ids.begin(), ids.end(), rng);
            ids.resize(selected);
            std::sort(ids.begin(), ids.end());
          }
          std::vector<PageSpan> spans;
          for (int32_t id : ids) spans.push_back({id, 0, static_cast<int32_t>(page_tokens)});
          auto t0 = std::chrono::steady_clock::now();
          kernels::cpu::PagedAttentionSplit(kv, spans.data(), spans.size(), query,
                                            {out.data(), lse.data()}, nthreads);
          const double elapsed =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          if (r == 0) {
            // Correctness in the same run, before any timing counts.
            kernels::reference::PagedAttention(kv, spans.data(), spans.size(), query,
                                               {ref_out.data(), ref_lse.data()});
            err = RelErr(out, ref_out);
            if (err > 1e-4) {
              std::cerr << "error: kernel output differs from the reference (rel err " << err
                        << ")\n";
              return 1;
            }
          } else {
            ms.push_back(elapsed * 1e3);
          }
        }
        const Stats st = Summarize(ms);
        const double mb = selected * page_bytes / 1e6;
        const double gbps = mb / 1e3 / (st.median / 1e3);
        std::printf("%7d %8lld %7.3f | %9.4f %9.4f %9.4f | %8.2f %8.2f %6.0f%% | %8.1e\n",
                    nthreads, static_cast<long long>(context), budget, st.median, st.p10, st.p90,
                    mb, gbps, 100 * gbps / probe, err);
        results.push_back({{"policy", budget >= 1.0 ? "full" : "random_pages"},
                           {"context", context},
                           {"budget", budget},
                           {"threads", nthreads},
                           {"ms", st.median},
                           {"ms_p10", st.p10},
                           {"ms_p90", st.p90},
                           {"bytes_read", selected * page_bytes},
                           {"gbps", gbps},
                           {"pct_of_read_probe", 100 * gbps / probe},
                           {"rel_err", err}});
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

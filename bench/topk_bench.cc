// `fluxion bench topk`: radix-select top-k against std::nth_element on the same scores, single
// thread, at the selection sizes sparse decoding meets (block scores at 128K: 2K-8K entries;
// token scores: 32K-128K entries).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <random>

#include "bench/bench_util.h"
#include "bench/topk_bench.h"
#include "common/cpu_threads.h"
#include "common/flag_set.h"
#include "kernels/cpu/process_cpu.h"
#include "kernels/cpu/topk.h"

namespace fluxion::bench {

int RunTopKBench(const std::vector<std::string>& args) {
  std::vector<int64_t> sizes = {2048, 8192, 32768, 131072};
  std::vector<double> fractions = {0.05, 0.02};
  int64_t repeats = 50, seed = 0;
  std::string json_path;
  FlagSet flags("fluxion bench topk",
                "Times radix-select top-k against std::nth_element on random scores.");
  flags.IntList("n", &sizes, "numbers of scores");
  flags.DoubleList("fraction", &fractions, "k as a fraction of n");
  flags.Int("repeats", &repeats, "timed calls per point (median reported)");
  flags.Int("seed", &seed, "random seed");
  flags.String("json", &json_path, "also write results to this file");
  CpuThreadsFlag cpu_threads(flags, CpuRole::kOffline);
  if (int rc = ParseFlagsOrExit(flags, args); rc >= 0) return rc;
  if (absl::StatusOr<kernels::cpu::CpuPool> pool = kernels::cpu::SetUpProcessCpu(cpu_threads);
      !pool.ok()) {
    std::cerr << "error: " << pool.status().message() << "\n";
    return 2;
  }
  std::mt19937 rng(seed);
  nlohmann::json results = nlohmann::json::array();
  std::printf("%8s %7s | %12s %12s %8s\n", "n", "k", "radix us", "nth us", "speedup");
  for (int64_t n : sizes) {
    for (double fraction : fractions) {
      const int64_t k = std::max<int64_t>(1, static_cast<int64_t>(fraction * n));
      std::vector<double> radix_us, nth_us;
      std::vector<int32_t> a, b;
      for (int64_t r = 0; r < repeats + 1; ++r) {
        // Attention-like scores: mostly noise plus a few large outliers.
        std::normal_distribution<float> normal(0, 1);
        std::vector<float> scores(n);
        for (float& x : scores) x = normal(rng);
        for (int i = 0; i < 8; ++i) scores[rng() % n] += 8.0f;
        auto t0 = std::chrono::steady_clock::now();
        kernels::cpu::TopKIndices(scores.data(), n, k, &a);
        auto t1 = std::chrono::steady_clock::now();
        kernels::cpu::TopKIndicesNthElement(scores.data(), n, k, &b);
        auto t2 = std::chrono::steady_clock::now();
        std::sort(a.begin(), a.end());
        std::sort(b.begin(), b.end());
        if (a != b) {
          std::cerr << "error: radix and nth_element selections differ at n=" << n << "\n";
          return 1;
        }
        if (r == 0) continue;  // warm-up
        radix_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
        nth_us.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
      }
      const Stats ra = Summarize(radix_us), nt = Summarize(nth_us);
      std::printf("%8lld %7lld | %12.1f %12.1f %7.2fx\n", static_cast<long long>(n),
                  static_cast<long long>(k), ra.median, nt.median, nt.median / ra.median);
      results.push_back({{"n", n},
                         {"k", k},
                         {"radix_us", ra.median},
                         {"radix_us_p10", ra.p10},
                         {"radix_us_p90", ra.p90},
                         {"nth_element_us", nt.median},
                         {"speedup", nt.median / ra.median}});
    }
  }
  if (!json_path.empty()) {
    auto doc = ResultEnvelope(JoinCommand("fluxion bench topk", args), nlohmann::json::object(),
                              results);
    if (absl::Status s = WriteJson(json_path, doc); !s.ok()) {
      std::cerr << "error: " << s << "\n";
      return 1;
    }
    std::cout << "wrote " << json_path << "\n";
  }
  return 0;
}

}  // namespace fluxion::bench

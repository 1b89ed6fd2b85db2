#include "bench/selection_bench.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <random>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "bench/bench_util.h"
#include "bench/cuda_bench_util.h"
#include "common/flag_set.h"
#include "common/status_macros.h"
#include "kernels/compact_keys.h"
#include "kernels/cuda/compact_select.h"
#include "kernels/cuda/cuda_ops.h"
#include "nlohmann/json.hpp"

namespace fluxion::bench {
namespace {

namespace cuda = kernels::cuda;

struct Options {
  std::vector<int64_t> batches = {1, 4, 16};
  std::vector<int64_t> contexts = {32768, 131072};
  std::vector<double> fractions = {0.05, 0.02};
  int64_t heads = 32, kv_heads = 8, head_dim = 128;
  // The regions the policies keep whole (sink and local window) are not scored.
  int64_t sink = 64, local = 256;
  int64_t repeats = 20, max_tokens_in_hbm = int64_t{1} << 20;
};

// One point's device data: the batch's compact keys (one layer), queries, picks and scratch.
struct Point {
  kernels::CompactKeysLayout layout;
  float* q = nullptr;
  int32_t* slots = nullptr;
  kernels::CompactPick* picks = nullptr;
  float* scores = nullptr;
  int32_t* out = nullptr;
  int64_t batch = 0, span = 0, k = 0;
};

// Random int8 rows and positive scales: the scan's cost does not depend on the values, the
// select's little (the radix passes narrow a key range whatever its shape).
absl::StatusOr<Point> MakePoint(const Options& o, DeviceMemory& mem, int64_t batch,
                                int64_t context, double fraction, std::mt19937_64& rng) {
  Point p;
  p.batch = batch;
  p.span = context - o.sink - o.local;
  p.k = std::max<int64_t>(1, static_cast<int64_t>(fraction * p.span));
  p.layout = {1, o.kv_heads, o.head_dim, context, nullptr, nullptr};
  const int64_t rows = batch * o.kv_heads * context;
  std::vector<int8_t> values(rows * o.head_dim);
  for (size_t i = 0; i < values.size(); i += 8) {
    const uint64_t r = rng();
    std::copy_n(reinterpret_cast<const int8_t*>(&r), std::min<size_t>(8, values.size() - i),
                values.data() + i);
  }
  std::uniform_real_distribution<float> scale(0.005f, 0.02f);
  std::vector<float> scales(rows);
  for (float& s : scales) s = scale(rng);
  std::normal_distribution<float> normal(0, 1);
  std::vector<float> q(batch * o.heads * o.head_dim);
  for (float& x : q) x = normal(rng);
  std::vector<int32_t> slots(batch);
  std::vector<kernels::CompactPick> picks(batch * o.kv_heads);
  for (int64_t i = 0; i < batch; ++i) {
    slots[i] = static_cast<int32_t>(i);
    for (int64_t h = 0; h < o.kv_heads; ++h) {
      kernels::CompactPick& pick = picks[i * o.kv_heads + h];
      pick.begin = static_cast<int32_t>(o.sink);
      pick.end = static_cast<int32_t>(o.sink + p.span);
      pick.k = static_cast<int32_t>(p.k);
      pick.offset = (i * o.kv_heads + h) * p.k;
    }
  }
  auto upload = [&](const auto& v, auto** dst) -> absl::Status {
    const size_t bytes = v.size() * sizeof(v[0]);
    FLUXION_ASSIGN_OR_RETURN(void* d, mem.Get(bytes));
    BENCH_CUDA(cudaMemcpy(d, v.data(), bytes, cudaMemcpyHostToDevice));
    *dst = static_cast<std::remove_reference_t<decltype(**dst)>*>(d);
    return absl::OkStatus();
  };
  FLUXION_RETURN_IF_ERROR(upload(values, &p.layout.values));
  FLUXION_RETURN_IF_ERROR(upload(scales, &p.layout.scales));
  FLUXION_RETURN_IF_ERROR(upload(q, &p.q));
  FLUXION_RETURN_IF_ERROR(upload(slots, &p.slots));
  FLUXION_RETURN_IF_ERROR(upload(picks, &p.picks));
  FLUXION_ASSIGN_OR_RETURN(void* scores, mem.Get(batch * o.kv_heads * p.span * sizeof(float)));
  FLUXION_ASSIGN_OR_RETURN(void* out, mem.Get(batch * o.kv_heads * p.k * sizeof(int32_t)));
  p.scores = static_cast<float*>(scores);
  p.out = static_cast<int32_t*>(out);
  return p;
}

absl::Status TimePoint(const Options& o, const Point& p, double hbm_gbps, cudaStream_t stream,
                       nlohmann::json* results) {
  auto scores = [&] {
    return CudaCheck(cuda::CompactScores(p.layout, 0, p.q, o.heads, p.slots, p.picks, nullptr,
                                         p.batch, p.span, p.scores, stream),
                     "CompactScores");
  };
  auto select = [&] {
    return CudaCheck(cuda::CompactSelectBest(p.layout, p.slots, p.picks, p.batch, p.span,
                                             p.scores, p.out, stream),
                     "CompactSelectBest");
  };
  auto both = [&] {
    return CudaCheck(cuda::CompactTopK(p.layout, 0, p.q, o.heads, p.slots, p.picks, nullptr,
                                       p.batch, p.span, p.scores, p.out, stream),
                     "CompactTopK");
  };
  FLUXION_ASSIGN_OR_RETURN(Stats scan, TimeMs(stream, o.repeats, scores));
  FLUXION_ASSIGN_OR_RETURN(Stats pick, TimeMs(stream, o.repeats, select));
  FLUXION_ASSIGN_OR_RETURN(Stats total, TimeMs(stream, o.repeats, both));
  const int64_t pairs = p.batch * o.kv_heads;
  const double bytes = static_cast<double>(pairs * p.span) * (o.head_dim + sizeof(float));
  const double scan_gbps = bytes / (scan.median * 1e-3) / 1e9;
  std::printf("%6lld %8lld %6lld %8lld | %9.1f %7.0f %5.0f%% | %9.1f %9.1f | %9.2f\n",
              static_cast<long long>(p.batch), static_cast<long long>(p.layout.max_tokens),
              static_cast<long long>(pairs), static_cast<long long>(p.k), 1e3 * scan.median,
              scan_gbps, 100 * scan_gbps / hbm_gbps, 1e3 * pick.median, 1e3 * total.median,
              32e-3 * 1e3 * total.median);
  std::fflush(stdout);
  results->push_back({{"batch", p.batch},
                      {"context", p.layout.max_tokens},
                      {"pairs", pairs},
                      {"span", p.span},
                      {"k", p.k},
                      {"scores_us", 1e3 * scan.median},
                      {"scan_gbps", scan_gbps},
                      {"scan_share_of_hbm_copy", scan_gbps / hbm_gbps},
                      {"select_us", 1e3 * pick.median},
                      {"topk_us", 1e3 * total.median},
                      {"topk_us_p90", 1e3 * total.p90}});
  return absl::OkStatus();
}

absl::Status Run(const Options& o, nlohmann::json* limits, nlohmann::json* results) {
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreate(&stream));
  double hbm_gbps = 0;
  {
    DeviceMemory probe_mem;
    FLUXION_ASSIGN_OR_RETURN(hbm_gbps, HbmCopyGbps(probe_mem, stream, o.repeats));
  }
  *limits = {{"hbm_copy_gbps_read_plus_write", hbm_gbps}};
  std::printf("probe: HBM copy %.0f GB/s (bytes read + written); %lld query / %lld KV heads of "
              "%lld, one layer\n\n",
              hbm_gbps, static_cast<long long>(o.heads), static_cast<long long>(o.kv_heads),
              static_cast<long long>(o.head_dim));
  std::printf("%6s %8s %6s %8s | %9s %7s %6s | %9s %9s | %9s\n", "batch", "context", "pairs", "k",
              "scan us", "GB/s", "%HBM", "select us", "topk us", "ms/32 lay");
  std::mt19937_64 rng(1);
  for (int64_t context : o.contexts) {
    for (int64_t batch : o.batches) {
      if (batch * context > o.max_tokens_in_hbm) {
        std::printf("%6lld %8lld  skipped: more than --max-tokens %lld\n",
                    static_cast<long long>(batch), static_cast<long long>(context),
                    static_cast<long long>(o.max_tokens_in_hbm));
        continue;
      }
      for (double fraction : o.fractions) {
        DeviceMemory mem;
        FLUXION_ASSIGN_OR_RETURN(Point p, MakePoint(o, mem, batch, context, fraction, rng));
        FLUXION_RETURN_IF_ERROR(TimePoint(o, p, hbm_gbps, stream, results));
      }
    }
  }
  cudaStreamDestroy(stream);
  return absl::OkStatus();
}

absl::Status Validate(const Options& o) {
  if (o.heads <= 0 || o.kv_heads <= 0 || o.heads % o.kv_heads != 0 || o.heads / o.kv_heads > 8) {
    return absl::InvalidArgumentError("--heads must be 1..8 times --kv-heads");
  }
  if (o.head_dim != 32 && o.head_dim != 64 && o.head_dim != 128) {
    return absl::InvalidArgumentError("--head-dim must be 32, 64 or 128");
  }
  if (o.repeats <= 0 || o.sink < 0 || o.local < 0) {
    return absl::InvalidArgumentError("--repeats must be positive, --sink and --local >= 0");
  }
  for (int64_t c : o.contexts) {
    if (c <= o.sink + o.local || c > (int64_t{1} << 30)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--contexts values must exceed --sink + --local (", o.sink + o.local,
                       ") and be at most 2^30"));
    }
  }
  for (int64_t b : o.batches) {
    if (b <= 0 || b > 65535) return absl::InvalidArgumentError("--batch values must be 1..65535");
  }
  for (double f : o.fractions) {
    if (!(f > 0 && f <= 1)) return absl::InvalidArgumentError("--fraction values in (0, 1]");
  }
  return absl::OkStatus();
}

}  // namespace

int RunSelectionBench(const std::vector<std::string>& args) {
  Options o;
  std::string json_path;
  FlagSet flags("fluxion bench selection",
                "Times device selection's kernels on the GPU for one layer: the compact-key scan "
                "(CompactScores) against the HBM copy probe of the same run, the per-(request, KV "
                "head) top-k (CompactSelectBest), and both as the hybrid step issues them "
                "(CompactTopK); the last column is that times 32 layers.");
  flags.IntList("batch", &o.batches, "requests per step");
  flags.IntList("contexts", &o.contexts, "tokens each request holds");
  flags.DoubleList("fraction", &o.fractions, "k as a share of the scored span (the budget)");
  flags.Int("heads", &o.heads, "query heads (Llama-3.1-8B: 32, Qwen2.5-7B: 28)");
  flags.Int("kv-heads", &o.kv_heads, "KV heads (Llama-3.1-8B: 8, Qwen2.5-7B: 4)");
  flags.Int("head-dim", &o.head_dim, "head dimension: 32, 64 or 128");
  flags.Int("sink", &o.sink, "leading tokens kept whole (not scored)");
  flags.Int("local", &o.local, "trailing tokens kept whole (not scored)");
  flags.Int("max-tokens", &o.max_tokens_in_hbm,
            "skip points whose batch x context exceeds this (compact keys of one layer)");
  flags.Int("repeats", &o.repeats, "timed repeats per kernel and point (median reported)");
  flags.String("json", &json_path, "also write results to this file");
  if (int rc = ParseFlagsOrExit(flags, args); rc >= 0) return rc;
  if (absl::Status s = Validate(o); !s.ok()) {
    std::cerr << "error: " << s.message() << "\n";
    return 2;
  }
  if (!cuda::DeviceAvailable()) {
    std::cerr << "error: no CUDA device\n";
    return 1;
  }
  nlohmann::json limits, results = nlohmann::json::array();
  if (absl::Status s = Run(o, &limits, &results); !s.ok()) {
    std::cerr << "error: " << s.message() << "\n";
    return 1;
  }
  if (!json_path.empty()) {
    const nlohmann::json doc =
        ResultEnvelope(JoinCommand("fluxion bench selection", args), limits, results);
    if (absl::Status s = WriteJson(json_path, doc); !s.ok()) {
      std::cerr << "error: " << s.message() << "\n";
      return 1;
    }
  }
  return 0;
}

}  // namespace fluxion::bench

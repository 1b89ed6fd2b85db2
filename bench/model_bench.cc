// `fluxion bench model`: CPU prefill and decode throughput of the model runtime, beside the two
// limits that bound them on this machine: decode streams every weight and the KV cache once per
// token (floor = those bytes / measured read bandwidth); prefill is matrix products (ceiling =
// measured sgemm rate).
#include "bench/model_bench.h"

#include <cblas.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <random>

#include "bench/bench_util.h"
#include "common/cpu_threads.h"
#include "common/flag_set.h"
#include "common/status_macros.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/process_cpu.h"
#include "model/model.h"
#include "model/random_model.h"
#include "model/sampler.h"

namespace fluxion::bench {
namespace {

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Single-precision matrix-product rate (GFLOP/s) at a square size typical of prefill.
double MeasureSgemmGflops(int64_t n, int repeats) {
  std::vector<float> a(n * n, 0.5f), b(n * n, 0.25f), c(n * n);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1, 1);
  for (auto* v : {&a, &b})
    for (float& x : *v) x = u(rng);
  double best = 0;
  for (int r = 0; r < repeats + 1; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, n, 1.0f, a.data(), n, b.data(), n,
                0.0f, c.data(), n);
    if (r > 0) best = std::max(best, 2.0 * n * n * n / Seconds(t0) / 1e9);
  }
  return best;
}

struct ModelBenchOptions {
  std::string model_dir, preset = "tiny", json_path;
  std::vector<int64_t> prompt_tokens = {128, 1024};
  std::vector<int64_t> threads_list = {1, 0};
  int64_t decode_tokens = 32, repeats = 3, seed = 0;
};

// Without --model: a random --preset model written to a temporary folder, which becomes
// o->model_dir (the caller removes it once loaded). Returns -1 to go on, else the exit code.
int MakeRandomModel(ModelBenchOptions* o) {
  auto config = model::PresetConfig(o->preset);
  if (!config.ok()) {
    std::cerr << "error: " << config.status().message() << "\n";
    return 2;
  }
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("fluxion-bench-" + o->preset)).string();
  std::cerr << "making a random " << o->preset << " model in " << dir << " ...\n";
  if (auto s = model::WriteRandomModel(*config, o->seed, dir); !s.ok()) {
    std::cerr << "error: " << s << "\n";
    return 1;
  }
  o->model_dir = dir;
  return -1;
}

// Medians of one (threads, prompt length) point: the prefill seconds, and the decode steps' ms.
struct ModelPoint {
  Stats prefill_s, decode_ms;
};

// --repeats prefills of a random prompt of `len` tokens (drawn from `rng`), each followed by
// --decode-tokens greedy decode steps.
absl::StatusOr<ModelPoint> TimePoint(const model::Model& m, int64_t len, const ModelBenchOptions& o,
                                     std::mt19937& rng) {
  std::vector<int32_t> prompt(len);
  for (auto& x : prompt) x = static_cast<int32_t>(rng() % m.config().vocab_size);
  std::vector<double> prefill_s, decode_ms;
  for (int64_t r = 0; r < o.repeats; ++r) {
    auto seq = m.NewSequence();
    std::vector<float> logits;
    auto t0 = std::chrono::steady_clock::now();
    FLUXION_RETURN_IF_ERROR(m.Forward(*seq, prompt, &logits));
    prefill_s.push_back(Seconds(t0));
    int32_t token = model::ArgMax(logits);
    for (int64_t i = 0; i < o.decode_tokens; ++i) {
      t0 = std::chrono::steady_clock::now();
      FLUXION_RETURN_IF_ERROR(m.Forward(*seq, absl::MakeConstSpan(&token, 1), &logits));
      decode_ms.push_back(Seconds(t0) * 1e3);
      token = model::ArgMax(logits);
    }
  }
  return ModelPoint{Summarize(prefill_s), Summarize(decode_ms)};
}

// Prints one point against its limits and appends its JSON record.
void ReportPoint(const model::Model& m, int64_t len, const ModelBenchOptions& o, int nthreads,
                 double read_gbps, double sgemm_gflops, const ModelPoint& p,
                 nlohmann::json* results) {
  // A decode step reads every weight and the whole fp32 KV cache once (at the mean context of the
  // timed steps). When both fit in the CPU caches (the tiny model) a step can beat this DRAM
  // floor: the percentage then exceeds 100.
  const auto& c = m.config();
  const double weight_gb = m.num_parameters() * 4.0 / 1e9;
  const double kv_gb =
      2.0 * 4.0 * c.num_layers * c.num_kv_heads * c.head_dim * (len + o.decode_tokens / 2.0) / 1e9;
  const double floor_ms = (weight_gb + kv_gb) / read_gbps * 1e3;
  const Stats& pre = p.prefill_s;
  const Stats& dec = p.decode_ms;
  // Prefill FLOPs: 2 per parameter per token for the matrix products (attention excluded, so the
  // percentage is a slight underestimate at long prompts).
  const double prefill_tps = len / pre.median;
  const double sgemm_pct = 100.0 * 2.0 * m.num_parameters() * prefill_tps / 1e9 / sgemm_gflops;
  std::printf("%7d %7lld | %12.1f %8.0f%% | %11.3f %12.1f %10.3f %6.0f%%\n", nthreads,
              static_cast<long long>(len), prefill_tps, sgemm_pct, dec.median, 1e3 / dec.median,
              floor_ms, 100.0 * floor_ms / dec.median);
  results->push_back({{"threads", nthreads},
                      {"context", len},
                      {"prefill_ms", pre.median * 1e3},
                      {"prefill_ms_p10", pre.p10 * 1e3},
                      {"prefill_ms_p90", pre.p90 * 1e3},
                      {"prefill_tokens_per_s", prefill_tps},
                      {"prefill_pct_of_sgemm", sgemm_pct},
                      {"tpot_ms", dec.median},
                      {"tpot_ms_p10", dec.p10},
                      {"tpot_ms_p90", dec.p90},
                      {"tokens_per_s", 1e3 / dec.median},
                      {"decode_floor_ms", floor_ms},
                      {"decode_pct_of_floor", 100.0 * floor_ms / dec.median}});
}

// Every (threads, prompt length) point, each thread count's limits measured first.
absl::Status RunPoints(const model::Model& m, const ModelBenchOptions& o, nlohmann::json* limits,
                       nlohmann::json* results) {
  std::mt19937 rng(o.seed);
  std::printf("model: %s, %.1fM parameters (%.2f GB fp32 in memory)\n", o.model_dir.c_str(),
              m.num_parameters() / 1e6, m.num_parameters() * 4.0 / 1e9);
  std::printf("%7s %7s | %12s %9s | %11s %12s %10s %7s\n", "threads", "prompt", "prefill tok/s",
              "% sgemm", "decode ms", "decode tok/s", "floor ms", "% floor");
  for (int64_t t : o.threads_list) {
    kernels::cpu::SetNumThreads(static_cast<int>(t));
    const int nthreads = kernels::cpu::NumThreads();
    const double read_gbps = MeasureReadBandwidthGbps(size_t{1} << 30, nthreads);
    const double sgemm_gflops = MeasureSgemmGflops(1024, 3);
    (*limits)[std::to_string(nthreads) + "_threads"] = {{"host_read_gbps", read_gbps},
                                                        {"sgemm_gflops", sgemm_gflops}};
    for (int64_t len : o.prompt_tokens) {
      FLUXION_ASSIGN_OR_RETURN(ModelPoint p, TimePoint(m, len, o, rng));
      ReportPoint(m, len, o, nthreads, read_gbps, sgemm_gflops, p, results);
    }
  }
  return absl::OkStatus();
}

}  // namespace

int RunModelBench(const std::vector<std::string>& args) {
  ModelBenchOptions o;
  FlagSet flags("fluxion bench model",
                "Measures CPU prefill and decode tokens/s of the model runtime against the "
                "machine's read bandwidth and sgemm rate.");
  flags.String("model", &o.model_dir, "model directory; empty = make a random --preset model");
  flags.String("preset", &o.preset, "random model shape when --model is empty");
  flags.IntList("prompt-tokens", &o.prompt_tokens, "prompt lengths to measure");
  flags.Int("decode-tokens", &o.decode_tokens, "decode steps timed after each prompt");
  CpuThreadsListFlag cpu_threads(flags, o.threads_list);
  flags.Int("repeats", &o.repeats, "repeats per point (median reported)");
  flags.Int("seed", &o.seed, "seed for prompts and the random model");
  flags.String("json", &o.json_path, "also write results to this file");
  if (int rc = ParseFlagsOrExit(flags, args); rc >= 0) return rc;
  absl::StatusOr<std::vector<int64_t>> sweep = kernels::cpu::SetUpProcessCpuSweep(cpu_threads);
  if (!sweep.ok()) {
    std::cerr << "error: " << sweep.status().message() << "\n";
    return 2;
  }
  o.threads_list = *std::move(sweep);
  const bool made = o.model_dir.empty();
  if (made) {
    if (int rc = MakeRandomModel(&o); rc >= 0) return rc;
  }
  auto loaded = model::Model::Load(o.model_dir);
  if (made) std::filesystem::remove_all(o.model_dir);
  if (!loaded.ok()) {
    std::cerr << "error: " << loaded.status() << "\n";
    return 1;
  }
  const model::Model& m = **loaded;
  nlohmann::json results = nlohmann::json::array(), limits = nlohmann::json::object();
  if (absl::Status s = RunPoints(m, o, &limits, &results); !s.ok()) {
    std::cerr << "error: " << s << "\n";
    return 1;
  }
  if (o.json_path.empty()) return 0;
  nlohmann::json doc = ResultEnvelope(JoinCommand("fluxion bench model", args), limits, results);
  doc["model"] = {
      {"dir", o.model_dir}, {"preset", made ? o.preset : ""}, {"parameters", m.num_parameters()}};
  if (auto s = WriteJson(o.json_path, doc); !s.ok()) {
    std::cerr << "error: " << s << "\n";
    return 1;
  }
  std::cout << "wrote " << o.json_path << "\n";
  return 0;
}

}  // namespace fluxion::bench

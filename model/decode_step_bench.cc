// decode_step_bench: one batched decode step (DecodeStepRunner over CpuDenseOps on a CpuPool)
// against B single-request Model::Forward calls, on random weights of a preset shape, every
// request holding `context` tokens of (random) K/V in the dense fp32 cache. Prints a table and
// writes JSON. Not a `fluxion bench` subcommand yet (bench/commands.cc is outside this change).
//
//   decode_step_bench --preset qwen2.5-0.5b --context 1024 --batches 1,4,8,16 --threads 1
//       --steps 3 --json out.json   (one line)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/flag_set.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/cpu_pool.h"
#include "model/cpu_dense_ops.h"
#include "model/decode_step.h"
#include "model/dense_attention.h"
#include "model/model.h"
#include "model/random_model.h"

namespace fluxion::model {
namespace {

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int Main(int argc, char** argv) {
  std::string preset = "qwen2.5-0.5b", model_dir, json;
  int64_t context = 1024, threads = 1, steps = 3;
  std::vector<int64_t> batches = {1, 4, 8, 16};
  FlagSet flags("decode_step_bench", "Batched decode step vs one Forward per request.");
  flags.String("preset", &preset, "random-weight model shape (when --model is not given)");
  flags.String("model", &model_dir, "model directory instead of random weights");
  flags.Int("context", &context, "tokens each request holds before the timed steps");
  flags.IntList("batches", &batches, "batch sizes");
  flags.Int("threads", &threads, "CPU threads (one pool for BLAS and everything else)");
  flags.Int("steps", &steps, "timed steps per path (after one warm-up step)");
  flags.String("json", &json, "write results here");
  std::vector<std::string> args(argv + 1, argv + argc);
  if (int rc = ParseFlagsOrExit(flags, args); rc >= 0) return rc;

  std::string dir = model_dir;
  if (dir.empty()) {
    dir = absl::StrCat(std::filesystem::temp_directory_path().string(), "/decode_step_bench_",
                       getpid());
    auto config = PresetConfig(preset);
    if (!config.ok() || !WriteRandomModel(*config, 1, dir).ok()) {
      std::cerr << "cannot write the random model\n";
      return 1;
    }
  }
  auto loaded = Model::Load(dir);
  if (model_dir.empty()) std::filesystem::remove_all(dir);
  if (!loaded.ok()) {
    std::cerr << loaded.status() << "\n";
    return 1;
  }
  const Model& m = **loaded;
  const ModelConfig& c = m.config();
  const int64_t vocab = c.vocab_size;
  const kernels::cpu::CpuPool pool(static_cast<int>(threads));
  kernels::cpu::SetNumThreads(static_cast<int>(threads));  // Forward's path: global settings

  // One prefilled cache of `context` random rows per layer, copied for every request.
  const AttentionShape shape = m.attention_shape();
  DenseAttention proto(shape);
  {
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> q(context * c.num_heads * c.head_dim), k(context * c.num_kv_heads *
                                                                c.head_dim),
        v(k.size()), out(q.size());
    for (int l = 0; l < c.num_layers; ++l) {
      for (auto* t : {&q, &k, &v})
        for (float& x : *t) x = normal(rng);
      if (!proto.Forward(l, 0, context, q.data(), k.data(), v.data(), out.data()).ok()) return 1;
    }
  }
  auto make_batch = [&](int64_t b) {
    std::vector<std::unique_ptr<Sequence>> seqs;
    for (int64_t i = 0; i < b; ++i) {
      seqs.push_back(std::make_unique<Sequence>(std::make_unique<DenseAttention>(proto), context));
    }
    return seqs;
  };

  std::printf("model %s (%lld params), context %lld, %lld thread(s), BLAS core %s\n",
              model_dir.empty() ? preset.c_str() : model_dir.c_str(),
              static_cast<long long>(m.num_parameters()), static_cast<long long>(context),
              static_cast<long long>(threads), kernels::cpu::BlasCoreName());
  std::printf("%6s %16s %16s %10s %14s %14s\n", "batch", "per-request ms", "batched ms",
              "speedup", "per-req tok/s", "batched tok/s");
  std::vector<std::string> rows;
  for (int64_t b : batches) {
    std::vector<int32_t> tokens(b);
    for (int64_t i = 0; i < b; ++i) tokens[i] = static_cast<int32_t>((17 * i + 3) % vocab);
    std::vector<float> logits;
    // Per request: B Forward calls of one token.
    auto alone = make_batch(b);
    std::vector<double> t_alone;
    for (int64_t s = 0; s <= steps; ++s) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int64_t i = 0; i < b; ++i) {
        if (!m.Forward(*alone[i], absl::MakeConstSpan(&tokens[i], 1), &logits).ok()) return 1;
      }
      if (s > 0) t_alone.push_back(Seconds(t0));
    }
    alone.clear();
    // Batched: one step through the runner.
    auto batched = make_batch(b);
    std::vector<Sequence*> ptrs;
    for (auto& s : batched) ptrs.push_back(s.get());
    CpuDenseOps ops(&pool);
    auto runner = DecodeStepRunner::Create(m, &ops);
    if (!runner.ok()) return 1;
    SequenceBatchAttention attention(ptrs, shape, &ops);
    std::vector<float> batch_logits(b * vocab);
    std::vector<double> t_batch;
    for (int64_t s = 0; s <= steps; ++s) {
      std::vector<int64_t> positions;
      for (Sequence* q : ptrs) positions.push_back(q->length());
      const auto t0 = std::chrono::steady_clock::now();
      const absl::Status st = (*runner)->Step(tokens, positions, attention, batch_logits.data());
      if (!st.ok()) {
        std::cerr << st << "\n";
        return 1;
      }
      if (s > 0) t_batch.push_back(Seconds(t0));
    }
    const double a = Median(t_alone), bt = Median(t_batch);
    std::printf("%6lld %16.1f %16.1f %9.2fx %14.2f %14.2f\n", static_cast<long long>(b), a * 1e3,
                bt * 1e3, a / bt, b / a, b / bt);
    rows.push_back(absl::StrCat("{\"batch\": ", b, ", \"per_request_step_ms\": ", a * 1e3,
                                ", \"batched_step_ms\": ", bt * 1e3, ", \"speedup\": ", a / bt,
                                "}"));
  }
  if (!json.empty()) {
    std::ofstream f(json);
    f << "{\"preset\": \"" << (model_dir.empty() ? preset : model_dir) << "\", \"context\": "
      << context << ", \"threads\": " << threads << ", \"steps\": " << steps
      << ", \"blas_core\": \"" << kernels::cpu::BlasCoreName() << "\", \"results\": ["
      << absl::StrJoin(rows, ", ") << "]}\n";
  }
  return 0;
}

}  // namespace
}  // namespace fluxion::model

int main(int argc, char** argv) { return fluxion::model::Main(argc, argv); }

#include "bench/executor_bench.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <random>

#include "absl/strings/str_cat.h"
#include "bench/bench_util.h"
#include "common/status_macros.h"
#include "decode/kv/kv_arena.h"
#include "decode/kv/paged_kv.h"
#include "decode/sparse/fluxion_predictor.h"
#include "decode/sparse/guard_flags.h"
#include "decode/sparse/policy.h"
#include "decode/step/sparse_attention.h"
#include "decode/step/step_executor.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/cpu_pool.h"
#include "model/dense_attention.h"
#include "model/model.h"
#include "model/random_model.h"

namespace fluxion::bench {
namespace {

constexpr int64_t kPageTokens = 16;
constexpr int64_t kRecordedRows = 32;  // the prefill's last query rows the sparse state uses

// A prompt's cache of `context` tokens: the model's own prefill over random token ids (real
// attention structure for a trained model) or random q/k/v rows (any shape, no compute).
absl::StatusOr<std::unique_ptr<model::DenseAttention>> MakePrefill(const model::Model& m,
                                                                   int64_t context,
                                                                   bool run_model) {
  const model::AttentionShape shape = m.attention_shape();
  auto dense = std::make_unique<model::DenseAttention>(shape);
  dense->RecordQueries(std::max<int64_t>(0, context - kRecordedRows), context);
  std::mt19937 rng(7);
  if (run_model) {
    std::vector<int32_t> prompt(context);
    for (auto& t : prompt) t = static_cast<int32_t>(rng() % m.config().vocab_size);
    model::DenseAttention* raw = dense.get();
    model::Sequence seq(std::move(dense));
    std::vector<float> logits;
    FLUXION_RETURN_IF_ERROR(m.Forward(seq, prompt, &logits));
    return std::make_unique<model::DenseAttention>(*raw);
  }
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const auto& c = m.config();
  std::vector<float> q(context * c.num_heads * c.head_dim),
      k(context * c.num_kv_heads * c.head_dim), v(k.size()), out(q.size());
  for (int l = 0; l < c.num_layers; ++l) {
    for (auto* t : {&q, &k, &v}) {
      for (float& x : *t) x = normal(rng);
    }
    FLUXION_RETURN_IF_ERROR(dense->Forward(l, 0, context, q.data(), k.data(), v.data(),
                                           out.data()));
  }
  return dense;
}

struct Timing {
  double median_ms = 0;
  std::vector<int32_t> first_tokens;  // greedy tokens of the first (warm-up) step
};

// `steps` timed steps (after one warm-up) of `executor` over fresh sequences made from `prefill`.
absl::StatusOr<Timing> TimeExecutor(decode::StepExecutor& executor, const model::Model& m,
                                    decode::KvArena* arena, const model::DenseAttention& prefill,
                                    int64_t context, const decode::sparse::PolicyConfig& policy,
                                    int64_t batch, int64_t steps) {
  std::vector<std::unique_ptr<model::Sequence>> owned;
  std::vector<decode::StepRequest> requests;
  const int64_t vocab = m.config().vocab_size;
  for (int64_t i = 0; i < batch; ++i) {
    FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<decode::SparseAttention> a,
                             decode::SparseAttention::FromDense(arena, m.attention_shape(),
                                                                kPageTokens, prefill, policy));
    decode::SparseAttention* attention = a.get();
    owned.push_back(std::make_unique<model::Sequence>(std::move(a), context));
    requests.push_back(
        {owned.back().get(), attention, static_cast<int32_t>((17 * i + 3) % vocab)});
  }
  std::vector<int32_t> tokens(batch);
  std::vector<float> logits;
  std::vector<absl::Status> statuses;
  std::vector<double> ms;
  Timing t;
  for (int64_t s = 0; s <= steps; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    executor.Step(requests, &logits, &statuses);
    const double elapsed =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    for (const absl::Status& st : statuses) FLUXION_RETURN_IF_ERROR(st);
    for (int64_t i = 0; i < batch; ++i) {
      const float* row = logits.data() + i * vocab;
      tokens[i] = static_cast<int32_t>(std::max_element(row, row + vocab) - row);
      requests[i].token = tokens[i];
    }
    if (s == 0) t.first_tokens = tokens;
    if (s > 0) ms.push_back(elapsed);
  }
  t.median_ms = Summarize(ms).median;
  return t;
}

absl::Status Run(const ExecutorBenchOptions& o, nlohmann::json* results) {
  std::string dir = o.model_dir;
  const bool random_weights = dir.empty();
  if (random_weights) {
    dir = absl::StrCat(std::filesystem::temp_directory_path().string(), "/fluxion_bench_decode_",
                       getpid());
    FLUXION_ASSIGN_OR_RETURN(model::ModelConfig config, model::PresetConfig(o.preset));
    FLUXION_RETURN_IF_ERROR(model::WriteRandomModel(config, 1, dir));
  }
  auto loaded = model::Model::Load(dir);
  if (random_weights) std::filesystem::remove_all(dir);
  FLUXION_RETURN_IF_ERROR(loaded.status());
  const model::Model& m = **loaded;
  const model::AttentionShape shape = m.attention_shape();
  const bool run_model = o.kv == "prefill" || (o.kv == "auto" && !random_weights);
  const std::string model_name = random_weights ? o.preset : o.model_dir;
  FLUXION_ASSIGN_OR_RETURN(std::vector<decode::sparse::PolicyConfig> policies,
                           decode::sparse::ExpandPolicies(o.policies, o.budgets));
  policies = decode::sparse::ExpandGuard(
      policies, o.guard_modes, o.guard,
      std::make_shared<const model::OutputProjection>(m.output_projection()));
  for (auto& p : policies) {
    if (decode::sparse::TraitsOf(p.kind).uses_predictor) {
      FLUXION_ASSIGN_OR_RETURN(p.fluxion_predictor,
                               decode::sparse::ResolvePredictor("", random_weights ? "" : dir));
    }
  }
  const int64_t max_batch = *std::max_element(o.batches.begin(), o.batches.end());
  const int64_t max_context = *std::max_element(o.contexts.begin(), o.contexts.end());
  // Every request's pages (prompt + steps, rounded to pages) plus the sparse state's room.
  const int64_t pages_per_request =
      shape.num_layers * shape.num_kv_heads * ((max_context + o.steps + 2) / kPageTokens + 2);
  FLUXION_ASSIGN_OR_RETURN(
      std::unique_ptr<decode::KvArena> arena,
      decode::KvArena::Create(decode::KvShape{shape.num_layers, shape.num_kv_heads,
                                              shape.head_dim, kPageTokens}
                                  .page_bytes(),
                              max_batch * pages_per_request * 2));
  std::printf("model %s (%lld params), KV %s, BLAS core %s\n", model_name.c_str(),
              static_cast<long long>(m.num_parameters()),
              run_model ? "from the model's prefill of random tokens" : "random rows",
              kernels::cpu::BlasCoreName());
  std::printf("%8s %-14s %7s %5s %15s %12s %8s %14s %13s %7s\n", "context", "policy", "threads",
              "batch", "per-request ms", "batched ms", "speedup", "per-req tok/s",
              "batched tok/s", "tokens");
  for (int64_t context : o.contexts) {
    FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<model::DenseAttention> prefill,
                             MakePrefill(m, context, run_model));
    for (const auto& policy : policies) {
      for (int64_t threads : o.threads) {
        const kernels::cpu::CpuPool pool(static_cast<int>(threads));
        kernels::cpu::SetNumThreads(static_cast<int>(threads));  // the per-request path's setting
        std::unique_ptr<decode::StepExecutor> per_request =
            decode::NewPerRequestStepExecutor(&m);
        std::unique_ptr<decode::StepExecutor> batched = decode::NewCpuStepExecutor(&m, &pool);
        for (int64_t batch : o.batches) {
          FLUXION_ASSIGN_OR_RETURN(Timing a, TimeExecutor(*per_request, m, arena.get(), *prefill,
                                                          context, policy, batch, o.steps));
          pool.ApplyToBlas();
          FLUXION_ASSIGN_OR_RETURN(Timing b, TimeExecutor(*batched, m, arena.get(), *prefill,
                                                          context, policy, batch, o.steps));
          kernels::cpu::SetNumThreads(static_cast<int>(threads));
          const bool same = a.first_tokens == b.first_tokens;
          const std::string label = decode::sparse::PolicyLabel(policy);
          std::printf("%8lld %-14s %7lld %5lld %15.2f %12.2f %7.2fx %14.1f %13.1f %7s\n",
                      static_cast<long long>(context), label.c_str(),
                      static_cast<long long>(threads), static_cast<long long>(batch), a.median_ms,
                      b.median_ms, a.median_ms / b.median_ms, 1e3 * batch / a.median_ms,
                      1e3 * batch / b.median_ms, same ? "equal" : "DIFFER");
          std::fflush(stdout);
          results->push_back({{"model", model_name},
                              {"context", context},
                              {"policy", label},
                              {"threads", threads},
                              {"batch", batch},
                              {"per_request_ms", a.median_ms},
                              {"batched_ms", b.median_ms},
                              {"speedup", a.median_ms / b.median_ms},
                              {"first_step_tokens_equal", same}});
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RunExecutorBench(const ExecutorBenchOptions& o, nlohmann::json* results) {
  return Run(o, results);
}

}  // namespace fluxion::bench

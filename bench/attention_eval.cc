// `fluxion eval attention`: attention-level quality of each sparse policy against full attention
// on the same inputs, over synthetic heads with real structure (bench/synthetic_heads.h):
//   rel_err  |o_policy - o_full| / |o_full| after a random output projection W_O over the group
//   recall   share of full attention's probability mass on the rows the policy attended
//   overlap  share of the exact top-k rows (same count as the policy's middle rows) it attended
// averaged over decode steps with drifting queries.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <random>
#include <set>

#include "bench/attention_eval.h"
#include "bench/bench_util.h"
#include "bench/synthetic_heads.h"
#include "common/flag_set.h"
#include "decode/paged_kv.h"
#include "decode/sparse/policy.h"
#include "kernels/cpu/paged_attention_cpu.h"
#include "kernels/cpu/topk.h"

namespace fluxion::bench {
namespace {

struct Metrics {
  double rel_err = 0, recall = 0, overlap = 0, read = 0;
  int64_t n = 0, overlap_n = 0;  // overlap only counts steps where the policy chose middle rows
};

}  // namespace

int RunAttentionEval(const std::vector<std::string>& args) {
  std::vector<int64_t> contexts = {4096, 16384};
  std::vector<double> budgets = {0.02, 0.05};
  std::vector<std::string> policies = {"exact_topk", "quest", "fixed_32_0.05"};
  int64_t head_dim = 128, group = 4, steps = 16, seed = 0;
  std::string json_path;
  FlagSet flags("fluxion eval attention",
                "Attention-level quality of sparse policies against full attention on synthetic "
                "structured heads: output error after W_O, mass recall, top-k overlap.");
  flags.IntList("contexts", &contexts, "context lengths in tokens");
  flags.DoubleList("budget", &budgets, "read budgets for each policy (fixed_* carry their own)");
  flags.StringList("policy", &policies, "sparse policies to evaluate");
  flags.Int("head-dim", &head_dim, "head dimension");
  flags.Int("group", &group, "query heads per KV head");
  flags.Int("steps", &steps, "decode steps per head");
  flags.Int("seed", &seed, "random seed");
  flags.String("json", &json_path, "also write results to this file");
  if (int rc = ParseFlagsOrExit(flags, args); rc >= 0) return rc;
  auto configs = decode::sparse::ExpandPolicies(policies, budgets);
  if (!configs.ok()) {
    std::cerr << "error: " << configs.status().message() << "\n";
    return 2;
  }
  if (!kernels::cpu::PagedAttentionSupported(head_dim, group, 16)) {
    std::cerr << "error: unsupported head_dim/group\n";
    return 2;
  }
  const decode::KvShape shape{1, 1, head_dim, 16};
  const int64_t max_ctx = *std::max_element(contexts.begin(), contexts.end());
  auto arena = decode::KvArena::Create(shape.page_bytes(), (max_ctx + steps) / 16 + 4);
  if (!arena.ok()) {
    std::cerr << "error: " << arena.status() << "\n";
    return 1;
  }
  // A fixed random output projection over the group's concatenated outputs: errors are judged
  // where they matter, after W_O, so a head whose output W_O shrinks counts less.
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0, 1);
  const int64_t gd = group * head_dim;
  std::vector<float> w_o(head_dim * gd);
  for (float& x : w_o) x = normal(rng) / std::sqrt(static_cast<float>(gd));
  auto project = [&](const std::vector<float>& o) {
    std::vector<double> y(head_dim, 0.0);
    for (int64_t i = 0; i < head_dim; ++i)
      for (int64_t j = 0; j < gd; ++j) y[i] += double(w_o[i * gd + j]) * o[j];
    return y;
  };
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));

  nlohmann::json results = nlohmann::json::array();
  std::printf("%-10s %8s %-16s | %9s %8s %8s %7s\n", "head", "context", "policy", "rel_err",
              "recall", "overlap", "read");
  for (HeadKind kind : AllHeadKinds()) {
    for (int64_t context : contexts) {
      const SyntheticHead head =
          MakeSyntheticHead(kind, context, head_dim, group, steps, seed + context);
      for (const decode::sparse::PolicyConfig& config : *configs) {
        const std::string label = decode::sparse::PolicyLabel(config);
        auto kv = *decode::PagedKv::Create(arena->get(), shape);
        const int64_t first_pos = context - steps;
        if (!kv->Append(0, first_pos, head.keys.data(), head.values.data(), head_dim).ok()) {
          std::cerr << "error: arena too small\n";
          return 1;
        }
        auto policy = decode::sparse::MakePolicy(config);
        Metrics m;
        std::vector<kernels::PageSpan> spans;
        std::vector<float> out(gd), full(gd), lse(group), full_lse(group);
        for (int64_t s = 0; s < steps; ++s) {
          const int64_t pos = first_pos + s;
          (void)kv->Append(0, 1, &head.keys[pos * head_dim], &head.values[pos * head_dim],
                           head_dim);
          const float* q = &head.queries[s * gd];
          const int64_t ctx = pos + 1;
          spans.clear();
          decode::sparse::SelectionStats stats;
          policy->Select({kv.get(), 0, 0, q, group, scale, ctx}, &spans, &stats);
          kernels::cpu::PagedAttention(kv->view(), spans.data(), spans.size(),
                                       {q, group, scale}, {out.data(), lse.data()});
          std::vector<kernels::PageSpan> all;
          decode::sparse::AppendTokenRange(*kv, 0, 0, 0, ctx, &all);
          kernels::cpu::PagedAttention(kv->view(), all.data(), all.size(), {q, group, scale},
                                       {full.data(), full_lse.data()});
          // Error after W_O.
          const auto yp = project(out), yf = project(full);
          double num = 0, den = 0;
          for (int64_t i = 0; i < head_dim; ++i) {
            num += (yp[i] - yf[i]) * (yp[i] - yf[i]);
            den += yf[i] * yf[i];
          }
          m.rel_err += std::sqrt(num / den);
          // Selected token set, full probabilities (from the stored bf16 keys), recall.
          std::vector<char> selected(ctx, 0);
          const auto& pages = kv->pages(0, 0);
          for (const auto& sp : spans) {
            const int64_t page_index =
                std::find(pages.begin(), pages.end(), sp.page) - pages.begin();
            for (int r = sp.first_row; r < sp.first_row + sp.rows; ++r)
              selected[page_index * 16 + r] = 1;
          }
          std::vector<float> max_logit(ctx, -INFINITY);
          double recall = 0;
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = q + g * head_dim;
            double mass = 0;
            for (int64_t t = 0; t < ctx; ++t) {
              const bf16* k = kv->view().keys(pages[t / 16]) + (t % 16) * head_dim;
              double dot = 0;
              for (int64_t j = 0; j < head_dim; ++j) dot += qg[j] * Bf16ToFloat(k[j]);
              const double logit = dot * scale;
              max_logit[t] = std::max(max_logit[t], static_cast<float>(logit));
              if (selected[t]) mass += std::exp(logit - full_lse[g]);
            }
            recall += mass / group;
          }
          m.recall += recall;
          // Overlap with the exact top-k of the middle region, same count as the policy chose.
          const int64_t sink_end = std::min<int64_t>(config.sink_tokens, ctx);
          const int64_t local_begin = std::max(sink_end, ctx - config.local_tokens);
          int64_t chosen = 0;
          for (int64_t t = sink_end; t < local_begin; ++t) chosen += selected[t];
          if (chosen > 0) {
            std::vector<int32_t> top;
            kernels::cpu::TopKIndices(max_logit.data() + sink_end, local_begin - sink_end,
                                      chosen, &top);
            int64_t hit = 0;
            for (int32_t i : top) hit += selected[sink_end + i];
            m.overlap += static_cast<double>(hit) / chosen;
            ++m.overlap_n;
          }
          m.read += static_cast<double>(stats.rows_attended) / ctx;
          ++m.n;
        }
        const double n = static_cast<double>(m.n);
        const double overlap = m.overlap_n > 0 ? m.overlap / m.overlap_n : NAN;
        std::printf("%-10s %8lld %-16s | %9.2e %8.4f %8.4f %7.4f\n", HeadKindName(kind),
                    static_cast<long long>(context), label.c_str(), m.rel_err / n, m.recall / n,
                    overlap, m.read / n);
        results.push_back({{"head", HeadKindName(kind)},
                           {"context", context},
                           {"policy", config.name},
                           {"budget", config.budget},
                           {"rel_err", m.rel_err / n},
                           {"recall", m.recall / n},
                           {"overlap_topk", m.overlap_n > 0 ? nlohmann::json(overlap)
                                                            : nlohmann::json(nullptr)},
                           {"budget_spent", m.read / n},
                           {"steps", m.n}});
      }
    }
  }
  if (!json_path.empty()) {
    auto doc = ResultEnvelope(JoinCommand("fluxion eval attention", args),
                              nlohmann::json::object(), results);
    doc["shape"] = {{"head_dim", head_dim}, {"group", group}, {"page_tokens", 16}};
    if (absl::Status st = WriteJson(json_path, doc); !st.ok()) {
      std::cerr << "error: " << st << "\n";
      return 1;
    }
    std::cout << "wrote " << json_path << "\n";
  }
  return 0;
}

}  // namespace fluxion::bench

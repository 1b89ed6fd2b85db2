// `fluxion eval attention`: attention-level quality of each sparse policy against full attention
// on the same inputs, over synthetic heads with real structure (bench/synthetic_heads.h) or, with
// --capture, over Q/K/V captured from the trained model (bench/captured_attention_eval.h):
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
#include "bench/attention_quality.h"
#include "bench/bench_util.h"
#include "bench/captured_attention_eval.h"
#include "bench/synthetic_heads.h"
#include "common/cpu_threads.h"
#include "common/flag_set.h"
#include "decode/paged_kv.h"
#include "decode/sparse_attention.h"
#include "decode/sparse/guard_flags.h"
#include "decode/sparse/policy.h"
#include "kernels/cpu/paged_attention_cpu.h"
#include "kernels/cpu/process_cpu.h"
#include "kernels/cpu/topk.h"

namespace fluxion::bench {

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
  std::string capture_dir, model_dir;
  flags.String("capture", &capture_dir,
               "evaluate on Q/K/V captured by `fluxion eval tasks --capture-dir` instead of "
               "synthetic heads");
  flags.String("model", &model_dir, "with --capture: model whose W_O the error is measured "
                                    "after (default: the one the capture names)");
  std::string head_table;
  flags.String("head-table", &head_table,
               "with --capture: write Fluxion's predictor training table (features + e_h(b) "
               "labels per step, layer and KV head; tools/fluxion_predictor/README.md) to this "
               "CSV; policies are then evaluated only when --policy is given");
  CpuThreadsFlag cpu_threads(flags, CpuRole::kOffline);
  decode::sparse::GuardFlags guard_flags(flags, /*allow_both=*/true);
  std::vector<std::string> selectors = {"host"};
  flags.StringList("selector", &selectors,
                   "where exact_topk and fluxion choose their rows: host and/or device (the top-k "
                   "of int8 compact keys, the hybrid step's GPU picks, computed bit for bit "
                   "here); with both, each is a row");
  if (int rc = ParseFlagsOrExit(flags, args); rc >= 0) return rc;
  const absl::StatusOr<decode::sparse::GuardFlags::Parsed> guard_read = guard_flags.Read();
  if (!guard_read.ok()) {
    std::cerr << "error: " << guard_read.status().message() << "\n";
    return 2;
  }
  const std::vector<bool>* guard_modes = &guard_read->modes;
  const decode::sparse::GuardConfig* guard = &guard_read->config;
  const bool guard_on = guard_modes->back();
  if (guard_on && capture_dir.empty()) {
    std::cerr << "error: --guard: a synthetic head is one KV head with no other to move budget "
                 "from or to; use --capture DIR (every KV head of each layer) or `fluxion eval "
                 "tasks --guard`\n";
    return 2;
  }
  if (absl::StatusOr<kernels::cpu::CpuPool> pool = kernels::cpu::SetUpProcessCpu(cpu_threads);
      !pool.ok()) {
    std::cerr << "error: " << pool.status().message() << "\n";
    return 2;
  }
  const bool policy_given = std::any_of(args.begin(), args.end(), [](const std::string& a) {
    return a.rfind("--policy", 0) == 0;
  });
  if (!head_table.empty() && capture_dir.empty()) {
    std::cerr << "error: --head-table needs --capture DIR\n";
    return 2;
  }
  if (!head_table.empty() && !policy_given) policies.clear();
  auto configs = decode::sparse::ExpandPolicies(policies, budgets);
  if (!configs.ok()) {
    std::cerr << "error: " << configs.status().message() << "\n";
    return 2;
  }
  {
    std::vector<decode::sparse::Selector> parsed;
    for (const std::string& name : selectors) {
      const absl::StatusOr<decode::sparse::Selector> s = decode::sparse::ParseSelector(name);
      if (!s.ok()) {
        std::cerr << "error: --selector: " << s.status().message() << "\n";
        return 2;
      }
      parsed.push_back(*s);
    }
    *configs = decode::sparse::ExpandSelectors(*configs, parsed);
  }
  if (!capture_dir.empty()) {
    // The captured replay gives each guarded config its own guard per layer, with that layer's
    // W_O (captured_attention_eval.cc); the projection here only marks the config as guarded.
    *configs = decode::sparse::ExpandGuard(
        *configs, *guard_modes, *guard,
        std::make_shared<const model::OutputProjection>(model::OutputProjection::Identity(1, 1)));
    auto rows = EvalCapturedAttention(capture_dir, model_dir, *configs, head_table);
    if (!rows.ok()) {
      std::cerr << "error: " << rows.status() << "\n";
      return 1;
    }
    if (!json_path.empty()) {
      auto doc = ResultEnvelope(JoinCommand("fluxion eval attention", args),
                                nlohmann::json::object(), *rows);
      if (absl::Status st = WriteJson(json_path, doc); !st.ok()) {
        std::cerr << "error: " << st << "\n";
        return 1;
      }
      std::cout << "wrote " << json_path << "\n";
    }
    return 0;
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
  auto project = [&](const std::vector<float>& o) { return Project(w_o, head_dim, gd, o); };
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));

  nlohmann::json results = nlohmann::json::array();
  PrintQualityHeader("head");
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
          decode::sparse::SelectionStats stats;
          decode::RunPolicyStep(*policy, {kv.get(), 0, 0, q, group, scale, ctx}, &spans, &stats,
                                out.data(), lse.data());
          std::vector<kernels::PageSpan> all;
          decode::sparse::AppendTokenRange(*kv, 0, 0, 0, ctx, &all);
          kernels::cpu::PagedAttention(kv->view(), all.data(), all.size(), {q, group, scale},
                                       {full.data(), full_lse.data()});
          m.rel_err += RelativeError(project(out), project(full));
          AddSelectionQuality(*kv, 0, 0, q, group, scale, ctx, spans, config, full_lse.data(),
                              stats.rows_attended, &m);
        }
        m.Print(HeadKindName(kind), context, label);
        nlohmann::json row = m.ToJson();
        row.update({{"head", HeadKindName(kind)},
                    {"context", context},
                    {"policy", config.name},
                    {"budget", config.budget}});
        results.push_back(row);
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

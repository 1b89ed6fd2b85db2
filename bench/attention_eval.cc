// `fluxion eval attention`: attention-level quality of each sparse policy against full attention
// on the same inputs, over synthetic heads with real structure (bench/synthetic_heads.h) or, with
// --capture, over Q/K/V captured from the trained model (bench/captured_attention_eval.h):
//   rel_err  |o_policy - o_full| / |o_full| after a random output projection W_O over the group
//   recall   share of full attention's probability mass on the rows the policy attended
//   overlap  share of the exact top-k rows (same count as the policy's middle rows) it attended
// averaged over decode steps with drifting queries.
#include "bench/attention_eval.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <random>
#include <set>

#include "bench/attention_quality.h"
#include "bench/bench_util.h"
#include "bench/captured_attention_eval.h"
#include "bench/synthetic_heads.h"
#include "common/cpu_threads.h"
#include "common/flag_set.h"
#include "common/status_macros.h"
#include "decode/kv/paged_kv.h"
#include "decode/sparse/guard_flags.h"
#include "decode/sparse/policy.h"
#include "decode/step/sparse_attention.h"
#include "kernels/cpu/paged_attention_cpu.h"
#include "kernels/cpu/process_cpu.h"
#include "kernels/cpu/topk.h"

namespace fluxion::bench {

namespace {

struct AttentionEvalFlags {
  std::vector<int64_t> contexts = {4096, 16384};
  std::vector<double> budgets = {0.02, 0.05};
  std::vector<std::string> policies = {"exact_topk", "quest", "fixed_32_0.05"};
  std::vector<std::string> selectors = {"host"};
  int64_t head_dim = 128, group = 4, steps = 16, seed = 0;
  std::string json_path, capture_dir, model_dir, head_table;
};

// Registers every flag but the two flag objects (--cpu-threads, the guard's), which the command
// places after these.
void RegisterFlags(FlagSet& flags, AttentionEvalFlags& f) {
  flags.IntList("contexts", &f.contexts, "context lengths in tokens");
  flags.DoubleList("budget", &f.budgets, "read budgets for each policy (fixed_* carry their own)");
  flags.StringList("policy", &f.policies, "sparse policies to evaluate");
  flags.Int("head-dim", &f.head_dim, "head dimension");
  flags.Int("group", &f.group, "query heads per KV head");
  flags.Int("steps", &f.steps, "decode steps per head");
  flags.Int("seed", &f.seed, "random seed");
  flags.String("json", &f.json_path, "also write results to this file");
  flags.String("capture", &f.capture_dir,
               "evaluate on Q/K/V captured by `fluxion eval tasks --capture-dir` instead of "
               "synthetic heads");
  flags.String("model", &f.model_dir,
               "with --capture: model whose W_O the error is measured "
               "after (default: the one the capture names)");
  flags.String("head-table", &f.head_table,
               "with --capture: write Fluxion's predictor training table (features + e_h(b) "
               "labels per step, layer and KV head; docs/CALIBRATE.md) to this "
               "CSV; policies are then evaluated only when --policy is given");
}

void RegisterSelectorFlag(FlagSet& flags, AttentionEvalFlags& f) {
  flags.StringList("selector", &f.selectors,
                   "where exact_topk, lfps and fluxion choose their rows: host and/or device "
                   "(the top-k of int8 compact keys, the hybrid step's GPU picks, computed bit "
                   "for bit here); with both, each is a row");
}

// The policies x budgets x selectors to evaluate (none with --head-table unless --policy is
// given); with --capture also x guard modes. InvalidArgument for a usage error.
absl::StatusOr<std::vector<decode::sparse::PolicyConfig>> Configs(
    AttentionEvalFlags& f, const decode::sparse::GuardFlags::Parsed& guard, bool policy_given) {
  if (!f.head_table.empty() && f.capture_dir.empty()) {
    return absl::InvalidArgumentError("--head-table needs --capture DIR");
  }
  if (!f.head_table.empty() && !policy_given) f.policies.clear();
  FLUXION_ASSIGN_OR_RETURN(std::vector<decode::sparse::PolicyConfig> configs,
                           decode::sparse::ExpandPolicies(f.policies, f.budgets));
  std::vector<decode::sparse::Selector> parsed;
  for (const std::string& name : f.selectors) {
    const absl::StatusOr<decode::sparse::Selector> s = decode::sparse::ParseSelector(name);
    if (!s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--selector: ", s.status().message()));
    }
    parsed.push_back(*s);
  }
  configs = decode::sparse::ExpandSelectors(configs, parsed);
  if (!f.capture_dir.empty()) {
    // The captured replay gives each guarded config its own guard per layer, with that layer's
    // W_O (captured_attention_eval.cc); the projection here only marks the config as guarded.
    configs = decode::sparse::ExpandGuard(
        configs, guard.modes, guard.config,
        std::make_shared<const model::OutputProjection>(model::OutputProjection::Identity(1, 1)));
  }
  return configs;
}

int WriteResults(const std::string& json_path, const std::vector<std::string>& args,
                 nlohmann::json doc_shape, const nlohmann::json& results) {
  if (json_path.empty()) return 0;
  auto doc = ResultEnvelope(JoinCommand("fluxion eval attention", args), nlohmann::json::object(),
                            results);
  if (!doc_shape.is_null()) doc["shape"] = std::move(doc_shape);
  if (absl::Status st = WriteJson(json_path, doc); !st.ok()) {
    std::cerr << "error: " << st << "\n";
    return 1;
  }
  std::cout << "wrote " << json_path << "\n";
  return 0;
}

// The metrics of `config` over the last `steps` positions of `head`, decoded one at a time.
// The pages come from `arena`.
absl::StatusOr<Metrics> EvalHead(const AttentionEvalFlags& f, const SyntheticHead& head,
                                 int64_t context, const decode::sparse::PolicyConfig& config,
                                 const std::vector<float>& w_o, decode::KvArena* arena) {
  const int64_t head_dim = f.head_dim, group = f.group, gd = group * head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  auto project = [&](const std::vector<float>& o) { return Project(w_o, head_dim, gd, o); };
  auto kv = *decode::PagedKv::Create(arena, decode::KvShape{1, 1, head_dim, 16});
  const int64_t first_pos = context - f.steps;
  if (!kv->Append(0, first_pos, head.keys.data(), head.values.data(), head_dim).ok()) {
    return absl::ResourceExhaustedError("arena too small");
  }
  auto policy = decode::sparse::MakePolicy(config);
  Metrics m;
  std::vector<kernels::PageSpan> spans;
  std::vector<float> out(gd), full(gd), lse(group), full_lse(group);
  for (int64_t s = 0; s < f.steps; ++s) {
    const int64_t pos = first_pos + s;
    (void)kv->Append(0, 1, &head.keys[pos * head_dim], &head.values[pos * head_dim], head_dim);
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
  return m;
}

// Every synthetic head kind x context x config, printed and written to --json.
int EvalSynthetic(const AttentionEvalFlags& f,
                  const std::vector<decode::sparse::PolicyConfig>& configs,
                  const std::vector<std::string>& args) {
  if (!kernels::cpu::PagedAttentionSupported(f.head_dim, f.group, 16)) {
    std::cerr << "error: unsupported head_dim/group\n";
    return 2;
  }
  const decode::KvShape shape{1, 1, f.head_dim, 16};
  const int64_t max_ctx = *std::max_element(f.contexts.begin(), f.contexts.end());
  auto arena = decode::KvArena::Create(shape.page_bytes(), (max_ctx + f.steps) / 16 + 4);
  if (!arena.ok()) {
    std::cerr << "error: " << arena.status() << "\n";
    return 1;
  }
  // A fixed random output projection over the group's concatenated outputs: errors are judged
  // where they matter, after W_O, so a head whose output W_O shrinks counts less.
  std::mt19937_64 rng(f.seed);
  std::normal_distribution<float> normal(0, 1);
  const int64_t gd = f.group * f.head_dim;
  std::vector<float> w_o(f.head_dim * gd);
  for (float& x : w_o) x = normal(rng) / std::sqrt(static_cast<float>(gd));
  nlohmann::json results = nlohmann::json::array();
  PrintQualityHeader("head");
  for (HeadKind kind : AllHeadKinds()) {
    for (int64_t context : f.contexts) {
      const SyntheticHead head =
          MakeSyntheticHead(kind, context, f.head_dim, f.group, f.steps, f.seed + context);
      for (const decode::sparse::PolicyConfig& config : configs) {
        absl::StatusOr<Metrics> m = EvalHead(f, head, context, config, w_o, arena->get());
        if (!m.ok()) {
          std::cerr << "error: " << m.status().message() << "\n";
          return 1;
        }
        m->Print(HeadKindName(kind), context, decode::sparse::PolicyLabel(config));
        nlohmann::json row = m->ToJson();
        row.update({{"head", HeadKindName(kind)},
                    {"context", context},
                    {"policy", config.name},
                    {"budget", config.budget}});
        results.push_back(row);
      }
    }
  }
  return WriteResults(f.json_path, args,
                      {{"head_dim", f.head_dim}, {"group", f.group}, {"page_tokens", 16}}, results);
}

}  // namespace

int RunAttentionEval(const std::vector<std::string>& args) {
  AttentionEvalFlags f;
  FlagSet flags("fluxion eval attention",
                "Attention-level quality of sparse policies against full attention on synthetic "
                "structured heads: output error after W_O, mass recall, top-k overlap.");
  RegisterFlags(flags, f);
  CpuThreadsFlag cpu_threads(flags, CpuRole::kOffline);
  decode::sparse::GuardFlags guard_flags(flags, /*allow_both=*/true);
  RegisterSelectorFlag(flags, f);
  if (int rc = ParseFlagsOrExit(flags, args); rc >= 0) return rc;
  const absl::StatusOr<decode::sparse::GuardFlags::Parsed> guard = guard_flags.Read();
  if (!guard.ok()) {
    std::cerr << "error: " << guard.status().message() << "\n";
    return 2;
  }
  if (guard->modes.back() && f.capture_dir.empty()) {
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
  const bool policy_given = std::any_of(
      args.begin(), args.end(), [](const std::string& a) { return a.rfind("--policy", 0) == 0; });
  absl::StatusOr<std::vector<decode::sparse::PolicyConfig>> configs =
      Configs(f, *guard, policy_given);
  if (!configs.ok()) {
    std::cerr << "error: " << configs.status().message() << "\n";
    return 2;
  }
  if (f.capture_dir.empty()) return EvalSynthetic(f, *configs, args);
  auto rows = EvalCapturedAttention(f.capture_dir, f.model_dir, *configs, f.head_table);
  if (!rows.ok()) {
    std::cerr << "error: " << rows.status() << "\n";
    return 1;
  }
  return WriteResults(f.json_path, args, nullptr, *rows);
}

}  // namespace fluxion::bench

#include "decode/commands.h"

#include <cstdio>
#include <iostream>

#include "absl/strings/str_join.h"
#include "common/cpu_threads.h"
#include "common/flag_set.h"
#include "decode/kv_arena.h"
#include "decode/sparse/fluxion_predictor.h"
#include "decode/sparse/guard_flags.h"
#include "decode/sparse/policy.h"
#include "decode/sparse_attention.h"
#include "kernels/cpu/process_cpu.h"
#include "model/cuda_dense_ops.h"
#include "model/generator.h"
#include "model/model.h"
#include "nlohmann/json.hpp"

namespace fluxion::decode {

int RunGenerateCommand(const std::vector<std::string>& args) {
  std::string model_dir;
  std::vector<int64_t> prompt_ids;
  std::vector<int64_t> stop_ids;
  int64_t max_tokens = 16, top_k = 0, seed = 0;
  double temperature = 0.0, top_p = 1.0;
  bool ignore_eos = false, json = false;
  std::string policy = "full";
  double budget = 0.05;
  int64_t page_tokens = 16;
  std::string device = "cpu";
  FlagSet flags("fluxion generate",
                "Generates tokens from a prompt of token ids (dense decode steps on the CPU, or "
                "with --device cuda on the GPU).");
  flags.String("model", &model_dir, "model directory (config.json + safetensors)");
  flags.IntList("prompt-ids", &prompt_ids, "prompt token ids, comma-separated");
  flags.Int("max-tokens", &max_tokens, "tokens to generate at most");
  flags.Double("temperature", &temperature, "sampling temperature; 0 = greedy");
  flags.Int("top-k", &top_k, "sample among the k most likely tokens; 0 = all");
  flags.Double("top-p", &top_p, "nucleus sampling threshold in (0, 1]");
  flags.Int("seed", &seed, "random seed for sampling");
  flags.IntList("stop-ids", &stop_ids, "extra token ids that end generation");
  flags.Bool("ignore-eos", &ignore_eos, "keep generating past the model's EOS token");
  flags.Bool("json", &json, "print one JSON object instead of text");
  CpuThreadsFlag cpu_threads(flags, CpuRole::kOffline);
  flags.String("device", &device,
               "where decode steps run their dense half: cpu, or cuda (bf16 weights on GPU 0; "
               "attention and the prompt's prefill stay on the CPU)");
  flags.String("policy", &policy,
               "decode attention: full (the model's own fp32 cache) or a sparse policy over bf16 "
               "host pages: " + sparse::PolicyNamesHelp());
  flags.Double("budget", &budget, "fraction of context rows a sparse policy reads");
  flags.Int("page-tokens", &page_tokens, "tokens per host KV page for sparse policies");
  std::string predictor_flag;
  flags.String("fluxion-predictor", &predictor_flag,
               "head-property predictor for the `fluxion` policy (JSON from "
               "tools/fluxion_predictor/train.py); default: <model>/fluxion_predictor.json if "
               "present (required when --policy is fluxion); `none`: fluxion runs its rule-based "
               "per-head budgets");
  sparse::GuardFlags guard_flags(flags);
  flags.Require("model");
  flags.Require("prompt-ids");
  if (int rc = ParseFlagsOrExit(flags, args); rc >= 0) return rc;
  absl::StatusOr<kernels::cpu::CpuPool> pool = kernels::cpu::SetUpProcessCpu(cpu_threads);
  if (!pool.ok()) {
    std::cerr << "error: " << pool.status().message() << "\n";
    return 2;
  }

  auto policy_config = sparse::ParsePolicy(policy, budget);
  if (!policy_config.ok()) {
    std::cerr << "error: " << policy_config.status().message() << "\n";
    return 2;
  }
  const absl::StatusOr<decode::sparse::GuardFlags::Parsed> guard_read = guard_flags.Read();
  if (!guard_read.ok()) {
    std::cerr << "error: " << guard_read.status().message() << "\n";
    return 2;
  }
  const std::vector<bool>* guard_modes = &guard_read->modes;
  const decode::sparse::GuardConfig* guard = &guard_read->config;
  if (sparse::TraitsOf(policy_config->kind).uses_predictor) {
    auto predictor = sparse::RequirePredictor(predictor_flag, model_dir);
    if (!predictor.ok()) {
      std::cerr << "error: " << predictor.status().message() << "\n";
      return 1;
    }
    policy_config->fluxion_predictor = *predictor;
  }
  std::unique_ptr<model::DenseOps> decode_ops;
  if (device == "cuda") {
    auto ops = model::NewCudaDenseOps(0);
    if (!ops.ok()) {
      std::cerr << "error: --device cuda: " << ops.status().message() << "\n";
      return 1;
    }
    decode_ops = std::move(*ops);
  } else if (device != "cpu") {
    std::cerr << "error: --device must be cpu or cuda, got '" << device << "'\n";
    return 2;
  }
  auto model = model::Model::Load(model_dir);
  if (!model.ok()) {
    std::cerr << "error: cannot load model from " << model_dir << ": " << model.status() << "\n";
    return 1;
  }
  *policy_config = sparse::WithGuard(
      *policy_config, (*guard_modes)[0], *guard,
      std::make_shared<const model::OutputProjection>((*model)->output_projection()));
  std::vector<int32_t> prompt(prompt_ids.begin(), prompt_ids.end());
  model::GenerationOptions options;
  options.sampling = model::SamplingParams{temperature, top_k, top_p, static_cast<uint64_t>(seed)};
  options.max_tokens = max_tokens;
  options.stop_token_ids.assign(stop_ids.begin(), stop_ids.end());
  options.ignore_eos = ignore_eos;
  options.decode_ops = decode_ops.get();  // null on the CPU: Model::Forward as always
  // Sparse policies decode over host pages from an arena sized for this one request.
  std::unique_ptr<KvArena> arena;
  SparseAttention* sparse_attention = nullptr;
  if (policy_config->kind != sparse::PolicyKind::kFull) {
    const model::AttentionShape shape = (*model)->attention_shape();
    const int64_t tokens = static_cast<int64_t>(prompt.size()) + max_tokens;
    auto created = KvArena::Create(
        KvShape{shape.num_layers, shape.num_kv_heads, shape.head_dim, page_tokens}.page_bytes(),
        shape.num_layers * shape.num_kv_heads * ((tokens + page_tokens - 1) / page_tokens + 1));
    if (!created.ok()) {
      std::cerr << "error: " << created.status() << "\n";
      return 1;
    }
    arena = std::move(*created);
    options.decode_attention = [&arena, &sparse_attention, &policy_config, shape,
                                page_tokens](const model::DenseAttention& prefilled)
        -> absl::StatusOr<std::unique_ptr<model::SequenceAttention>> {
      auto a = SparseAttention::FromDense(arena.get(), shape, page_tokens, prefilled,
                                          *policy_config);
      if (!a.ok()) return a.status();
      sparse_attention = a->get();
      return std::unique_ptr<model::SequenceAttention>(std::move(*a));
    };
  }
  auto result = model::Generate(**model, prompt, options);
  if (!result.ok()) {
    std::cerr << "error: " << result.status() << "\n";
    return 1;
  }
  const size_t n = result->tokens.size();
  const double decode_tps = n > 1 ? (n - 1) / result->decode_seconds : 0.0;
  if (json) {
    nlohmann::json out = {
        {"tokens", result->tokens},
        {"finish_reason", model::FinishReasonName(result->finish_reason)},
        {"prompt_tokens", prompt.size()},
        {"completion_tokens", n},
        {"ttft_ms", result->prefill_seconds * 1e3},
        {"decode_tokens_per_s", decode_tps},
        {"policy", policy},
        {"device", device},
        {"budget_spent", sparse_attention ? sparse_attention->attended_fraction() : 1.0},
    };
    if (sparse_attention != nullptr && sparse_attention->guard() != nullptr) {
      const sparse::GuardStats g = sparse_attention->guard_stats();
      const sparse::SelectionStats st = sparse_attention->stats();
      out["guard"] = {{"checks", g.checks},
                      {"check_read", st.context > 0 ? static_cast<double>(g.check_rows) / st.context
                                                    : 0.0},
                      {"escalations", g.escalations},
                      {"relaxations", g.relaxations}};
    }
    std::cout << out.dump() << "\n";
  } else {
    std::cout << "tokens: " << absl::StrJoin(result->tokens, " ") << "\n";
    std::printf("finish: %s | prompt %zu tokens, first token after %.1f ms | %zu tokens, "
                "%.1f tokens/s decode\n",
                model::FinishReasonName(result->finish_reason), prompt.size(),
                result->prefill_seconds * 1e3, n, decode_tps);
    if (sparse_attention != nullptr) {
      std::printf("policy: %s, read %.4f of the context per decode step\n", policy.c_str(),
                  sparse_attention->attended_fraction());
      if (sparse_attention->guard() != nullptr) {
        const sparse::GuardStats g = sparse_attention->guard_stats();
        const sparse::SelectionStats st = sparse_attention->stats();
        std::printf("guard: %lld exact checks reading %.4f of the context more, %lld "
                    "escalations, %lld relaxations\n",
                    static_cast<long long>(g.checks),
                    st.context > 0 ? static_cast<double>(g.check_rows) / st.context : 0.0,
                    static_cast<long long>(g.escalations), static_cast<long long>(g.relaxations));
      }
    }
  }
  return 0;
}

}  // namespace fluxion::decode

#include "decode/serving/commands.h"

#include <cstdio>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/cpu_threads.h"
#include "common/flag_set.h"
#include "common/status_macros.h"
#include "decode/kv/kv_arena.h"
#include "decode/sparse/fluxion_predictor.h"
#include "decode/sparse/guard_flags.h"
#include "decode/sparse/policy.h"
#include "decode/step/sparse_attention.h"
#include "kernels/cpu/process_cpu.h"
#include "model/cuda_dense_ops.h"
#include "model/generator.h"
#include "model/model.h"
#include "nlohmann/json.hpp"

namespace fluxion::decode {

namespace {

// Every flag of `fluxion generate`.
struct GenerateFlags {
  std::string model_dir, predictor_flag;
  std::vector<int64_t> prompt_ids, stop_ids;
  int64_t max_tokens = 16, top_k = 0, seed = 0, page_tokens = 16;
  double temperature = 0.0, top_p = 1.0, budget = 0.05;
  bool ignore_eos = false, json = false;
  std::string policy = "full", device = "cpu";
};

void RegisterSamplingFlags(FlagSet& flags, GenerateFlags& f) {
  flags.String("model", &f.model_dir, "model directory (config.json + safetensors)");
  flags.IntList("prompt-ids", &f.prompt_ids, "prompt token ids, comma-separated");
  flags.Int("max-tokens", &f.max_tokens, "tokens to generate at most");
  flags.Double("temperature", &f.temperature, "sampling temperature; 0 = greedy");
  flags.Int("top-k", &f.top_k, "sample among the k most likely tokens; 0 = all");
  flags.Double("top-p", &f.top_p, "nucleus sampling threshold in (0, 1]");
  flags.Int("seed", &f.seed, "random seed for sampling");
  flags.IntList("stop-ids", &f.stop_ids, "extra token ids that end generation");
  flags.Bool("ignore-eos", &f.ignore_eos, "keep generating past the model's EOS token");
  flags.Bool("json", &f.json, "print one JSON object instead of text");
}

void RegisterDecodeFlags(FlagSet& flags, GenerateFlags& f) {
  flags.String("device", &f.device,
               "where decode steps run their dense half: cpu, or cuda (bf16 weights on GPU 0; "
               "attention and the prompt's prefill stay on the CPU)");
  flags.String("policy", &f.policy,
               "decode attention: full (the model's own fp32 cache) or a sparse policy over bf16 "
               "host pages: " + sparse::PolicyNamesHelp());
  flags.Double("budget", &f.budget, "fraction of context rows a sparse policy reads");
  flags.Int("page-tokens", &f.page_tokens, "tokens per host KV page for sparse policies");
  flags.String("fluxion-predictor", &f.predictor_flag,
               "head-property predictor for the `fluxion` policy (JSON from "
               "`fluxion calibrate`); default: <model>/fluxion_predictor.json if "
               "present (required when --policy is fluxion); `none`: fluxion runs its rule-based "
               "per-head budgets");
}

// For --policy with a sparse attention: the host pages of one request and the attention made over
// them from the prefill's cache (`attention` points at it once made).
struct SparseDecode {
  std::unique_ptr<KvArena> arena;
  SparseAttention* attention = nullptr;
};

// The generation options from the flags; a sparse policy decodes over host pages from `sparse`'s
// arena, sized for this one request.
absl::StatusOr<model::GenerationOptions> MakeOptions(const GenerateFlags& f,
                                                     const model::Model& model,
                                                     const sparse::PolicyConfig& policy,
                                                     model::DenseOps* decode_ops,
                                                     SparseDecode* sparse) {
  model::GenerationOptions options;
  options.sampling =
      model::SamplingParams{f.temperature, f.top_k, f.top_p, static_cast<uint64_t>(f.seed)};
  options.max_tokens = f.max_tokens;
  options.stop_token_ids.assign(f.stop_ids.begin(), f.stop_ids.end());
  options.ignore_eos = f.ignore_eos;
  options.decode_ops = decode_ops;  // null on the CPU: Model::Forward as always
  if (policy.kind == sparse::PolicyKind::kFull) return options;
  const model::AttentionShape shape = model.attention_shape();
  const int64_t page_tokens = f.page_tokens;
  const int64_t tokens = static_cast<int64_t>(f.prompt_ids.size()) + f.max_tokens;
  FLUXION_ASSIGN_OR_RETURN(
      sparse->arena,
      KvArena::Create(
          KvShape{shape.num_layers, shape.num_kv_heads, shape.head_dim, page_tokens}.page_bytes(),
          shape.num_layers * shape.num_kv_heads * ((tokens + page_tokens - 1) / page_tokens + 1)));
  options.decode_attention = [sparse, policy, shape,
                              page_tokens](const model::DenseAttention& prefilled)
      -> absl::StatusOr<std::unique_ptr<model::SequenceAttention>> {
    auto a = SparseAttention::FromDense(sparse->arena.get(), shape, page_tokens, prefilled, policy);
    if (!a.ok()) return a.status();
    sparse->attention = a->get();
    return std::unique_ptr<model::SequenceAttention>(std::move(*a));
  };
  return options;
}

// The fluxion policy's head-property predictor (--fluxion-predictor or the model's own), for a
// policy that uses one.
absl::Status AddPredictor(const GenerateFlags& f, sparse::PolicyConfig* policy) {
  if (!sparse::TraitsOf(policy->kind).uses_predictor) return absl::OkStatus();
  FLUXION_ASSIGN_OR_RETURN(policy->fluxion_predictor,
                           sparse::RequirePredictor(f.predictor_flag, f.model_dir));
  return absl::OkStatus();
}

void PrintResult(const GenerateFlags& f, const model::GenerationResult& result,
                 const SparseAttention* sparse_attention) {
  const size_t n = result.tokens.size();
  const size_t prompt = f.prompt_ids.size();
  const double decode_tps = n > 1 ? (n - 1) / result.decode_seconds : 0.0;
  const bool guarded = sparse_attention != nullptr && sparse_attention->guard() != nullptr;
  sparse::GuardStats g;
  double check_read = 0;
  if (guarded) {
    g = sparse_attention->guard_stats();
    const sparse::SelectionStats st = sparse_attention->stats();
    check_read = st.context > 0 ? static_cast<double>(g.check_rows) / st.context : 0.0;
  }
  if (f.json) {
    nlohmann::json out = {
        {"tokens", result.tokens},
        {"finish_reason", model::FinishReasonName(result.finish_reason)},
        {"prompt_tokens", prompt},
        {"completion_tokens", n},
        {"ttft_ms", result.prefill_seconds * 1e3},
        {"decode_tokens_per_s", decode_tps},
        {"policy", f.policy},
        {"device", f.device},
        {"budget_spent", sparse_attention ? sparse_attention->attended_fraction() : 1.0},
    };
    if (guarded) {
      out["guard"] = {{"checks", g.checks},
                      {"check_read", check_read},
                      {"escalations", g.escalations},
                      {"relaxations", g.relaxations}};
    }
    std::cout << out.dump() << "\n";
    return;
  }
  std::cout << "tokens: " << absl::StrJoin(result.tokens, " ") << "\n";
  std::printf(
      "finish: %s | prompt %zu tokens, first token after %.1f ms | %zu tokens, "
      "%.1f tokens/s decode\n",
      model::FinishReasonName(result.finish_reason), prompt, result.prefill_seconds * 1e3, n,
      decode_tps);
  if (sparse_attention == nullptr) return;
  std::printf("policy: %s, read %.4f of the context per decode step\n", f.policy.c_str(),
              sparse_attention->attended_fraction());
  if (guarded) {
    std::printf(
        "guard: %lld exact checks reading %.4f of the context more, %lld "
        "escalations, %lld relaxations\n",
        static_cast<long long>(g.checks), check_read, static_cast<long long>(g.escalations),
        static_cast<long long>(g.relaxations));
  }
}

int Fail(const std::string& text, int exit_code) {
  std::cerr << "error: " << text << "\n";
  return exit_code;
}

}  // namespace

int RunGenerateCommand(const std::vector<std::string>& args) {
  GenerateFlags f;
  FlagSet flags("fluxion generate",
                "Generates tokens from a prompt of token ids (dense decode steps on the CPU, or "
                "with --device cuda on the GPU).");
  RegisterSamplingFlags(flags, f);
  CpuThreadsFlag cpu_threads(flags, CpuRole::kOffline);
  RegisterDecodeFlags(flags, f);
  sparse::GuardFlags guard_flags(flags);
  flags.Require("model");
  flags.Require("prompt-ids");
  if (int rc = ParseFlagsOrExit(flags, args); rc >= 0) return rc;
  absl::StatusOr<kernels::cpu::CpuPool> pool = kernels::cpu::SetUpProcessCpu(cpu_threads);
  if (!pool.ok()) return Fail(std::string(pool.status().message()), 2);
  auto policy = sparse::ParsePolicy(f.policy, f.budget);
  if (!policy.ok()) return Fail(std::string(policy.status().message()), 2);
  const auto guard = guard_flags.Read();
  if (!guard.ok()) return Fail(std::string(guard.status().message()), 2);
  if (absl::Status s = AddPredictor(f, &*policy); !s.ok()) {
    return Fail(std::string(s.message()), 1);
  }
  std::unique_ptr<model::DenseOps> decode_ops;
  if (f.device == "cuda") {
    auto ops = model::NewCudaDenseOps(0);
    if (!ops.ok()) return Fail(absl::StrCat("--device cuda: ", ops.status().message()), 1);
    decode_ops = std::move(*ops);
  } else if (f.device != "cpu") {
    return Fail(absl::StrCat("--device must be cpu or cuda, got '", f.device, "'"), 2);
  }
  auto model = model::Model::Load(f.model_dir);
  if (!model.ok()) {
    return Fail(
        absl::StrCat("cannot load model from ", f.model_dir, ": ", model.status().ToString()), 1);
  }
  *policy = sparse::WithGuard(
      *policy, guard->modes[0], guard->config,
      std::make_shared<const model::OutputProjection>((*model)->output_projection()));
  SparseDecode sparse;
  auto options = MakeOptions(f, **model, *policy, decode_ops.get(), &sparse);
  if (!options.ok()) return Fail(options.status().ToString(), 1);
  std::vector<int32_t> prompt(f.prompt_ids.begin(), f.prompt_ids.end());
  auto result = model::Generate(**model, prompt, *options);
  if (!result.ok()) return Fail(result.status().ToString(), 1);
  PrintResult(f, *result, sparse.attention);
  return 0;
}

}  // namespace fluxion::decode

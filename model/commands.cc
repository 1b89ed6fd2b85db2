#include "model/commands.h"

#include <cstdio>
#include <iostream>

#include "absl/strings/str_join.h"
#include "common/flag_set.h"
#include "kernels/cpu/cpu_ops.h"
#include "model/generator.h"
#include "model/model.h"
#include "model/random_model.h"
#include "nlohmann/json.hpp"

namespace fluxion::model {
namespace {

// Parses flags; returns -1 to continue, otherwise the exit code to return (help or usage error).
int ParseOrExit(FlagSet& flags, const std::vector<std::string>& args) {
  absl::Status status = flags.Parse(args);
  if (!status.ok()) {
    std::cerr << "error: " << status.message() << "\n";
    return 2;
  }
  if (flags.help_requested()) {
    std::cout << flags.Usage();
    return 0;
  }
  return -1;
}

}  // namespace

int RunGenerateCommand(const std::vector<std::string>& args) {
  std::string model_dir;
  std::vector<int64_t> prompt_ids;
  std::vector<int64_t> stop_ids;
  int64_t max_tokens = 16, top_k = 0, seed = 0, threads = 0;
  double temperature = 0.0, top_p = 1.0;
  bool ignore_eos = false, json = false;
  FlagSet flags("fluxion generate",
                "Generates tokens from a prompt of token ids with the CPU model runtime.");
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
  flags.Int("threads", &threads, "CPU threads; 0 = all cores");
  flags.Require("model");
  flags.Require("prompt-ids");
  if (int rc = ParseOrExit(flags, args); rc >= 0) return rc;

  kernels::cpu::SetNumThreads(static_cast<int>(threads));
  auto model = Model::Load(model_dir);
  if (!model.ok()) {
    std::cerr << "error: cannot load model from " << model_dir << ": " << model.status() << "\n";
    return 1;
  }
  std::vector<int32_t> prompt(prompt_ids.begin(), prompt_ids.end());
  GenerationOptions options;
  options.sampling = SamplingParams{temperature, top_k, top_p, static_cast<uint64_t>(seed)};
  options.max_tokens = max_tokens;
  options.stop_token_ids.assign(stop_ids.begin(), stop_ids.end());
  options.ignore_eos = ignore_eos;
  auto result = Generate(**model, prompt, options);
  if (!result.ok()) {
    std::cerr << "error: " << result.status() << "\n";
    return 1;
  }
  const size_t n = result->tokens.size();
  const double decode_tps = n > 1 ? (n - 1) / result->decode_seconds : 0.0;
  if (json) {
    nlohmann::json out = {
        {"tokens", result->tokens},
        {"finish_reason", FinishReasonName(result->finish_reason)},
        {"prompt_tokens", prompt.size()},
        {"completion_tokens", n},
        {"ttft_ms", result->prefill_seconds * 1e3},
        {"decode_tokens_per_s", decode_tps},
    };
    std::cout << out.dump() << "\n";
  } else {
    std::cout << "tokens: " << absl::StrJoin(result->tokens, " ") << "\n";
    std::printf("finish: %s | prompt %zu tokens, first token after %.1f ms | %zu tokens, "
                "%.1f tokens/s decode\n",
                FinishReasonName(result->finish_reason), prompt.size(),
                result->prefill_seconds * 1e3, n, decode_tps);
  }
  return 0;
}

int RunMakeModelCommand(const std::vector<std::string>& args) {
  std::string preset = "tiny", out;
  int64_t seed = 0;
  FlagSet flags("fluxion make-model",
                "Writes a random-weight model in Hugging Face layout (config.json + "
                "model.safetensors, bf16) for tests, benchmarks and the demo.");
  flags.String("preset", &preset, "model shape: " + absl::StrJoin(PresetNames(), ", "));
  flags.String("out", &out, "output directory (created)");
  flags.Int("seed", &seed, "random seed for the weights");
  flags.Require("out");
  if (int rc = ParseOrExit(flags, args); rc >= 0) return rc;
  auto config = PresetConfig(preset);
  if (!config.ok()) {
    std::cerr << "error: " << config.status().message() << "\n";
    return 2;
  }
  if (absl::Status s = WriteRandomModel(*config, static_cast<uint64_t>(seed), out); !s.ok()) {
    std::cerr << "error: " << s << "\n";
    return 1;
  }
  std::cout << "wrote " << preset << " model to " << out << "\n";
  return 0;
}

}  // namespace fluxion::model

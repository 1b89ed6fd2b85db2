#include "bench/eval/eval_command.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>

#include "absl/algorithm/container.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "bench/bench_util.h"
#include "bench/eval/eval_compare.h"
#include "bench/eval/task_eval.h"
#include "bench/eval/tasks.h"
#include "bench/attention_eval.h"
#include "common/cpu_threads.h"
#include "common/flag_set.h"
#include "common/status_macros.h"
#include "decode/sparse/decision_profile.h"
#include "decode/sparse/fluxion_predictor.h"
#include "decode/sparse/guard_flags.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/process_cpu.h"
#include "model/model.h"
#include "nlohmann/json.hpp"

#ifdef FLUXION_HAVE_CUDA
#include "bench/eval/cuda_eval_executor.h"
#endif

namespace fluxion::eval {
namespace {

// Model output can be any bytes (or specials spelled `<eos>`): show it on one line, escaped.
std::string Printable(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c == '\n') {
      out += "\\n";
    } else if (c < 0x20 || c >= 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  return out;
}

// The last `n` characters of `s`, with "..." when cut.
std::string Tail(const std::string& s, size_t n) {
  return s.size() <= n ? s : "..." + s.substr(s.size() - n);
}

void PrintTable(const std::vector<CellResult>& results) {
  std::printf("%-16s %8s  %-24s %5s  %8s  %-16s %7s %7s %7s %6s %-22s %11s %9s %7s\n", "task",
              "context", "policy", "n", "accuracy", "95% CI", "read", "guard", "scored", "-/+",
              "vs first: delta [95%]", "prefill ms", "tpot ms", "bypass");
  bool any_degenerate = false;
  for (const CellResult& r : results) {
    char ci[32];
    std::snprintf(ci, sizeof(ci), "[%.3f, %.3f]", r.ci_low, r.ci_high);
    char paired[48], counts[16];
    std::snprintf(counts, sizeof(counts), "%lld/%lld", static_cast<long long>(r.lost),
                  static_cast<long long>(r.gained));
    std::snprintf(paired, sizeof(paired), "%+.3f [%+.3f, %+.3f]", r.delta, r.delta_low,
                  r.delta_high);
    // A degenerate (context, budget) point reads no middle row (sinks + window cover the
    // budget): its loss is the budget's, not the policy's. `!`: every sample, `~`: some.
    const char* mark = r.degenerate == 0 ? "" : r.degenerate == r.samples ? " !" : " ~";
    any_degenerate = any_degenerate || r.degenerate > 0;
    const std::string policy = r.policy + mark;
    std::printf(
        "%-16s %8lld  %-24s %5lld  %8.3f  %-16s %7.4f %7.4f %7.4f %6s %-22s %11.1f %9.2f %7.3f\n",
        r.task.c_str(), static_cast<long long>(r.context), policy.c_str(),
        static_cast<long long>(r.samples), r.accuracy, ci, r.budget_spent, r.guard_read, r.scored,
        counts, paired, r.prefill_ms, r.tpot_ms, r.bypassed);
  }
  std::printf("read: rows attended / context rows; guard: rows the error guard's exact checks "
              "read besides (the budget spent is their sum); scored: K rows read only to score "
              "(rescoring, exact scans) / context rows\n");
  for (const CellResult& r : results) {
    if (r.guard_checks == 0) continue;
    std::printf("guard %s %lld %s: %lld checks, e_h p50 %.4f p90 %.4f, %lld escalations\n",
                r.task.c_str(), static_cast<long long>(r.context), r.policy.c_str(),
                static_cast<long long>(r.guard_checks), r.guard_error_p50, r.guard_error_p90,
                static_cast<long long>(r.guard_escalations));
  }
  if (any_degenerate) {
    std::printf("! degenerate point: the budget is at or below sinks + window, no middle row is "
                "read by any policy (~: for some samples); not a policy loss\n");
  }
}

// The step executor `--device` names (null for cpu: the CPU engine decodes).
absl::StatusOr<std::unique_ptr<decode::StepExecutor>> MakeExecutor(
    const std::string& device, const model::Model* model, const kernels::cpu::CpuPool* pool) {
  if (device == "cpu") return std::unique_ptr<decode::StepExecutor>();
  if (device == "host-hybrid") return NewHostHybridEvalExecutor(model, pool);
#ifdef FLUXION_HAVE_CUDA
  return NewCudaHybridEvalExecutor(model, pool);
#else
  return absl::FailedPreconditionError(
      "this binary was built without CUDA; use --device cpu or host-hybrid");
#endif
}

// What a sample's decode attended, for the per-sample records.
std::string AttentionOf(const std::string& policy, const std::string& device) {
  if (policy == "full") return FullPolicyAttention(device);
  return "sparse policy over bf16 host pages";
}

// A sample's outcome as `--json` records it under "samples": what `fluxion eval compare` reads.
nlohmann::json SampleJson(const SampleOutcome& o, const PolicyOutcome& p,
                          const std::string& device) {
  int64_t min_step = -1;
  for (size_t i = 0; i < p.margins.size(); ++i) {
    if (min_step < 0 || p.margins[i] < p.margins[min_step]) min_step = static_cast<int64_t>(i);
  }
  return {{"task", o.sample.task},
          {"context", o.sample.context},
          {"seed", o.sample.seed},
          {"policy", p.policy},
          {"device", device},
          {"attention", AttentionOf(p.policy, device)},
          // Escaped: generated bytes need not be UTF-8 (the exact output is in "tokens").
          {"expected", Printable(o.sample.answer)},
          {"answer", Printable(p.answer)},
          {"correct", p.correct},
          {"decode_steps", p.decode_steps},
          {"tokens", p.tokens},
          {"margins", p.margins},
          {"top_logits", p.top_logits},
          {"min_margin", min_step >= 0 ? nlohmann::json(p.margins[min_step]) : nullptr},
          {"min_margin_step", min_step}};
}

void PrintSample(const SampleOutcome& o) {
  const TaskSample& s = o.sample;
  std::printf("--- %s %lld seed %llu: %zu prompt tokens, prefill %.1f ms\n", s.task.c_str(),
              static_cast<long long>(s.context), static_cast<unsigned long long>(s.seed),
              s.prompt_ids.size(), o.prefill_seconds * 1e3);
  std::printf("  question : %s\n", Printable(Tail(s.query, 160)).c_str());
  std::printf("  expected : %s\n", Printable(s.answer).c_str());
  for (const PolicyOutcome& p : o.policies) {
    std::printf("  %-9s: %s   [%s]\n", p.policy.c_str(), Printable(p.answer).c_str(),
                p.correct ? "ok" : "WRONG");
  }
  std::fflush(stdout);
}

// Every flag of `fluxion eval tasks`. The two flag objects register at their place in --help's
// order, hence optional.
struct EvalTasksFlags {
  std::string model_dir, json_path, capture_dir, predictor_flag, record_profile;
  std::string device = "cpu";
  std::vector<std::string> tasks = TaskNames();
  std::vector<std::string> policies = {"full"};
  std::vector<std::string> selectors = {"host"};
  std::vector<double> budgets = {0.05};
  std::vector<int64_t> contexts = {1024, 4096};
  int64_t samples = 8, seed = static_cast<int64_t>(kFirstEvalSeed), max_new_tokens = 0,
          capture_kv_max = 8192;
  bool show = false, calibration = false;
  std::optional<CpuThreadsFlag> cpu_threads;
  std::optional<decode::sparse::GuardFlags> guard_flags;
};

void RegisterEvalTasksFlags(FlagSet& flags, EvalTasksFlags& f) {
  flags.String("model", &f.model_dir, "model directory (config.json + safetensors)");
  flags.StringList("tasks", &f.tasks, "tasks to run");
  flags.IntList("contexts", &f.contexts,
                "prompt lengths in the model's tokens (each prompt is 0.9-1.0 of it; a model with a "
                "tokenizer.json reads the task text through it)");
  flags.Int("samples", &f.samples, "samples per task and context");
  flags.Int("seed", &f.seed, "seed of the first sample (sample i uses seed + i); >= 1000000");
  flags.StringList("policy", &f.policies,
                   "decode attention policies: " + decode::sparse::PolicyNamesHelp());
  flags.DoubleList("budget", &f.budgets,
                   "read budgets (fraction of context rows) for each sparse policy");
  f.cpu_threads.emplace(flags, CpuRole::kOffline);
  flags.String("device", &f.device,
               "where the decode steps run: cpu (the CPU engine, Model::Forward per token), cuda "
               "(the hybrid executor: dense halves and the sinks + window on the GPU, the rest of "
               "each policy's plan on the CPU; one request per step), host-hybrid (the same "
               "executor over its host stand-in). The prefill runs on the CPU in every case; "
               "`full` off the cpu device is the `full` sparse policy over bf16 host pages");
  flags.Int("max-new-tokens", &f.max_new_tokens,
            "tokens to generate at most; 0 = len(answer) + 16 as TASKS.md scores");
  flags.String("json", &f.json_path,
               "also write results to this file (docs/BENCHMARKS.md format)");
  flags.String("fluxion-predictor", &f.predictor_flag,
               "head-property predictor for the `fluxion` policy (JSON from "
               "`fluxion calibrate`); default: <model>/fluxion_predictor.json if "
               "present (required when --policy lists fluxion); `none`: fluxion runs its "
               "rule-based per-head budgets (what `fluxion_rules` always uses)");
  flags.Bool("calibration", &f.calibration,
             absl::StrCat("use calibration seeds (", kFirstCalibrationSeed, "-",
                          kFirstCalibrationSeed + kCalibrationSeeds - 1,
                          ", docs/TASKS.md) instead of evaluation seeds: for fitting offline "
                          "predictors, never for reported accuracy"));
  flags.Bool("show", &f.show, "print each sample's question tail, expected and generated answers");
  flags.String("capture-dir", &f.capture_dir,
               "write queries, K/V and attention statistics of every sample here (.npy + "
               "index.json) for sparse-policy calibration");
  flags.Int("capture-kv-max", &f.capture_kv_max,
            "with --capture-dir: write prompt K/V only for prompts up to this many tokens");
  flags.String("record-profile", &f.record_profile,
               "write the decision profile of what lfps / fluxion decided over the run (shares of "
               "streaming and bypassed head-steps, per-head budgets and blocks) to this JSON file, "
               "for `fluxion bench decode --profile` (docs/SPARSE.md, \"Decision profiles\")");
  f.guard_flags.emplace(flags, /*allow_both=*/true);
  flags.StringList("selector", &f.selectors,
                   "where exact_topk, lfps and fluxion choose their rows: host (the policy's own "
                   "selection) and/or device (the top-k of int8 compact keys, what the hybrid "
                   "step's GPU picks; computed bit for bit on the CPU here; labels get +device); "
                   "with both, each is a row (docs/SPARSE.md, \"Device selection\")");
}

// --guard on / both: every lfps / fluxion label also (or only) under the guard.
std::vector<std::string> WithGuardModes(const std::vector<std::string>& labels,
                                        const std::vector<bool>& modes) {
  std::vector<std::string> out;
  for (const std::string& label : labels) {
    auto config = PolicyConfigOf(label);
    if (!config.ok() || !decode::sparse::TraitsOf(config->kind).guardable ||
        config->guard.enabled) {
      out.push_back(label);
      continue;
    }
    for (bool on : modes) out.push_back(on ? label + "+guard" : label);
  }
  return out;
}

// --selector: each label of a kind that selects on the device once per selector.
absl::StatusOr<std::vector<std::string>> WithSelectors(const std::vector<std::string>& labels,
                                                       const std::vector<std::string>& selectors) {
  std::vector<std::string> out;
  for (const std::string& label : labels) {
    auto config = PolicyConfigOf(label);
    bool any = false;
    for (const std::string& name : selectors) {
      FLUXION_ASSIGN_OR_RETURN(decode::sparse::Selector s, decode::sparse::ParseSelector(name));
      const bool device = s == decode::sparse::Selector::kDevice;
      if (device && (!config.ok() || !decode::sparse::TraitsOf(config->kind).device_selects)) {
        continue;
      }
      out.push_back(device ? label + "+device" : label);
      any = true;
    }
    if (!any) out.push_back(label);
  }
  return out;
}

// The usage errors (exit 2) found before the model is loaded, the first one.
absl::Status CheckUsage(const EvalTasksFlags& f, const TaskEvalOptions& options) {
  const int64_t seed = f.seed, samples = f.samples;
  std::string usage_error;
  if (f.calibration && (!IsCalibrationSeed(static_cast<uint64_t>(seed)) ||
                        !IsCalibrationSeed(static_cast<uint64_t>(seed + samples - 1)))) {
    usage_error = absl::StrCat("--calibration: seeds ", seed, "-", seed + samples - 1,
                               " leave the calibration range ", kFirstCalibrationSeed, "-",
                               kFirstCalibrationSeed + kCalibrationSeeds - 1, " (docs/TASKS.md)");
  } else if (!f.calibration && seed < static_cast<int64_t>(kFirstEvalSeed)) {
    usage_error = absl::StrCat("--seed ", seed, " is not an evaluation seed; evaluation seeds ",
                               "are >= ", kFirstEvalSeed, " (calibration runs: --calibration; ",
                               "docs/TASKS.md)");
  } else if (samples < 1) {
    usage_error = "--samples must be >= 1";
  } else if (f.max_new_tokens < 0) {
    usage_error = "--max-new-tokens must be >= 0";
  } else if (f.tasks.empty() || f.contexts.empty() || f.policies.empty()) {
    usage_error = "--tasks, --contexts and --policy need at least one value each";
  } else if (f.device != "cpu" && f.device != "cuda" && f.device != "host-hybrid") {
    usage_error = absl::StrCat("--device must be cpu, cuda or host-hybrid, not '", f.device, "'");
  } else if (f.device != "cpu" && !f.capture_dir.empty()) {
    usage_error = "--capture-dir records the CPU engine's decode: use it with --device cpu";
  }
  for (const std::string& p : options.policies) {
    if (absl::Status s = ValidatePolicy(p); usage_error.empty() && !s.ok()) {
      usage_error = absl::StrCat("--policy: ", s.message());
    }
  }
  for (const std::string& task : f.tasks) {
    for (int64_t context : f.contexts) {
      absl::Status s = MakeTaskSample(task, context, options.first_seed).status();
      if (usage_error.empty() && !s.ok()) usage_error = std::string(s.message());
    }
  }
  const bool records_anything = absl::c_any_of(options.policies, [](const std::string& p) {
    auto config = PolicyConfigOf(p);
    return config.ok() && decode::sparse::RecordedInProfiles(*config);
  });
  if (usage_error.empty() && !f.record_profile.empty() && !records_anything) {
    usage_error = "--record-profile records lfps and fluxion: add one of them to --policy";
  }
  if (!usage_error.empty()) return absl::InvalidArgumentError(usage_error);
  return absl::OkStatus();
}

// The run's options from the flags (the engine's parts, filled by PrepareEngine, aside);
// InvalidArgument for a usage error.
absl::StatusOr<TaskEvalOptions> MakeOptions(const EvalTasksFlags& f,
                                            const decode::sparse::GuardFlags::Parsed& guard) {
  TaskEvalOptions options;
  options.tasks = f.tasks;
  options.contexts = f.contexts;
  options.samples = f.samples;
  options.first_seed = static_cast<uint64_t>(f.seed);
  options.guard = guard.config;
  options.policies = WithGuardModes(PolicyLabels(f.policies, f.budgets), guard.modes);
  FLUXION_ASSIGN_OR_RETURN(options.policies, WithSelectors(options.policies, f.selectors));
  options.max_new_tokens = f.max_new_tokens;
  options.capture_dir = f.capture_dir;
  options.capture_kv_max = f.capture_kv_max;
  options.model_name = f.model_dir;
  FLUXION_RETURN_IF_ERROR(CheckUsage(f, options));
  return options;
}

// The model, the step executor --device names and the fluxion predictor, into `options`.
// `executor` and `model` must outlive the run.
absl::Status PrepareEngine(const EvalTasksFlags& f, const kernels::cpu::CpuPool& pool,
                           std::unique_ptr<model::Model>* model,
                           std::unique_ptr<decode::StepExecutor>* executor,
                           TaskEvalOptions* options) {
  const bool runs_fluxion = absl::c_any_of(options->policies, [](const std::string& p) {
    auto config = PolicyConfigOf(p);
    return config.ok() && decode::sparse::TraitsOf(config->kind).uses_predictor;
  });
  FLUXION_ASSIGN_OR_RETURN(
      options->fluxion_predictor,
      runs_fluxion ? decode::sparse::RequirePredictor(f.predictor_flag, f.model_dir)
                   : decode::sparse::ResolvePredictor(f.predictor_flag, f.model_dir));
  std::cerr << "fluxion policy: "
            << (options->fluxion_predictor ? "trained head-property predictor"
                                           : "rule-based fallback")
            << "\n";
  auto loaded = model::Model::Load(f.model_dir);
  if (!loaded.ok()) {
    return absl::Status(loaded.status().code(), absl::StrCat("cannot load model from ",
                                                             f.model_dir, ": ",
                                                             loaded.status().ToString()));
  }
  *model = std::move(*loaded);
  const model::ModelConfig& config = (*model)->config();
  FLUXION_ASSIGN_OR_RETURN(options->codec,
                           TaskCodec::ForModel(f.model_dir, config.bos_token_id,
                                               config.eos_token_ids));
  absl::StatusOr<std::unique_ptr<decode::StepExecutor>> made =
      MakeExecutor(f.device, model->get(), &pool);
  if (!made.ok()) {
    return absl::Status(made.status().code(), absl::StrCat("--device ", f.device, ": ",
                                                           made.status().message()));
  }
  *executor = std::move(*made);
  options->executor = executor->get();
  options->output_projection =
      std::make_shared<const model::OutputProjection>((*model)->output_projection());
  if (f.device != "cpu") {
    std::cerr << "device " << f.device << ": decode steps through the hybrid executor, one "
              << "request per step; `full` is the " << FullPolicyAttention(f.device) << "\n";
  }
  return absl::OkStatus();
}

// Progress on stderr (one rewritten line on a terminal, a line per sample otherwise: logs),
// --show's samples on stdout, each sample's --json records into `sample_rows` and its decisions
// into `recorder`. Both must outlive the run.
TaskEvalCallbacks MakeCallbacks(const EvalTasksFlags& f, bool tty,
                                decode::sparse::DecisionRecorder* recorder,
                                nlohmann::json* sample_rows) {
  TaskEvalCallbacks callbacks;
  callbacks.on_sample_start = [tty](int64_t index, int64_t total, const std::string& task,
                                    int64_t context) {
    if (tty) {
      std::fprintf(stderr, "\r\033[K[%lld/%lld] %s %lld ...", static_cast<long long>(index + 1),
                   static_cast<long long>(total), task.c_str(), static_cast<long long>(context));
      std::fflush(stderr);
    }
  };
  callbacks.on_sample_done = [tty, show = f.show, device = f.device, recorder,
                              sample_rows](const SampleOutcome& o) {
    for (const PolicyOutcome& p : o.policies) {
      sample_rows->push_back(SampleJson(o, p, device));
      // Labels were validated before the run.
      if (auto config = PolicyConfigOf(p.policy); config.ok()) recorder->Add(*config, p.selection);
    }
    if (tty) {
      std::fprintf(stderr, "\r\033[K");
    } else {
      std::string verdicts;
      for (const PolicyOutcome& p : o.policies) {
        absl::StrAppend(&verdicts, " ", p.policy, "=", p.correct ? "ok" : "wrong");
      }
      std::fprintf(stderr, "[%lld/%lld] %s %lld seed %llu:%s (prefill %.0f ms)\n",
                   static_cast<long long>(o.index + 1), static_cast<long long>(o.total),
                   o.sample.task.c_str(), static_cast<long long>(o.sample.context),
                   static_cast<unsigned long long>(o.sample.seed), verdicts.c_str(),
                   o.prefill_seconds * 1e3);
    }
    std::fflush(stderr);
    if (show) PrintSample(o);
  };
  return callbacks;
}

// --record-profile: what lfps / fluxion decided over the run, as a decision profile file.
absl::Status WriteProfile(const EvalTasksFlags& f, const decode::sparse::DecisionRecorder& recorder,
                          bool predictor, const std::vector<std::string>& args) {
  const nlohmann::json source = {{"command", bench::JoinCommand("fluxion eval tasks", args)},
                                 {"model", f.model_dir},
                                 {"tasks", f.tasks},
                                 {"contexts", f.contexts},
                                 {"samples", f.samples},
                                 {"seed", f.seed},
                                 {"fluxion_predictor", predictor}};
  FLUXION_ASSIGN_OR_RETURN(
      decode::sparse::DecisionProfile profile,
      recorder.Build(std::filesystem::path(f.record_profile).stem().string(), source.dump()));
  std::ofstream out(f.record_profile, std::ios::trunc);
  out << profile.Serialize();
  out.close();
  if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", f.record_profile));
  std::cerr << "wrote decision profile " << f.record_profile << "\n";
  return absl::OkStatus();
}

// --json: one row per cell, the guard's settings and every sample's records.
absl::Status WriteResultsJson(const EvalTasksFlags& f, const std::vector<CellResult>& results,
                              const decode::sparse::GuardFlags::Parsed& guard, bool predictor,
                              nlohmann::json sample_rows, const std::vector<std::string>& args) {
  nlohmann::json rows = nlohmann::json::array();
  for (const CellResult& r : results) {
    rows.push_back({{"task", r.task},
                    {"context", r.context},
                    {"policy", r.policy},
                    {"device", f.device},
                    {"samples", r.samples},
                    {"correct", r.correct},
                    {"accuracy", r.accuracy},
                    {"ci_low", r.ci_low},
                    {"ci_high", r.ci_high},
                    {"prefill_ms", r.prefill_ms},
                    {"tpot_ms", r.tpot_ms},
                    {"budget_spent", r.budget_spent},
                    {"bypassed", r.bypassed},
                    {"guard_read", r.guard_read},
                    {"scored", r.scored},
                    {"guard_escalations", r.guard_escalations},
                    {"guard_checks", r.guard_checks},
                    {"guard_error_p50", r.guard_error_p50},
                    {"guard_error_p90", r.guard_error_p90},
                    {"degenerate_samples", r.degenerate},
                    {"paired_lost", r.lost},
                    {"paired_gained", r.gained},
                    {"delta_vs_first", r.delta},
                    {"delta_ci_low", r.delta_low},
                    {"delta_ci_high", r.delta_high},
                    {"threads", kernels::cpu::NumThreads()},
                    {"seed", f.seed},
                    {"calibration", f.calibration},
                    {"fluxion_predictor", predictor},
                    {"model", f.model_dir}});
  }
  nlohmann::json doc = bench::ResultEnvelope(bench::JoinCommand("fluxion eval tasks", args),
                                             nlohmann::json::object(), rows);
  doc["device"] = f.device;
  const decode::sparse::GuardConfig& g = guard.config;
  doc["guard"] = {{"modes", guard.modes},        {"sample_rate", g.sample_rate},
                  {"tolerance", g.tolerance},    {"relax_ratio", g.relax_ratio},
                  {"grow", g.grow},              {"shrink", g.shrink},
                  {"max_weight", g.max_weight}};
  doc["samples"] = std::move(sample_rows);
  FLUXION_RETURN_IF_ERROR(bench::WriteJson(f.json_path, doc));
  std::cerr << "wrote " << f.json_path << "\n";
  return absl::OkStatus();
}

int Fail(const absl::Status& s) {
  std::cerr << "error: " << s.message() << "\n";
  return 1;
}

// Loads the model, runs every sample, prints the table and writes --record-profile and --json.
int RunEvalTasks(const EvalTasksFlags& f, TaskEvalOptions options,
                 const decode::sparse::GuardFlags::Parsed& guard,
                 const kernels::cpu::CpuPool& pool, const std::vector<std::string>& args) {
  std::unique_ptr<model::Model> model;
  std::unique_ptr<decode::StepExecutor> executor;
  if (absl::Status s = PrepareEngine(f, pool, &model, &executor, &options); !s.ok()) {
    return Fail(s);
  }
  const bool predictor = options.fluxion_predictor != nullptr;
  const bool tty = isatty(STDERR_FILENO) == 1;
  decode::sparse::DecisionRecorder recorder;
  nlohmann::json sample_rows = nlohmann::json::array();
  auto results = RunTaskEval(*model, options, MakeCallbacks(f, tty, &recorder, &sample_rows));
  if (tty) std::fprintf(stderr, "\r\033[K");
  if (!results.ok()) {
    std::cerr << "error: " << results.status() << "\n";
    return 1;
  }
  PrintTable(*results);
  if (!f.record_profile.empty()) {
    if (absl::Status s = WriteProfile(f, recorder, predictor, args); !s.ok()) return Fail(s);
  }
  if (!f.json_path.empty()) {
    if (absl::Status s =
            WriteResultsJson(f, *results, guard, predictor, std::move(sample_rows), args);
        !s.ok()) {
      return Fail(s);
    }
  }
  return 0;
}

}  // namespace

int RunEvalCommand(const std::vector<std::string>& args) {
  const char* usage =
      "usage: fluxion eval <what> [flags]   (fluxion eval <what> --help)\n"
      "  tasks      accuracy on the long-context tasks of docs/TASKS.md per context and attention "
      "policy\n"
      "  compare    two `eval tasks --json` runs (e.g. --device cpu vs cuda) sample by sample\n"
      "  attention  sparse policies vs full attention on structured synthetic heads\n";
  if (args.empty() || args[0] == "--help") {
    std::cout << usage;
    return args.empty() ? 2 : 0;
  }
  std::vector<std::string> rest(args.begin() + 1, args.end());
  if (args[0] == "tasks") return RunEvalTasksCommand(rest);
  if (args[0] == "compare") return RunEvalCompareCommand(rest);
  if (args[0] == "attention") return bench::RunAttentionEval(rest);
  std::cerr << "fluxion eval: unknown evaluation '" << args[0] << "'\n" << usage;
  return 2;
}

int RunEvalTasksCommand(const std::vector<std::string>& args) {
  EvalTasksFlags f;
  FlagSet flags("fluxion eval tasks",
                "Runs the long-context tasks of docs/TASKS.md: one full-attention prefill per "
                "sample on the CPU engine, a greedy decode per attention policy (on the --device), "
                "exact-match accuracy with 95% Wilson intervals.");
  RegisterEvalTasksFlags(flags, f);
  flags.Require("model");
  const bool seed_given = absl::c_any_of(
      args, [](const std::string& a) { return absl::StartsWith(a, "--seed"); });
  if (int rc = ParseFlagsOrExit(flags, args); rc >= 0) return rc;
  // The pool lives for the run: the hybrid executor's host part runs on it.
  absl::StatusOr<kernels::cpu::CpuPool> pool = kernels::cpu::SetUpProcessCpu(*f.cpu_threads);
  if (!pool.ok()) {
    std::cerr << "error: " << pool.status().message() << "\n";
    return 2;
  }
  if (f.calibration && !seed_given) f.seed = static_cast<int64_t>(kFirstCalibrationSeed);
  const absl::StatusOr<decode::sparse::GuardFlags::Parsed> guard = f.guard_flags->Read();
  if (!guard.ok()) {
    std::cerr << "error: " << guard.status().message() << "\n";
    return 2;
  }
  absl::StatusOr<TaskEvalOptions> options = MakeOptions(f, *guard);
  if (!options.ok()) {
    std::cerr << "error: " << options.status().message() << "\n";
    return 2;
  }
  return RunEvalTasks(f, *std::move(options), *guard, *pool, args);
}

}  // namespace fluxion::eval

#include "bench/eval/calibrate_command.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>

#include "absl/strings/str_cat.h"
#include "bench/bench_util.h"
#include "bench/captured_attention_eval.h"
#include "bench/eval/predictor_fit.h"
#include "bench/eval/task_eval.h"
#include "bench/eval/tasks.h"
#include "common/cpu_threads.h"
#include "common/flag_set.h"
#include "common/status_macros.h"
#include "decode/sparse/fluxion_predictor.h"
#include "kernels/cpu/process_cpu.h"
#include "model/model.h"

namespace fluxion::eval {
namespace {

struct CalibrateFlags {
  std::string model_dir, out, work_dir, json_path;
  std::vector<std::string> tasks = TaskNames();
  // 4096 is the shortest context at which the 0.02 tier leaves middle rows (sinks + window
  // cover ~3.5K at 0.02), which the tier classifier needs; 1024 and 2048 add streaming evidence.
  std::vector<int64_t> contexts = {1024, 2048, 4096};
  int64_t samples = 5, folds = 5;
  double tau = 0.02;
  std::optional<CpuThreadsFlag> cpu_threads;
};

void RegisterFlags(FlagSet& flags, CalibrateFlags& f) {
  flags.String("model", &f.model_dir,
               "model directory (config.json + safetensors, tokenizer.json unless it is one of "
               "our byte-level models)");
  flags.String("out", &f.out, "predictor file to write (default: <model>/fluxion_predictor.json)");
  flags.StringList("tasks", &f.tasks, "calibration tasks (docs/TASKS.md)");
  flags.IntList("contexts", &f.contexts,
                "calibration prompt lengths in the model's tokens; at least one >= 4096 for the "
                "budget-tier classifier");
  flags.Int("samples", &f.samples,
            absl::StrCat("prompts per task and context, at calibration seeds ",
                         kFirstCalibrationSeed, "+ (never an evaluation seed)"));
  flags.Double("tau", &f.tau, "a head's output-error tolerance e_h(b) <= tau");
  flags.Int("folds", &f.folds, "cross-validation folds over prompts");
  flags.String("work-dir", &f.work_dir,
               "keep the capture and the head table (heads.csv) here; default: a temporary "
               "folder, removed at the end");
  flags.String("json", &f.json_path, "also write the fit's validation to this file");
  f.cpu_threads.emplace(flags, CpuRole::kOffline);
}

absl::Status CheckUsage(const CalibrateFlags& f) {
  if (f.samples < 1 || f.samples > static_cast<int64_t>(kCalibrationSeeds)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--samples must be in [1, ", kCalibrationSeeds, "]"));
  }
  if (f.folds < 2) return absl::InvalidArgumentError("--folds must be >= 2");
  if (!(f.tau > 0 && f.tau < 1)) return absl::InvalidArgumentError("--tau must be in (0, 1)");
  if (f.tasks.empty() || f.contexts.empty()) {
    return absl::InvalidArgumentError("--tasks and --contexts need at least one value each");
  }
  for (const std::string& task : f.tasks) {
    for (int64_t context : f.contexts) {
      FLUXION_RETURN_IF_ERROR(MakeTaskSample(task, context, kFirstCalibrationSeed).status());
    }
  }
  return absl::OkStatus();
}

// The work folder and whether it is ours to remove.
struct WorkDir {
  std::string path;
  bool temporary = false;
  ~WorkDir() {
    std::error_code ignored;
    if (temporary) std::filesystem::remove_all(path, ignored);
  }
};

absl::Status MakeWorkDir(const std::string& flag, WorkDir* dir) {
  std::error_code ec;
  if (!flag.empty()) {
    dir->path = flag;
    std::filesystem::create_directories(flag, ec);
    if (ec) return absl::InternalError(absl::StrCat("cannot create ", flag, ": ", ec.message()));
    return absl::OkStatus();
  }
  std::string pattern = (std::filesystem::temp_directory_path(ec) / "fluxion-calibrate-XXXXXX");
  if (mkdtemp(pattern.data()) == nullptr) {
    return absl::InternalError("cannot create a temporary folder (pass --work-dir)");
  }
  dir->path = pattern;
  dir->temporary = true;
  return absl::OkStatus();
}

// Stage 1: the calibration prompts with full attention, captured into `capture_dir`.
absl::Status CaptureCalibrationRuns(const CalibrateFlags& f, const model::Model& model,
                                    const std::string& capture_dir) {
  TaskEvalOptions options;
  options.tasks = f.tasks;
  options.contexts = f.contexts;
  options.samples = f.samples;
  options.first_seed = kFirstCalibrationSeed;
  options.policies = {"full"};
  options.capture_dir = capture_dir;
  options.capture_kv_max = *std::max_element(f.contexts.begin(), f.contexts.end());
  options.model_name = f.model_dir;
  FLUXION_ASSIGN_OR_RETURN(options.codec,
                           TaskCodec::ForModel(f.model_dir, model.config().bos_token_id,
                                               model.config().eos_token_ids));
  TaskEvalCallbacks callbacks;
  callbacks.on_sample_done = [](const SampleOutcome& o) {
    std::fprintf(stderr, "[%lld/%lld] captured %s %lld seed %llu (prefill %.0f ms, %lld steps)\n",
                 static_cast<long long>(o.index + 1), static_cast<long long>(o.total),
                 o.sample.task.c_str(), static_cast<long long>(o.sample.context),
                 static_cast<unsigned long long>(o.sample.seed), o.prefill_seconds * 1e3,
                 static_cast<long long>(o.policies.at(0).decode_steps));
  };
  return RunTaskEval(model, options, callbacks).status();
}

void PrintValidation(const nlohmann::json& doc, const std::string& out) {
  const nlohmann::json& s = doc["validation"]["streaming"];
  const nlohmann::json& t = doc["validation"]["tier"];
  std::printf("%-28s %8s %9s %9s %9s\n", "classifier (cross-validated)", "heads", "accuracy",
              "balanced", "majority");
  std::printf("%-28s %8lld %9.3f %9.3f %9.3f\n", "streaming head",
              s["n"].get<long long>(), s["accuracy"].get<double>(),
              s["balanced_accuracy"].get<double>(), s["majority_baseline"].get<double>());
  const nlohmann::json& r = s["rules_fallback"];
  std::printf("%-28s %8lld %9.3f %9.3f %9.3f\n", "  (rule-based fallback)", r["n"].get<long long>(),
              r["accuracy"].get<double>(), r["balanced_accuracy"].get<double>(),
              r["majority_baseline"].get<double>());
  if (t.contains("accuracy")) {
    std::printf("%-28s %8lld %9.3f %9.3f %9.3f\n", "budget tier 0.05 vs 0.02",
                t["n"].get<long long>(), t["accuracy"].get<double>(),
                t["balanced_accuracy"].get<double>(), t["majority_baseline"].get<double>());
  } else {
    std::printf("%-28s %8lld   %s\n", "budget tier 0.05 vs 0.02", t["n"].get<long long>(),
                t.value("note", std::string()).c_str());
  }
  std::printf("wrote %s\n", out.c_str());
}

absl::Status WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

absl::Status Calibrate(const CalibrateFlags& f, const std::vector<std::string>& args) {
  auto loaded = model::Model::Load(f.model_dir);
  if (!loaded.ok()) {
    return absl::Status(loaded.status().code(), absl::StrCat("cannot load model from ",
                                                             f.model_dir, ": ",
                                                             loaded.status().message()));
  }
  const model::Model& model = **loaded;
  const int64_t longest = *std::max_element(f.contexts.begin(), f.contexts.end());
  const int64_t limit = model.config().max_position_embeddings;
  if (limit > 0 && longest + 256 > limit) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--contexts: ", longest, " tokens plus an answer exceed the model's ", limit,
        " positions (max_position_embeddings)"));
  }
  WorkDir work;
  FLUXION_RETURN_IF_ERROR(MakeWorkDir(f.work_dir, &work));
  const std::string capture = work.path + "/capture", table = work.path + "/heads.csv";
  FLUXION_RETURN_IF_ERROR(CaptureCalibrationRuns(f, model, capture));
  FLUXION_RETURN_IF_ERROR(bench::EvalCapturedAttention(capture, f.model_dir, {}, table).status());
  FLUXION_ASSIGN_OR_RETURN(std::vector<CalibrationHead> heads, ReadHeadTable(table));
  FitOptions options;
  options.tau = f.tau;
  options.folds = static_cast<int>(f.folds);
  options.command = bench::JoinCommand("fluxion calibrate", args);
  FLUXION_ASSIGN_OR_RETURN(nlohmann::json doc, FitPredictor(heads, options));
  // What is written must be what the decode side accepts.
  FLUXION_RETURN_IF_ERROR(decode::sparse::FluxionPredictor::Parse(doc.dump()).status());
  const std::string out =
      f.out.empty() ? f.model_dir + "/" + decode::sparse::kPredictorFileName : f.out;
  FLUXION_RETURN_IF_ERROR(WriteFile(out, doc.dump(2) + "\n"));
  PrintValidation(doc, out);
  if (!f.json_path.empty()) {
    FLUXION_RETURN_IF_ERROR(bench::WriteJson(
        f.json_path, bench::ResultEnvelope(options.command, nlohmann::json::object(),
                                           nlohmann::json::array({doc["validation"]}))));
  }
  return absl::OkStatus();
}

}  // namespace

int RunCalibrateCommand(const std::vector<std::string>& args) {
  CalibrateFlags f;
  FlagSet flags(
      "fluxion calibrate",
      "Fits the head-property predictor the `fluxion` attention policy needs for a model and "
      "writes it beside the weights (fluxion_predictor.json): runs the calibration prompts of "
      "docs/TASKS.md through the model with full attention on the CPU, captures every decode "
      "step's queries and keys, measures per head the output error of sinks + window alone and "
      "of the 0.02 / 0.05 budgets, and fits and cross-validates the two classifiers "
      "(docs/CALIBRATE.md). Takes one prefill and a short greedy decode per prompt.");
  RegisterFlags(flags, f);
  flags.Require("model");
  if (int rc = ParseFlagsOrExit(flags, args); rc >= 0) return rc;
  if (absl::Status s = CheckUsage(f); !s.ok()) {
    std::cerr << "error: " << s.message() << "\n";
    return 2;
  }
  // The pool lives for the run: the engine's kernels run on it.
  const absl::StatusOr<kernels::cpu::CpuPool> pool = kernels::cpu::SetUpProcessCpu(*f.cpu_threads);
  if (!pool.ok()) {
    std::cerr << "error: " << pool.status().message() << "\n";
    return 2;
  }
  if (absl::Status s = Calibrate(f, args); !s.ok()) {
    std::cerr << "error: " << s.message() << "\n";
    return s.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  return 0;
}

}  // namespace fluxion::eval

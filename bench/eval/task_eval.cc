#include "bench/eval/task_eval.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <system_error>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "bench/eval/capturing_attention.h"
#include "bench/eval/npy.h"
#include "common/status_macros.h"
#include "decode/sparse/policy_util.h"
#include "decode/step/hybrid_step_executor.h"
#include "decode/step/resident_window.h"
#include "decode/step/sparse_attention.h"
#include "model/byte_tokenizer.h"
#include "model/cpu_dense_ops.h"
#include "model/generator.h"
#include "model/sampler.h"
#include "nlohmann/json.hpp"

namespace fluxion::eval {
namespace {

// Host page size for the sparse policies (DESIGN.md: 16 tokens of one layer and KV head).
constexpr int64_t kPageTokens = kEvalPageTokens;

using ::fluxion::model::ByteTokenizer;

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Capture layout, one folder per sample (`<task>_<context>_<seed>/`) beside `index.json`, which
// describes every file and is rewritten after each sample so an interrupted run stays readable:
//   prompt_ids.npy                 int64 [tokens]   the prompt's ids (BOS + bytes for byte models)
//   k_l{L}.npy, v_l{L}.npy         f32 [tokens][kv_heads][head_dim], post-RoPE K; only for prompts
//                                  of at most capture_kv_max tokens
//   prompt_positions.npy           int64 [rows]     the last capture_prompt_rows prompt positions
//   prompt_q_l{L}.npy              f32 [rows][heads][head_dim], post-RoPE
//   prompt_stats_l{L}.npy          f32 [rows][heads][3]: sink_mass, local_mass, entropy (nats)
//   {policy}_positions.npy, {policy}_q_l{L}.npy, {policy}_stats_l{L}.npy: the same for every
//                                  decode step of that policy's decode
//   {part}_k_l{L}.npy, {part}_v_l{L}.npy  f32 [rows][kv_heads][head_dim]: the captured rows' own
//                                  K/V, so a decode step can be replayed over exactly the keys it
//                                  saw
class CaptureWriter {
 public:
  CaptureWriter(const TaskEvalOptions& options, const model::AttentionShape& shape)
      : options_(options), shape_(shape) {
    CaptureOptions c;
    index_ = {
        {"format", "fluxion-eval-capture/v1"},
        {"model", options.model_name},
        {"shape",
         {{"num_layers", shape.num_layers},
          {"num_heads", shape.num_heads},
          {"num_kv_heads", shape.num_kv_heads},
          {"head_dim", shape.head_dim},
          {"scale", shape.scale}}},
        {"stats", std::vector<std::string>(kRowStatNames, kRowStatNames + kNumRowStats)},
        {"sink_tokens", c.sink_tokens},
        {"local_window", c.local_window},
        {"capture_kv_max", options.capture_kv_max},
        {"files",
         {{"prompt_ids", "int64 [tokens]: the prompt's ids (BOS + bytes for byte models)"},
          {"k_l{L}, v_l{L}", "float32 [tokens][num_kv_heads][head_dim], K post-RoPE"},
          {"{part}_positions", "int64 [rows]"},
          {"{part}_q_l{L}", "float32 [rows][num_heads][head_dim], post-RoPE"},
          {"{part}_stats_l{L}", "float32 [rows][num_heads][stats], over full attention"},
          {"{part}_k_l{L}, {part}_v_l{L}",
           "float32 [rows][num_kv_heads][head_dim], the captured rows' own K (post-RoPE) and V"}}},
        {"samples", nlohmann::json::array()},
    };
  }

  absl::Status BeginSample(const TaskSample& sample, const model::DenseAttention& prefilled,
                           const CapturingAttention& prompt_rows) {
    const std::string name = absl::StrCat(sample.task, "_", sample.context, "_", sample.seed);
    dir_ = options_.capture_dir + "/" + name;
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir_, ": ", ec.message()));
    const int64_t tokens = sample.prompt_ids.size();
    std::vector<int64_t> ids(sample.prompt_ids.begin(), sample.prompt_ids.end());
    FLUXION_RETURN_IF_ERROR(WriteNpy(dir_ + "/prompt_ids.npy", {tokens}, ids));
    const bool kv = tokens <= options_.capture_kv_max;
    if (kv) {
      const int64_t row = shape_.num_kv_heads * shape_.head_dim;
      for (int l = 0; l < shape_.num_layers; ++l) {
        const std::vector<int64_t> dims = {prefilled.length(l), shape_.num_kv_heads,
                                           shape_.head_dim};
        FLUXION_RETURN_IF_ERROR(
            WriteNpy(absl::StrCat(dir_, "/k_l", l, ".npy"), dims,
                     absl::MakeConstSpan(prefilled.keys(l), prefilled.length(l) * row)));
        FLUXION_RETURN_IF_ERROR(
            WriteNpy(absl::StrCat(dir_, "/v_l", l, ".npy"), dims,
                     absl::MakeConstSpan(prefilled.values(l), prefilled.length(l) * row)));
      }
    }
    FLUXION_ASSIGN_OR_RETURN(int64_t rows, WriteRows("prompt", prompt_rows));
    sample_ = {{"dir", name},
               {"task", sample.task},
               {"context", sample.context},
               {"seed", sample.seed},
               {"prompt_tokens", tokens},
               {"answer", sample.answer},
               {"kv", kv},
               {"prompt_rows", rows},
               {"policies", nlohmann::json::object()}};
    return absl::OkStatus();
  }

  absl::Status AddPolicy(const PolicyOutcome& outcome, const CapturingAttention& decode_rows) {
    FLUXION_ASSIGN_OR_RETURN(int64_t rows, WriteRows(outcome.policy, decode_rows));
    sample_["policies"][outcome.policy] = {{"generated", outcome.answer},
                                           {"tokens", outcome.tokens},
                                           {"correct", outcome.correct},
                                           {"rows", rows}};
    return absl::OkStatus();
  }

  absl::Status EndSample() {
    index_["samples"].push_back(std::move(sample_));
    const std::string path = options_.capture_dir + "/index.json";
    std::ofstream out(path, std::ios::trunc);
    // Generated text can be any bytes; `replace` keeps dump() from throwing on invalid UTF-8 (the
    // exact output is in "tokens").
    out << index_.dump(1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    out.close();
    if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
    return absl::OkStatus();
  }

 private:
  absl::StatusOr<int64_t> WriteRows(const std::string& part, const CapturingAttention& capture) {
    const int64_t rows = capture.rows(0).positions.size();
    FLUXION_RETURN_IF_ERROR(WriteNpy(absl::StrCat(dir_, "/", part, "_positions.npy"), {rows},
                                     capture.rows(0).positions));
    for (int l = 0; l < shape_.num_layers; ++l) {
      const CapturedRows& r = capture.rows(l);
      FLUXION_RETURN_IF_ERROR(WriteNpy(absl::StrCat(dir_, "/", part, "_q_l", l, ".npy"),
                                       {rows, shape_.num_heads, shape_.head_dim}, r.q));
      FLUXION_RETURN_IF_ERROR(WriteNpy(absl::StrCat(dir_, "/", part, "_stats_l", l, ".npy"),
                                       {rows, shape_.num_heads, int64_t{kNumRowStats}}, r.stats));
      FLUXION_RETURN_IF_ERROR(WriteNpy(absl::StrCat(dir_, "/", part, "_k_l", l, ".npy"),
                                       {rows, shape_.num_kv_heads, shape_.head_dim}, r.k));
      FLUXION_RETURN_IF_ERROR(WriteNpy(absl::StrCat(dir_, "/", part, "_v_l", l, ".npy"),
                                       {rows, shape_.num_kv_heads, shape_.head_dim}, r.v));
    }
    return rows;
  }

  const TaskEvalOptions& options_;
  model::AttentionShape shape_;
  nlohmann::json index_;
  nlohmann::json sample_;
  std::string dir_;
};

struct CellTotals {
  int64_t samples = 0, correct = 0, decode_steps = 0, lost = 0, gained = 0;
  double prefill_seconds = 0, decode_seconds = 0, attended_fraction = 0, bypassed_fraction = 0;
  double guard_fraction = 0, scored_fraction = 0;
  int64_t guard_escalations = 0, guard_checks = 0, degenerate = 0;
  std::vector<double> guard_errors;
};

// The q-quantile (nearest rank) of `v`, 0 when empty; sorts v.
double Quantile(std::vector<double>* v, double q) {
  if (v->empty()) return 0.0;
  std::sort(v->begin(), v->end());
  const size_t i = std::min(v->size() - 1, static_cast<size_t>(q * v->size()));
  return (*v)[i];
}

// Splits `name@budget`; `full` and fixed_* need no budget.
absl::StatusOr<decode::sparse::PolicyConfig> ParseLabel(const std::string& full_label) {
  // `+guard`: the online error guard (PolicyLabel's suffix).
  absl::string_view label = full_label;
  if (absl::ConsumeSuffix(&label, "+device")) {
    FLUXION_ASSIGN_OR_RETURN(decode::sparse::PolicyConfig c, ParseLabel(std::string(label)));
    if (!decode::sparse::TraitsOf(c.kind).device_selects) {
      return absl::InvalidArgumentError(absl::StrCat("attention policy '", full_label,
                                                     "': device selection applies to "
                                                     "exact_topk, fluxion and fluxion_rules only"));
    }
    c.selector = decode::sparse::Selector::kDevice;
    return c;
  }
  if (absl::ConsumeSuffix(&label, "+guard")) {
    FLUXION_ASSIGN_OR_RETURN(decode::sparse::PolicyConfig c, ParseLabel(std::string(label)));
    if (!decode::sparse::TraitsOf(c.kind).guardable) {
      return absl::InvalidArgumentError(absl::StrCat("attention policy '", full_label,
                                                     "': the error guard applies to lfps and "
                                                     "fluxion only"));
    }
    c.guard.enabled = true;
    return c;
  }
  std::vector<std::string> parts = absl::StrSplit(label, '@');
  double budget = 1.0;
  if (parts.size() > 2 || (parts.size() == 2 && !absl::SimpleAtod(parts[1], &budget))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention policy '", label,
        "' should be NAME or NAME@BUDGET; known: ", decode::sparse::PolicyNamesHelp()));
  }
  return decode::sparse::ParsePolicy(parts[0], budget);
}

}  // namespace

absl::Status ValidatePolicy(const std::string& label) { return ParseLabel(label).status(); }

absl::StatusOr<decode::sparse::PolicyConfig> PolicyConfigOf(const std::string& label) {
  return ParseLabel(label);
}

std::vector<std::string> PolicyLabels(const std::vector<std::string>& policies,
                                      const std::vector<double>& budgets) {
  std::vector<std::string> labels;
  for (const std::string& p : policies) {
    // Labels that already carry a budget pass through; bad names surface in ValidatePolicy.
    auto configs = decode::sparse::ExpandPolicies({p}, budgets);
    if (absl::StrContains(p, '@') || !configs.ok()) {
      labels.push_back(p);
      continue;
    }
    for (const auto& c : *configs) labels.push_back(decode::sparse::PolicyLabel(c));
  }
  return labels;
}

absl::StatusOr<std::unique_ptr<decode::SparseAttention>> MakePagedPolicyAttention(
    const std::string& label, const model::DenseAttention& prefilled,
    const model::AttentionShape& shape, decode::KvArena* arena, const model::SparseState* state,
    std::shared_ptr<const decode::sparse::FluxionPredictor> predictor,
    std::shared_ptr<const decode::sparse::DecisionProfile> profile,
    const decode::sparse::GuardConfig& guard,
    std::shared_ptr<const model::OutputProjection> projection) {
  FLUXION_ASSIGN_OR_RETURN(decode::sparse::PolicyConfig config, ParseLabel(label));
  config.fluxion_predictor = std::move(predictor);
  if (config.guard.enabled) {
    if (projection == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("policy ", label, ": the error guard needs the model's output projection"));
    }
    config.guard = guard;
    config.guard.enabled = true;
    config.output_projection = std::move(projection);
  }
  if (profile != nullptr && (config.kind == decode::sparse::PolicyKind::kLfps ||
                             config.kind == decode::sparse::PolicyKind::kFluxion)) {
    FLUXION_RETURN_IF_ERROR(profile->For(config).status());
    config.decision_profile = std::move(profile);
  }
  return decode::SparseAttention::FromDense(arena, shape, kPageTokens, prefilled, config, state);
}

absl::StatusOr<std::unique_ptr<model::SequenceAttention>> MakePolicyAttention(
    const std::string& label, const model::DenseAttention& prefilled,
    const model::AttentionShape& shape, decode::KvArena* arena, const model::SparseState* state,
    std::shared_ptr<const decode::sparse::FluxionPredictor> predictor,
    std::shared_ptr<const decode::sparse::DecisionProfile> profile,
    const decode::sparse::GuardConfig& guard,
    std::shared_ptr<const model::OutputProjection> projection) {
  FLUXION_RETURN_IF_ERROR(ValidatePolicy(label));
  if (label == "full") {
    // Decode keeps attending over every prefilled token in fp32, exactly as the prefill did.
    return std::unique_ptr<model::SequenceAttention>(
        std::make_unique<model::DenseAttention>(prefilled));
  }
  FLUXION_ASSIGN_OR_RETURN(
      std::unique_ptr<decode::SparseAttention> sparse,
      MakePagedPolicyAttention(label, prefilled, shape, arena, state, std::move(predictor),
                               std::move(profile), guard, std::move(projection)));
  return std::unique_ptr<model::SequenceAttention>(std::move(sparse));
}

std::string FullPolicyAttention(const std::string& device) {
  return device == "cpu" ? "fp32 dense cache (the prefill's)"
                         : "full sparse policy over bf16 host pages (not the fp32 dense path)";
}

absl::StatusOr<std::unique_ptr<decode::StepExecutor>> NewHostHybridEvalExecutor(
    const model::Model* model, const kernels::cpu::CpuPool* pool) {
  // One slot: the harness decodes one request at a time, and the executor gives a request's
  // slot back at the first step that no longer lists it.
  // The served configuration: quest's and fixed_*'s blocks scored by the window.
  decode::WindowShape window_shape =
      decode::WindowShapeFor(model->attention_shape(), /*max_requests=*/1);
  window_shape.page_tokens = kPageTokens;
  window_shape.max_context_tokens = kEvalMaxContextTokens;
  window_shape.compact_slots = 1;  // +device labels pick through the window, as served
  FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<decode::ResidentWindow> window,
                           decode::NewHostResidentWindow(window_shape, kPageTokens));
  FLUXION_ASSIGN_OR_RETURN(
      std::unique_ptr<decode::HybridStepExecutor> hybrid,
      decode::HybridStepExecutor::Create(model, std::make_unique<model::CpuDenseOps>(pool),
                                         std::move(window), pool));
  return std::unique_ptr<decode::StepExecutor>(std::move(hybrid));
}

// The sparse attention under a decode's attention (through a capture wrapper), or null for full
// attention.
const decode::SparseAttention* SparseUnder(const model::SequenceAttention& attention) {
  if (const auto* capturing = dynamic_cast<const CapturingAttention*>(&attention)) {
    return SparseUnder(capturing->inner());
  }
  return dynamic_cast<const decode::SparseAttention*>(&attention);
}

double AttendedFraction(const model::SequenceAttention& attention) {
  const decode::SparseAttention* sparse = SparseUnder(attention);
  return sparse != nullptr ? sparse->attended_fraction() : 1.0;
}

// Share of (layer, KV head, step) selections a history policy bypassed to sinks + local window.
double BypassedFraction(const model::SequenceAttention& attention) {
  const decode::SparseAttention* sparse = SparseUnder(attention);
  if (sparse == nullptr || sparse->stats().selections == 0) return 0.0;
  return static_cast<double>(sparse->stats().bypassed) / sparse->stats().selections;
}

float TopTwoMargin(absl::Span<const float> logits) {
  if (logits.size() < 2) return 0.0f;
  float first = -std::numeric_limits<float>::infinity(), second = first;
  for (float x : logits) {
    if (x > first) {
      second = first;
      first = x;
    } else if (x > second) {
      second = x;  // a tie with `first` lands here: margin 0
    }
  }
  return first - second;
}

Interval Wilson95(int64_t successes, int64_t n) {
  if (n <= 0) return {0.0, 1.0};
  constexpr double z = 1.959963984540054;
  const double p = static_cast<double>(successes) / n, z2n = z * z / n;
  const double center = (p + z2n / 2) / (1 + z2n);
  const double half = z / (1 + z2n) * std::sqrt(p * (1 - p) / n + z2n / (4.0 * n));
  return {std::max(0.0, center - half), std::min(1.0, center + half)};
}

namespace {

// The greedy choice of one logits row, with its margin, appended to `po`.
void RecordChoice(absl::Span<const float> logits, PolicyOutcome* po) {
  po->tokens.push_back(model::ArgMax(logits));
  po->margins.push_back(TopTwoMargin(logits));
  po->top_logits.push_back(logits.empty() ? 0.0f : *std::max_element(logits.begin(), logits.end()));
}

// Feeds `token` to `decode` and leaves the next-token logits in `logits`: on the CPU engine, or
// as a step of one request through `executor` (then `paged` is the sequence's attention).
absl::Status DecodeStep(const model::Model& model, decode::StepExecutor* executor,
                        model::Sequence& decode, decode::SparseAttention* paged, int32_t token,
                        std::vector<float>* logits, std::vector<absl::Status>* statuses) {
  if (executor == nullptr) return model.Forward(decode, absl::MakeConstSpan(&token, 1), logits);
  const decode::StepRequest request{&decode, paged, token};
  executor->Step(absl::MakeConstSpan(&request, 1), logits, statuses);
  return (*statuses)[0];
}

// Fails before any model time is spent: bad options, a (task, context) that makes no prompt, a
// vocabulary the byte tokenizer does not fit.
absl::Status CheckTaskEval(const model::Model& model, const TaskEvalOptions& options,
                           const std::vector<std::string>& tasks) {
  if (options.samples < 1) {
    return absl::InvalidArgumentError(absl::StrCat("samples must be >= 1, got ", options.samples));
  }
  if (options.contexts.empty() || options.policies.empty()) {
    return absl::InvalidArgumentError("at least one context and one policy are needed");
  }
  for (const std::string& p : options.policies) FLUXION_RETURN_IF_ERROR(ValidatePolicy(p));
  if (options.executor != nullptr && !options.capture_dir.empty()) {
    return absl::InvalidArgumentError(
        "capture records the CPU engine's decode; it cannot run through a step executor "
        "(use the cpu device)");
  }
  for (const std::string& task : tasks) {
    for (int64_t context : options.contexts) {
      FLUXION_RETURN_IF_ERROR(options.codec.Sample(task, context, options.first_seed).status());
    }
  }
  if (options.codec.bytes() && model.config().vocab_size <= ByteTokenizer::kEos) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the model's vocabulary has ", model.config().vocab_size,
        " ids; the byte tokenizer needs at least ", ByteTokenizer::kEos + 1, " (docs/TASKS.md)"));
  }
  return absl::OkStatus();
}

// What every sample of a run shares.
struct EvalRun {
  EvalRun(const model::Model& m, const TaskEvalOptions& o)
      : model(m), options(o), shape(m.attention_shape()) {}
  const model::Model& model;
  const TaskEvalOptions& options;
  model::AttentionShape shape;
  // Host pages for the sparse policies: one decode at a time, so the longest prompt plus its
  // longest answer (TASKS.md: at most 256 + 16 tokens) per layer and KV head, once.
  std::unique_ptr<decode::KvArena> arena;
  std::unique_ptr<CaptureWriter> writer;  // null unless capturing
  bool needs_sparse_state = false;        // some policy starts from the prefill's sparse state
  std::vector<float> logits;
  std::vector<absl::Status> statuses;
};

absl::Status SetUpRun(EvalRun& run) {
  const TaskEvalOptions& options = run.options;
  const model::AttentionShape& shape = run.shape;
  const int64_t longest = *std::max_element(options.contexts.begin(), options.contexts.end()) +
                          std::max<int64_t>(options.max_new_tokens, 512);
  FLUXION_ASSIGN_OR_RETURN(
      run.arena,
      decode::KvArena::Create(
          decode::KvShape{shape.num_layers, shape.num_kv_heads, shape.head_dim, kPageTokens}
              .page_bytes(),
          shape.num_layers * shape.num_kv_heads * ((longest + kPageTokens - 1) / kPageTokens + 1)));
  run.needs_sparse_state =
      std::any_of(options.policies.begin(), options.policies.end(), [](const std::string& p) {
        return absl::StartsWith(p, "lfps") || absl::StartsWith(p, "fluxion");
      });
  if (!options.capture_dir.empty()) run.writer = std::make_unique<CaptureWriter>(options, shape);
  return absl::OkStatus();
}

// One sample's full-attention prefill. Capturing wraps the cache so the last prompt rows'
// queries and statistics are recorded on the way.
struct SamplePrefill {
  std::unique_ptr<model::Sequence> sequence;     // owns the cache below
  const model::DenseAttention* dense = nullptr;  // the prompt's K/V, every policy copies it
  model::SparseState sparse_state;               // when run.needs_sparse_state
  PolicyOutcome first;                           // the first token, every policy's
  double seconds = 0;
};

absl::StatusOr<SamplePrefill> Prefill(EvalRun& run, const TaskSample& sample) {
  const int64_t prompt_len = sample.prompt_ids.size();
  SamplePrefill p;
  auto dense = std::make_unique<model::DenseAttention>(run.shape);
  dense->RecordQueries(std::max<int64_t>(0, prompt_len - model::kPrefillTailRows), prompt_len);
  p.dense = dense.get();
  std::unique_ptr<model::SequenceAttention> attention = std::move(dense);
  const CapturingAttention* prompt_capture = nullptr;
  if (run.writer != nullptr) {
    CaptureOptions c;
    c.capture_from = std::max<int64_t>(0, prompt_len - run.options.capture_prompt_rows);
    auto wrapped = std::make_unique<CapturingAttention>(std::move(attention), run.shape, c);
    prompt_capture = wrapped.get();
    attention = std::move(wrapped);
  }
  p.sequence = std::make_unique<model::Sequence>(std::move(attention));
  const auto t0 = std::chrono::steady_clock::now();
  FLUXION_RETURN_IF_ERROR(run.model.Forward(*p.sequence, sample.prompt_ids, &run.logits));
  RecordChoice(run.logits, &p.first);
  p.seconds = SecondsSince(t0);
  if (run.writer != nullptr) {
    FLUXION_RETURN_IF_ERROR(run.writer->BeginSample(sample, *p.dense, *prompt_capture));
  }
  // The prefill's sparse state, once per sample, for every policy that starts from it.
  if (run.needs_sparse_state) {
    FLUXION_ASSIGN_OR_RETURN(p.sparse_state, model::CaptureSparseState(*p.dense, run.shape));
  }
  return p;
}

// `label`'s attention over a copy of the prompt's cache: paged for the step executor (`*paged`
// is then the executor's view of the request), else the CPU engine's.
absl::StatusOr<std::unique_ptr<model::SequenceAttention>> DecodeAttention(
    EvalRun& run, const SamplePrefill& p, const std::string& label,
    decode::SparseAttention** paged) {
  const TaskEvalOptions& o = run.options;
  const model::SparseState* state = run.needs_sparse_state ? &p.sparse_state : nullptr;
  *paged = nullptr;
  if (o.executor != nullptr) {
    FLUXION_ASSIGN_OR_RETURN(
        std::unique_ptr<decode::SparseAttention> sparse,
        MakePagedPolicyAttention(label, *p.dense, run.shape, run.arena.get(), state,
                                 o.fluxion_predictor, o.decision_profile, o.guard,
                                 o.output_projection));
    *paged = sparse.get();
    return std::unique_ptr<model::SequenceAttention>(std::move(sparse));
  }
  return MakePolicyAttention(label, *p.dense, run.shape, run.arena.get(), state,
                             o.fluxion_predictor, o.decision_profile, o.guard, o.output_projection);
}

// What the decode under `attention` read: the attended, bypassed, guard-checked and scored
// shares, the guard's counts, and whether the budget left no middle row at this prompt length.
void RecordReads(const model::SequenceAttention& attention, int64_t prompt_len, PolicyOutcome* po) {
  po->attended_fraction = AttendedFraction(attention);
  po->bypassed_fraction = BypassedFraction(attention);
  if (const decode::SparseAttention* sparse = SparseUnder(attention)) {
    po->selection = sparse->stats();
    const decode::sparse::GuardStats g = sparse->guard_stats();
    const int64_t context = po->selection.context;
    po->guard_fraction = context > 0 ? static_cast<double>(g.check_rows) / context : 0.0;
    po->scored_fraction =
        context > 0 ? static_cast<double>(po->selection.k_rows_scored) / context : 0.0;
    po->guard_checks = g.checks;
    po->guard_escalations = g.escalations;
    po->guard_errors = g.errors;
  }
  if (auto config = ParseLabel(po->policy);
      config.ok() && config->kind != decode::sparse::PolicyKind::kFull) {
    po->degenerate = decode::sparse::SplitContext(*config, prompt_len).middle_rows_budget == 0;
  }
}

// Greedy decode of one sample under policy `label`, continuing from the prefill (whose token is
// the first); capturing records it.
absl::StatusOr<PolicyOutcome> DecodePolicy(EvalRun& run, const TaskSample& sample,
                                           const SamplePrefill& p, const std::string& label) {
  const int64_t prompt_len = sample.prompt_ids.size();
  PolicyOutcome po = p.first;
  po.policy = label;
  decode::SparseAttention* paged = nullptr;
  FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<model::SequenceAttention> attention,
                           DecodeAttention(run, p, label, &paged));
  const CapturingAttention* decode_capture = nullptr;
  if (run.writer != nullptr) {
    CaptureOptions c;
    c.capture_from = prompt_len;
    auto wrapped =
        std::make_unique<CapturingAttention>(std::move(attention), run.shape, c, p.dense);
    decode_capture = wrapped.get();
    attention = std::move(wrapped);
  }
  const model::SequenceAttention* view = attention.get();
  model::Sequence decode(std::move(attention), prompt_len);
  const TaskCodec& codec = run.options.codec;
  const int64_t max_new = run.options.max_new_tokens > 0 ? run.options.max_new_tokens
                                                         : codec.MaxNewTokens(sample.answer);
  const auto t0 = std::chrono::steady_clock::now();
  while (!codec.EndsAnswer(po.tokens.back()) &&
         static_cast<int64_t>(po.tokens.size()) < max_new) {
    if (absl::Status s = DecodeStep(run.model, run.options.executor, decode, paged,
                                    po.tokens.back(), &run.logits, &run.statuses);
        !s.ok()) {
      return absl::Status(
          s.code(),
          absl::StrCat("policy ", po.policy, ", ", sample.task, " ", sample.context, " seed ",
                       sample.seed, ", decode step ", po.decode_steps, ": ", s.message()));
    }
    RecordChoice(run.logits, &po);
    ++po.decode_steps;
  }
  po.decode_seconds = SecondsSince(t0);
  RecordReads(*view, prompt_len, &po);
  po.answer = codec.AnswerText(po.tokens);
  po.correct = po.answer == sample.answer;
  if (run.writer != nullptr) FLUXION_RETURN_IF_ERROR(run.writer->AddPolicy(po, *decode_capture));
  return po;
}

// Adds one policy's outcome of one sample to its cell. `reference`: the sample's first policy's
// outcome (the paired comparison's baseline), null for the first policy itself.
void AddToCell(const PolicyOutcome& po, double prefill_seconds, const PolicyOutcome* reference,
               CellTotals* cell) {
  ++cell->samples;
  cell->correct += po.correct;
  cell->prefill_seconds += prefill_seconds;
  cell->decode_seconds += po.decode_seconds;
  cell->decode_steps += po.decode_steps;
  cell->attended_fraction += po.attended_fraction;
  cell->bypassed_fraction += po.bypassed_fraction;
  cell->guard_fraction += po.guard_fraction;
  cell->scored_fraction += po.scored_fraction;
  cell->guard_escalations += po.guard_escalations;
  cell->guard_checks += po.guard_checks;
  cell->guard_errors.insert(cell->guard_errors.end(), po.guard_errors.begin(),
                            po.guard_errors.end());
  cell->degenerate += po.degenerate;
  if (reference != nullptr) {
    cell->lost += reference->correct && !po.correct;
    cell->gained += !reference->correct && po.correct;
  }
}

CellResult ToResult(const CellTotals& t, const std::string& task, int64_t context,
                    const std::string& policy) {
  CellResult r;
  r.task = task;
  r.context = context;
  r.policy = policy;
  r.samples = t.samples;
  r.correct = t.correct;
  auto per_sample = [&t](double x) { return t.samples > 0 ? x / t.samples : 0.0; };
  r.accuracy = per_sample(t.correct);
  const Interval ci95 = Wilson95(t.correct, t.samples);
  r.ci_low = ci95.low;
  r.ci_high = ci95.high;
  r.prefill_ms = per_sample(1e3 * t.prefill_seconds);
  r.tpot_ms = t.decode_steps > 0 ? 1e3 * t.decode_seconds / t.decode_steps : 0.0;
  r.budget_spent = per_sample(t.attended_fraction);
  r.bypassed = per_sample(t.bypassed_fraction);
  r.guard_read = per_sample(t.guard_fraction);
  r.scored = per_sample(t.scored_fraction);
  r.guard_escalations = t.guard_escalations;
  r.guard_checks = t.guard_checks;
  std::vector<double> errors = t.guard_errors;
  r.guard_error_p50 = Quantile(&errors, 0.5);
  r.guard_error_p90 = Quantile(&errors, 0.9);
  r.degenerate = t.degenerate;
  r.lost = t.lost;
  r.gained = t.gained;
  r.delta = per_sample(static_cast<double>(t.gained - t.lost));
  const Interval paired = PairedDifference95(t.lost, t.gained, t.samples);
  r.delta_low = paired.low;
  r.delta_high = paired.high;
  return r;
}

// One sample: the prefill, then every policy's decode, into `totals` (this sample's cells,
// one per policy).
absl::StatusOr<SampleOutcome> RunSample(EvalRun& run, const std::string& task, int64_t context,
                                        uint64_t seed, CellTotals* totals) {
  SampleOutcome outcome;
  FLUXION_ASSIGN_OR_RETURN(outcome.sample, run.options.codec.Sample(task, context, seed));
  FLUXION_ASSIGN_OR_RETURN(SamplePrefill p, Prefill(run, outcome.sample));
  outcome.prefill_seconds = p.seconds;
  for (size_t pi = 0; pi < run.options.policies.size(); ++pi) {
    FLUXION_ASSIGN_OR_RETURN(PolicyOutcome po,
                             DecodePolicy(run, outcome.sample, p, run.options.policies[pi]));
    AddToCell(po, p.seconds, pi > 0 ? &outcome.policies[0] : nullptr, &totals[pi]);
    outcome.policies.push_back(std::move(po));
  }
  if (run.writer != nullptr) FLUXION_RETURN_IF_ERROR(run.writer->EndSample());
  return outcome;
}

}  // namespace

absl::StatusOr<std::vector<CellResult>> RunTaskEval(const model::Model& model,
                                                    const TaskEvalOptions& options,
                                                    const TaskEvalCallbacks& callbacks) {
  const std::vector<std::string> tasks = options.tasks.empty() ? TaskNames() : options.tasks;
  FLUXION_RETURN_IF_ERROR(CheckTaskEval(model, options, tasks));
  EvalRun run(model, options);
  FLUXION_RETURN_IF_ERROR(SetUpRun(run));
  const size_t num_contexts = options.contexts.size(), num_policies = options.policies.size();
  std::vector<CellTotals> totals(tasks.size() * num_contexts * num_policies);
  const int64_t total = tasks.size() * num_contexts * options.samples;
  int64_t index = 0;
  for (size_t ti = 0; ti < tasks.size(); ++ti) {
    for (size_t ci = 0; ci < num_contexts; ++ci) {
      for (int64_t i = 0; i < options.samples; ++i, ++index) {
        if (callbacks.on_sample_start) {
          callbacks.on_sample_start(index, total, tasks[ti], options.contexts[ci]);
        }
        FLUXION_ASSIGN_OR_RETURN(
            SampleOutcome outcome,
            RunSample(run, tasks[ti], options.contexts[ci], options.first_seed + i,
                      &totals[(ti * num_contexts + ci) * num_policies]));
        outcome.index = index;
        outcome.total = total;
        if (callbacks.on_sample_done) callbacks.on_sample_done(outcome);
      }
    }
  }
  std::vector<CellResult> results;
  for (size_t ti = 0; ti < tasks.size(); ++ti) {
    for (size_t ci = 0; ci < num_contexts; ++ci) {
      for (size_t pi = 0; pi < num_policies; ++pi) {
        results.push_back(ToResult(totals[(ti * num_contexts + ci) * num_policies + pi], tasks[ti],
                                   options.contexts[ci], options.policies[pi]));
      }
    }
  }
  return results;
}

}  // namespace fluxion::eval

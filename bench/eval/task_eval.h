// The task-evaluation harness behind `fluxion eval tasks`: generates docs/TASKS.md prompts, runs
// them through the real engine and scores exact answers, per (task, context, attention policy).
//
// Every sample is prefilled once with full attention (model::DenseAttention); each policy then
// decodes greedily from its own copy of that prefilled state, so comparing policies costs one
// prefill. This is also how serving works: prefill is full attention on the prefill node, and the
// sparse policy only changes decode. Optionally the run is captured to disk (queries, keys,
// values and attention statistics) for calibrating sparse policies.
//
// The decode steps run on the CPU engine (model::Model::Forward per token over the policy's
// attention: the reference path) or, given a decode::StepExecutor, through it one request per
// step (B=1): how `--device cuda|host-hybrid` decodes through the hybrid executor of issue 14 with
// the same prompts, seeds and prefill, so the two paths' per-sample outcomes can be compared
// (eval_compare.h).
//
// Thread-compatible: one RunTaskEval at a time per Model is the intended use (the engine's kernels
// are multi-threaded inside).
#ifndef FLUXION_BENCH_EVAL_TASK_EVAL_H_
#define FLUXION_BENCH_EVAL_TASK_EVAL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "bench/eval/paired_stats.h"
#include "bench/eval/task_codec.h"
#include "bench/eval/tasks.h"
#include "decode/kv/kv_arena.h"
#include "decode/sparse/decision_profile.h"
#include "decode/sparse/fluxion_predictor.h"
#include "decode/step/sparse_attention.h"
#include "decode/step/step_executor.h"
#include "kernels/cpu/cpu_pool.h"
#include "model/attention.h"
#include "model/dense_attention.h"
#include "model/model.h"
#include "model/sparse_state.h"

namespace fluxion::eval {

// --- Attention policies ---
// A policy decides how decode steps attend over the prefilled KV. A policy label is `full` (the
// fp32 dense cache the prefill built: the reference every sparse policy is judged against) or
// `<name>@<budget>` for a sparse policy of decode/sparse over bf16 host pages, e.g.
// `quest@0.05`; `fixed_<block>_<budget>` carries its own budget.

// OK for a valid label; InvalidArgument naming the known policies otherwise.
absl::Status ValidatePolicy(const std::string& label);

// Expands policies x budgets into labels: `full` and fixed_* once, the others once per budget.
std::vector<std::string> PolicyLabels(const std::vector<std::string>& policies,
                                      const std::vector<double>& budgets);

// The attention a decode under `label` starts from, given the full-attention prefill state
// `prefilled` of shape `shape` (copied, not kept). Sparse policies take pages from `arena`, which
// must outlive the result.
// `state` (optional) is the prefill's sparse state, captured once per sample and shared.
// `predictor` (optional) is the trained head-property predictor the `fluxion` policy uses.
// A label ending in `+guard` (`fluxion@0.02+guard`) decodes under the online error guard
// (decode/sparse/error_guard.h) with `guard`'s settings and the model's `projection` (required
// then: FailedPrecondition without one).
absl::StatusOr<std::unique_ptr<model::SequenceAttention>> MakePolicyAttention(
    const std::string& label, const model::DenseAttention& prefilled,
    const model::AttentionShape& shape, decode::KvArena* arena,
    const model::SparseState* state = nullptr,
    std::shared_ptr<const decode::sparse::FluxionPredictor> predictor = nullptr,
    std::shared_ptr<const decode::sparse::DecisionProfile> profile = nullptr,
    const decode::sparse::GuardConfig& guard = {},
    std::shared_ptr<const model::OutputProjection> projection = nullptr);

// The policy config a label denotes (InvalidArgument as ValidatePolicy).
absl::StatusOr<decode::sparse::PolicyConfig> PolicyConfigOf(const std::string& label);

// The same over the host pages whatever the label: `full` becomes the `full` sparse policy (every
// row, bf16 pages), which is what a decode through a StepExecutor needs (its requests are
// SparseAttentions).
absl::StatusOr<std::unique_ptr<decode::SparseAttention>> MakePagedPolicyAttention(
    const std::string& label, const model::DenseAttention& prefilled,
    const model::AttentionShape& shape, decode::KvArena* arena,
    const model::SparseState* state = nullptr,
    std::shared_ptr<const decode::sparse::FluxionPredictor> predictor = nullptr,
    std::shared_ptr<const decode::sparse::DecisionProfile> profile = nullptr,
    const decode::sparse::GuardConfig& guard = {},
    std::shared_ptr<const model::OutputProjection> projection = nullptr);

// Fraction of context rows a decode attention read (1 for `full`).
double AttendedFraction(const model::SequenceAttention& attention);

// --- Scoring (TASKS.md "Scoring") ---

// Greedy decision margin of one logits row: the largest logit minus the second largest (0 on a
// tie; 0 for fewer than two logits). How close a greedy step was to choosing another token.
float TopTwoMargin(absl::Span<const float> logits);

// 95% Wilson score interval of `successes` out of `n` ([0, 1] for n == 0).
Interval Wilson95(int64_t successes, int64_t n);

// --- The harness ---

struct TaskEvalOptions {
  std::vector<std::string> tasks;         // empty: every task
  std::vector<int64_t> contexts = {1024};
  int64_t samples = 8;                    // per (task, context)
  uint64_t first_seed = kFirstEvalSeed;   // sample i of every cell uses first_seed + i
  std::vector<std::string> policies = {"full"};
  int64_t max_new_tokens = 0;  // > 0 overrides the codec's MaxNewTokens(answer)
  // How task text becomes the model's tokens and generated tokens an answer (task_codec.h):
  // TaskCodec::Bytes() for our byte-level models, ForTokenizer for a checkpoint of its own.
  TaskCodec codec = TaskCodec::Bytes();
  // Null: the decode steps run on the CPU engine (Model::Forward per token). Otherwise every
  // generated step is one Step() of this executor with a batch of one request, over the
  // policy's host pages (`full` as the `full` sparse policy: see MakePagedPolicyAttention). The
  // prefill stays on the CPU either way. Not owned; incompatible with capture_dir.
  decode::StepExecutor* executor = nullptr;
  // Capture (off when capture_dir is empty): see WriteCapture in task_eval.cc for the layout.
  std::string capture_dir;
  int64_t capture_kv_max = 8192;    // prompt K/V are written only for prompts up to this length
  int64_t capture_prompt_rows = 64;  // query rows of the last this-many prompt positions
  std::string model_name;            // recorded in the capture index
  // For the `fluxion` policy: its trained predictor; null -> the rule-based fallback.
  std::shared_ptr<const decode::sparse::FluxionPredictor> fluxion_predictor;
  // lfps / fluxion replay this profile's decisions instead of deciding (decision_profile.h);
  // null: they decide. Every lfps / fluxion label must have an entry in it.
  std::shared_ptr<const decode::sparse::DecisionProfile> decision_profile;
  // For labels ending in `+guard`: the error guard's settings and the model's W_O.
  decode::sparse::GuardConfig guard;
  std::shared_ptr<const model::OutputProjection> output_projection;
};

// `--device` of `fluxion eval tasks`: "cpu" (the CPU engine), "host-hybrid" (the hybrid
// executor over its host stand-in: CpuDenseOps and the host resident window, runnable anywhere),
// "cuda" (the hybrid executor on CUDA device 0: decode/step/step_executor_factory.h).
// What a sample's `full` policy attends in a run on `device` (recorded beside its outcome).
std::string FullPolicyAttention(const std::string& device);

// The longest context whose page bounds the eval's hybrid windows keep (quest's and fixed_*'s
// block scores come from the window, as served; longer contexts score on the CPU).
inline constexpr int64_t kEvalMaxContextTokens = 1 << 17;
inline constexpr int64_t kEvalPageTokens = 16;  // the host pages' size in the eval

// The hybrid step executor over the host stand-in of the device half: the dense halves on
// model::CpuDenseOps over `pool`, a host resident window of one slot (B=1, sinks and window of the
// default policy config, block scores from its page bounds). `model` and `pool` (may be null)
// must outlive it.
absl::StatusOr<std::unique_ptr<decode::StepExecutor>> NewHostHybridEvalExecutor(
    const model::Model* model, const kernels::cpu::CpuPool* pool);

struct PolicyOutcome {
  std::string policy;
  std::vector<int32_t> tokens;  // everything generated, the terminator included
  // Per generated token (tokens.size() entries; entry 0 from the prefill's logits): the logits'
  // TopTwoMargin and largest logit at the step that chose it. Where two runs' tokens first
  // differ, the reference's margin there tells a near-tie from a divergence (eval_compare.h).
  std::vector<float> margins;
  std::vector<float> top_logits;
  std::string answer;           // the codec's AnswerText(tokens)
  bool correct = false;
  int64_t decode_steps = 0;     // forwards after the prefill (the first token comes from it)
  double decode_seconds = 0;
  double attended_fraction = 1;  // context rows the decode steps read (the budget spent)
  double bypassed_fraction = 0;  // head-steps a history policy bypassed to sinks + window
  // The error guard (`+guard` labels): rows its exact checks read over the context rows
  // available (reported beside attended_fraction, and counted in the budget spent), its checks
  // and escalations.
  double guard_fraction = 0;
  // K rows read only to score (a history policy's rescoring, exact top-k's scan) over the context
  // rows available, summed over head-steps like attended_fraction: how much more than the budget
  // the selection itself reads.
  double scored_fraction = 0;
  int64_t guard_checks = 0, guard_escalations = 0;
  std::vector<double> guard_errors;  // e_h of every check
  // The budget leaves no middle row at this prompt's length (sinks + window cover it): every
  // policy attends sinks + window only, so a loss here is the budget's, not the policy's.
  bool degenerate = false;
  // What a sparse policy decided over the decode (zero for `full`): decision profiles are
  // recorded from it (decode/sparse/decision_profile.h).
  decode::sparse::SelectionStats selection;
};

struct SampleOutcome {
  int64_t index = 0;  // 0-based over the whole run
  int64_t total = 0;  // samples in the run (tasks x contexts x samples)
  TaskSample sample;
  double prefill_seconds = 0;
  std::vector<PolicyOutcome> policies;  // in options.policies order
};

struct CellResult {
  std::string task;
  int64_t context = 0;
  std::string policy;
  int64_t samples = 0;
  int64_t correct = 0;
  double accuracy = 0, ci_low = 0, ci_high = 0;
  double prefill_ms = 0;  // mean over samples
  double tpot_ms = 0;     // decode ms per token over all of the cell's decode steps; 0 if none
  double budget_spent = 1;  // mean attended fraction of the context over the cell's samples
  double bypassed = 0;      // mean share of head-steps bypassed (LFPS family; 0 for the others)
  double guard_read = 0;    // mean rows the error guard's exact checks read / context rows
  double scored = 0;        // mean K rows read only to score / context rows (the selection's read)
  int64_t guard_escalations = 0;  // summed over the cell's samples
  int64_t guard_checks = 0;
  double guard_error_p50 = 0, guard_error_p90 = 0;  // over the cell's checks (0 without)
  // Samples whose (prompt length, budget) point is degenerate (PolicyOutcome::degenerate).
  int64_t degenerate = 0;
  // Paired against the first policy of the run (the reference, normally `full`) on the same
  // samples: samples only the reference solved, only this policy solved, and the accuracy
  // difference (this - reference) with a 95% interval. Zero for the reference itself.
  int64_t lost = 0, gained = 0;
  double delta = 0, delta_low = 0, delta_high = 0;
};

// PairedDifference95: bench/eval/paired_stats.h.

struct TaskEvalCallbacks {
  // Before sample `index` of `total` is generated and prefilled (for progress lines).
  std::function<void(int64_t index, int64_t total, const std::string& task, int64_t context)>
      on_sample_start;
  std::function<void(const SampleOutcome&)> on_sample_done;
};

// Runs the evaluation; results in (task, context, policy) order. InvalidArgument for an unknown
// task or policy, a bad seed, a context too short for a task, samples < 1, an executor with
// capture; FailedPrecondition for a model whose vocabulary cannot hold the byte tokenizer's ids;
// Internal for capture write failures; an executor's step error (e.g. FailedPrecondition for a
// policy whose sinks or local window are smaller than the hybrid window's resident ones) with
// the policy and sample named.
absl::StatusOr<std::vector<CellResult>> RunTaskEval(const model::Model& model,
                                                    const TaskEvalOptions& options,
                                                    const TaskEvalCallbacks& callbacks = {});

}  // namespace fluxion::eval

#endif  // FLUXION_BENCH_EVAL_TASK_EVAL_H_

#include "decode/step/hybrid_step_executor.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/attention_backend_cpu.h"
#include "model/decode_step.h"
#include "model/sampler.h"

namespace fluxion::decode {

struct HybridStepExecutor::State {
  int64_t vocab_size = 0;
  std::unique_ptr<model::DenseOps> ops;
  std::unique_ptr<ResidentWindow> window;
  std::unique_ptr<kernels::AttentionBackend> cpu_backend;
  std::unique_ptr<model::DecodeStepRunner> runner;
  std::unique_ptr<HybridBatchAttention> attention;
  absl::flat_hash_map<uint64_t, int> slots;  // SparseAttention::id() -> window slot
  // Scratch of one step (kept so that a step allocates nothing once the batch settles).
  absl::flat_hash_set<uint64_t> present;  // ids in this step's batch
  std::vector<size_t> rows;  // batch index of each row that takes part
  std::vector<model::Sequence*> seqs;
  std::vector<SparseAttention*> attentions;
  std::vector<int32_t> tokens;
  std::vector<int64_t> positions;
  std::vector<int> row_slots;
  std::vector<uint8_t> score_rows;  // whether each row's policy picks blocks this step
  std::vector<sparse::ScoredBlocks::Range> rankings;  // each row's blocks the window ranks
  std::vector<float> logits;
  // Sampling's (StepAndSample), per row of the step.
  std::vector<int64_t> needed;  // candidates the row's draw needs (0: its full logits)
  std::vector<double> temperatures, normalisers;
  std::vector<int32_t> candidate_ids;
  std::vector<float> candidate_logits;
};

absl::StatusOr<std::unique_ptr<HybridStepExecutor>> HybridStepExecutor::Create(
    const model::Model* model, std::unique_ptr<model::DenseOps> ops,
    std::unique_ptr<ResidentWindow> window, const kernels::cpu::CpuPool* pool) {
  FLUXION_ASSIGN_OR_RETURN(model::ModelParams params, model->UploadParams(*ops));
  return Create(model->config(), std::move(ops), std::move(params), std::move(window), pool);
}

absl::StatusOr<std::unique_ptr<HybridStepExecutor>> HybridStepExecutor::Create(
    const model::ModelConfig& config, std::unique_ptr<model::DenseOps> ops,
    model::ModelParams params, std::unique_ptr<ResidentWindow> window,
    const kernels::cpu::CpuPool* pool) {
  const WindowShape& w = window->shape();
  if (w.num_layers != config.num_layers || w.num_heads != config.num_heads ||
      w.num_kv_heads != config.num_kv_heads || w.head_dim != config.head_dim) {
    return absl::InvalidArgumentError("the resident window's shape is not the model's");
  }
  const model::AttentionShape shape{config.num_layers, config.num_heads, config.num_kv_heads,
                                    config.head_dim,
                                    1.0f / std::sqrt(static_cast<float>(config.head_dim))};
  auto state = std::make_unique<State>();
  state->vocab_size = config.vocab_size;
  state->ops = std::move(ops);
  state->window = std::move(window);
  state->window->set_cpu_pool(pool);
  FLUXION_ASSIGN_OR_RETURN(state->cpu_backend,
                           kernels::cpu::NewCpuAttentionBackend({pool, std::nullopt}));
  state->runner = model::DecodeStepRunner::Create(config, state->ops.get(), std::move(params));
  state->attention = std::make_unique<HybridBatchAttention>(
      state->window.get(), state->cpu_backend.get(), pool, state->ops.get(), shape);
  return std::unique_ptr<HybridStepExecutor>(new HybridStepExecutor(std::move(state)));
}

HybridStepExecutor::HybridStepExecutor(std::unique_ptr<State> state)
    : state_(std::move(state)), attention_(state_->attention.get()) {}

HybridStepExecutor::~HybridStepExecutor() = default;

int64_t HybridStepExecutor::max_batch() const {
  const WindowShape& w = state_->window->shape();
  return std::min(w.max_requests, w.max_rows);
}

model::DecodeStepRunner& HybridStepExecutor::runner() { return *state_->runner; }
model::DenseOps& HybridStepExecutor::ops() { return *state_->ops; }

absl::StatusOr<int64_t> HybridStepExecutor::ScoreBlockOf(const SparseAttention& attention) const {
  const WindowShape& w = state_->window->shape();
  const sparse::PolicyConfig& policy = attention.policy_config();
  if (policy.sink_tokens < w.sink_tokens || policy.local_tokens < w.window_tokens) {
    return absl::FailedPreconditionError(absl::StrCat(
        "policy ", policy.name, " attends ", policy.sink_tokens, " sink and ",
        policy.local_tokens, " local tokens, fewer than the ", w.sink_tokens, " + ",
        w.window_tokens, " resident ones of the hybrid step; raise the policy's or lower the "
        "window's"));
  }
  // Policies that rank page bounds have their blocks scored where the window's bounds live.
  const int64_t page_tokens = attention.kv().shape().page_tokens;
  return window_block_scores_ && sparse::ReadsPageScores(policy)
             ? sparse::RankedBlockTokens(policy, page_tokens)
             : 0;
}

absl::StatusOr<int> HybridStepExecutor::SlotOf(const SparseAttention& attention) {
  if (auto it = state_->slots.find(attention.id()); it != state_->slots.end()) return it->second;
  FLUXION_ASSIGN_OR_RETURN(const int64_t score_block, ScoreBlockOf(attention));
  const auto start = std::chrono::steady_clock::now();
  // An admission inside the step runs on the step's pool, hence through the CPU lane when there
  // is one (cpu_lane.h: the pool's parallel regions start on one thread).
  absl::StatusOr<int> admitted;
  FLUXION_RETURN_IF_ERROR(RunOnLane(attention_->cpu_lane(), [&] {
    admitted = state_->window->Admit(attention.kv(), score_block, WantsCompactKeys(attention));
    return admitted.status();
  }));
  const int slot = *admitted;
  ++admission_counters_.requests;
  admission_counters_.seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  state_->slots[attention.id()] = slot;
  return slot;
}

bool HybridStepExecutor::WantsCompactKeys(const SparseAttention& attention) const {
  const WindowShape& w = state_->window->shape();
  // A context already past the compact rows never gets them (they cover max_context_tokens).
  return w.compact_slots > 0 && sparse::DeviceSelects(attention.policy_config()) &&
         attention.kv().length(0) < w.max_context_tokens;
}

bool HybridStepExecutor::Reserve(const SparseAttention& attention) {
  if (!WantsCompactKeys(attention) || reserved_.contains(attention.id())) return true;
  if (static_cast<int64_t>(reserved_.size()) >= state_->window->shape().compact_slots) {
    return false;
  }
  reserved_.insert(attention.id());
  return true;
}

void HybridStepExecutor::Forget(const SparseAttention& attention) {
  reserved_.erase(attention.id());
  if (auto it = state_->slots.find(attention.id()); it != state_->slots.end()) {
    state_->window->Release(it->second);
    state_->slots.erase(it);
  }
}

void HybridStepExecutor::Step(absl::Span<const StepRequest> batch, std::vector<float>* logits,
                              std::vector<absl::Status>* statuses) {
  Run(batch, nullptr, logits, statuses);
}

void HybridStepExecutor::StepAndSample(absl::Span<const StepRequest> batch,
                                       std::vector<int32_t>* tokens, std::vector<float>* logits,
                                       std::vector<absl::Status>* statuses) {
  Run(batch, tokens, logits, statuses);
}

void HybridStepExecutor::Run(absl::Span<const StepRequest> batch, std::vector<int32_t>* tokens,
                             std::vector<float>* logits, std::vector<absl::Status>* statuses) {
  State& s = *state_;
  if (tokens != nullptr) tokens->assign(batch.size(), -1);
  statuses->assign(batch.size(), absl::OkStatus());
  // Requests that left since the last step give their slots back.
  absl::flat_hash_set<uint64_t>& present = s.present;
  present.clear();
  for (const StepRequest& r : batch) present.insert(r.attention->id());
  for (auto it = s.slots.begin(); it != s.slots.end();) {
    if (!present.contains(it->first)) {
      s.window->Release(it->second);
      s.slots.erase(it++);
    } else {
      ++it;
    }
  }
  s.rows.clear();
  s.seqs.clear();
  s.attentions.clear();
  s.tokens.clear();
  s.positions.clear();
  s.row_slots.clear();
  for (size_t i = 0; i < batch.size(); ++i) {
    absl::StatusOr<int> slot = SlotOf(*batch[i].attention);
    if (!slot.ok()) {
      (*statuses)[i] = slot.status();
      continue;
    }
    s.rows.push_back(i);
    s.seqs.push_back(batch[i].seq);
    s.attentions.push_back(batch[i].attention);
    s.tokens.push_back(batch[i].token);
    s.positions.push_back(batch[i].seq->length());
    s.row_slots.push_back(*slot);
  }
  const int64_t vocab = s.vocab_size;
  logits->resize(batch.size() * vocab);
  if (s.rows.empty()) return;
  // Rows whose policy picks no block at this context need no scores (their bounds are kept).
  s.score_rows.resize(s.rows.size());
  for (size_t r = 0; r < s.rows.size(); ++r) {
    const sparse::PolicyConfig& policy = s.attentions[r]->policy_config();
    s.score_rows[r] = sparse::ReadsPageScores(policy) &&
                      sparse::RankedBlocksWanted(policy, s.positions[r] + 1,
                                                 s.attentions[r]->kv().shape().page_tokens) > 0;
  }
  absl::Status step = s.window->BeginStep(s.row_slots, s.positions, s.score_rows);
  if (step.ok()) {
    // Quest and fixed_* take their top blocks as the window ranks them (at the budget this step
    // runs at, so that a degraded step's picks come from the device too).
    s.rankings.resize(s.rows.size());
    for (size_t r = 0; r < s.rows.size(); ++r) {
      s.rankings[r] = sparse::TopBlocksRange(s.attentions[r]->policy_config(),
                                             s.positions[r] + 1,
                                             s.attentions[r]->kv().shape().page_tokens,
                                             guard_.scale());
    }
    s.window->RankBlocks(s.rankings);
    s.attention->SetBatch(s.seqs, s.attentions);
    if (tokens == nullptr) s.logits.resize(s.rows.size() * vocab);
    // Sampling leaves the logits where the LM head wrote them (DrawTokens moves what it needs).
    step = s.runner->Step(s.tokens, s.positions, *s.attention,
                          tokens != nullptr ? nullptr : s.logits.data());
    if (step.ok() && tokens != nullptr) step = DrawTokens(batch, tokens, logits);
    if (step.ok()) ObserveStall();
  }
  for (size_t r = 0; r < s.rows.size(); ++r) {
    const size_t i = s.rows[r];
    (*statuses)[i] = step;
    if (!step.ok() && tokens != nullptr) (*tokens)[i] = -1;
    if (step.ok() && tokens != nullptr) continue;  // DrawTokens placed the row
    if (step.ok()) {
      std::copy(s.logits.begin() + r * vocab, s.logits.begin() + (r + 1) * vocab,
                logits->begin() + i * vocab);
    } else {
      // The request's window rows are unspecified now; the scheduler ends it.
      s.window->Release(s.row_slots[r]);
      s.slots.erase(batch[i].attention->id());
    }
  }
}

void HybridStepExecutor::set_stall_guard(const StallGuardOptions& options) {
  guard_ = StallGuard(options);
  attention_->set_budget_scale(guard_.scale());
  since_guard_ = attention_->counters();
}

void HybridStepExecutor::ResetCounters() {
  attention_->ResetCounters();
  since_guard_ = {};
}

void HybridStepExecutor::ObserveStall() {
  // This step's phases: the counters' growth since the last step.
  const HybridCounters& now = attention_->counters();
  const double cpu = (now.plan_s - since_guard_.plan_s) + (now.host_s - since_guard_.host_s) +
                     (now.finish_s - since_guard_.finish_s);
  const double gpu = (now.to_host_s - since_guard_.to_host_s) + (now.merge_s - since_guard_.merge_s);
  since_guard_ = now;
  guard_.Observe(cpu, gpu);
  attention_->set_budget_scale(guard_.scale());
}

absl::Status HybridStepExecutor::DrawTokens(absl::Span<const StepRequest> batch,
                                            std::vector<int32_t>* tokens,
                                            std::vector<float>* logits) {
  State& s = *state_;
  model::DenseOps& ops = *s.ops;
  const int64_t vocab = s.vocab_size;
  const int64_t rows = static_cast<int64_t>(s.rows.size());
  const float* in_ops = s.runner->ops_logits();  // [rows][vocab], the ops' memory
  // One candidate count for the whole step: the most any row's draw needs (0: none can use them).
  const int64_t max_candidates = std::min(max_candidates_, model::CandidateOps::kMaxCandidates);
  model::CandidateOps* candidate_ops = ops.candidates();
  s.needed.assign(rows, 0);
  int64_t k = 0;
  for (int64_t r = 0; r < rows; ++r) {
    model::Sampler* sampler = batch[s.rows[r]].sampler;
    if (sampler == nullptr || candidate_ops == nullptr) continue;
    s.needed[r] = sampler->CandidatesNeeded(vocab, max_candidates);
    k = std::max(k, s.needed[r]);
  }
  const int64_t n = std::min(k, vocab);
  if (k > 0) {
    s.temperatures.resize(rows);
    for (int64_t r = 0; r < rows; ++r) {
      const model::Sampler* sampler = batch[s.rows[r]].sampler;
      s.temperatures[r] =
          sampler != nullptr ? model::NormaliserTemperature(sampler->params()) : 0.0;
    }
    s.candidate_ids.resize(rows * n);
    s.candidate_logits.resize(rows * n);
    s.normalisers.resize(rows);
    candidate_ops->TopCandidates(in_ops, rows, vocab, k, s.temperatures.data(),
                                 s.candidate_ids.data(), s.candidate_logits.data(),
                                 s.normalisers.data());
    FLUXION_RETURN_IF_ERROR(ops.Sync());
  }
  for (int64_t r = 0; r < rows; ++r) {
    const size_t i = s.rows[r];
    model::Sampler* sampler = batch[i].sampler;
    if (sampler != nullptr && s.needed[r] > 0) {
      model::Candidates c;
      c.ids = absl::MakeConstSpan(s.candidate_ids.data() + r * n, n);
      c.logits = absl::MakeConstSpan(s.candidate_logits.data() + r * n, n);
      c.vocab = vocab;
      c.normaliser = s.normalisers[r];
      if (std::optional<int32_t> token = sampler->SampleCandidates(c)) {
        (*tokens)[i] = *token;
        ++sampling_counters_.candidate_rows;
        continue;
      }
    }
    // The row crosses whole: no sampler, no candidates, or the sampler declined them (its stream
    // has not advanced).
    float* row = logits->data() + i * vocab;
    ops.CopyToHost(row, in_ops + r * vocab, vocab * sizeof(float));
    FLUXION_RETURN_IF_ERROR(ops.Sync());
    ++sampling_counters_.full_rows;
    if (sampler != nullptr) (*tokens)[i] = sampler->Sample(absl::MakeConstSpan(row, vocab));
  }
  return absl::OkStatus();
}

}  // namespace fluxion::decode

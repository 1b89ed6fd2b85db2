#include "decode/step/sparse_attention.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "decode/sparse/policy_util.h"
#include "glog/logging.h"
#include "kernels/cpu/paged_attention_cpu.h"

namespace fluxion::decode {

SparseAttention::SparseAttention(const model::AttentionShape& shape, std::unique_ptr<PagedKv> kv,
                                 const sparse::PolicyConfig& config,
                                 std::vector<std::unique_ptr<sparse::SparsePolicy>> policies)
    : id_(next_id_.fetch_add(1, std::memory_order_relaxed)),
      shape_(shape),
      config_(config),
      kv_(std::move(kv)),
      policies_(std::move(policies)),
      head_stats_(shape.num_kv_heads),
      head_spans_{std::vector<std::vector<kernels::PageSpan>>(shape.num_kv_heads),
                  std::vector<std::vector<kernels::PageSpan>>(shape.num_kv_heads)},
      unit_budget_{std::vector<UnitBudget>(shape.num_kv_heads),
                   std::vector<UnitBudget>(shape.num_kv_heads)},
      rest_out_(shape.num_kv_heads),
      rest_lse_(shape.num_kv_heads) {
  if (sparse::GuardActive(config_)) {
    guard_ = std::make_unique<sparse::ErrorGuard>(
        sparse::GuardFor(config_), static_cast<int>(shape.num_layers),
        static_cast<int>(shape.num_kv_heads),
        [this](int layer, int kv_head) { return PolicyOf(kv_head).MiddleWeight(layer, kv_head); });
  }
}

absl::StatusOr<std::vector<std::unique_ptr<sparse::SparsePolicy>>> SparseAttention::MakePolicies(
    const PagedKv& kv, const model::AttentionShape& shape, const sparse::PolicyConfig& config,
    const model::SparseState* state) {
  const bool per_head = sparse::TraitsOf(config.kind).heads_independent;
  std::vector<std::unique_ptr<sparse::SparsePolicy>> policies(per_head ? shape.num_kv_heads : 1);
  for (auto& p : policies) p = sparse::MakePolicy(config);
  for (int layer = 0; layer < shape.num_layers; ++layer) {
    for (int h = 0; h < shape.num_kv_heads; ++h) {
      FLUXION_RETURN_IF_ERROR(policies[per_head ? h : 0]->Prepare(
          kv, layer, h, state != nullptr ? &state->head(layer, h) : nullptr));
    }
  }
  return policies;
}

void RunPolicyStep(sparse::SparsePolicy& policy, const sparse::SelectionInput& in,
                   std::vector<kernels::PageSpan>* spans, sparse::SelectionStats* stats,
                   float* out, float* lse) {
  spans->clear();
  policy.Select(in, spans, stats);
  const int64_t d = in.kv->shape().head_dim;
  kernels::cpu::PagedAttention(in.kv->view(), spans->data(), spans->size(),
                               {in.q, in.group, in.scale}, {out, lse});
  // A policy may add an estimate for the rows it skipped (lfps_paper's bypass).
  std::vector<float> rest_out(in.group * d), rest_lse(in.group);
  if (policy.ApproximateRest(in, rest_out.data(), rest_lse.data())) {
    kernels::cpu::MergeAttentionStates(out, lse, rest_out.data(), rest_lse.data(), in.group, d);
  }
  policy.Observe(in, *spans);
}

absl::StatusOr<std::unique_ptr<SparseAttention>> SparseAttention::FromDense(
    KvArena* arena, const model::AttentionShape& shape, int64_t page_tokens,
    const model::DenseAttention& prefilled, const sparse::PolicyConfig& policy,
    const model::SparseState* state) {
  const int64_t group = shape.num_heads / shape.num_kv_heads;
  if (!kernels::cpu::PagedAttentionSupported(shape.head_dim, group, page_tokens)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the CPU paged kernel does not support head_dim ", shape.head_dim,
                     ", GQA group ", group, ", page_tokens ", page_tokens));
  }
  KvShape kv_shape{shape.num_layers, shape.num_kv_heads, shape.head_dim, page_tokens};
  FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<PagedKv> kv, PagedKv::Create(arena, kv_shape));
  const int64_t row = shape.num_kv_heads * shape.head_dim;
  for (int layer = 0; layer < shape.num_layers; ++layer) {
    // On failure `kv` is destroyed and returns every page it took.
    FLUXION_RETURN_IF_ERROR(kv->Append(layer, prefilled.length(layer), prefilled.keys(layer),
                                       prefilled.values(layer), row));
  }
  model::SparseState captured;
  const bool needs_state = sparse::TraitsOf(policy.kind).needs_sparse_state;
  if (state == nullptr && needs_state && !prefilled.recorded_positions(0).empty()) {
    model::SparseStateParams params;
    params.sink_tokens = policy.sink_tokens;
    params.local_tokens = policy.local_tokens;
    FLUXION_ASSIGN_OR_RETURN(captured, model::CaptureSparseState(prefilled, shape, params));
    state = &captured;
  }
  FLUXION_ASSIGN_OR_RETURN(auto policies, MakePolicies(*kv, shape, policy, state));
  return std::unique_ptr<SparseAttention>(
      new SparseAttention(shape, std::move(kv), policy, std::move(policies)));
}

absl::StatusOr<std::unique_ptr<SparseAttention>> SparseAttention::FromPages(
    std::unique_ptr<PagedKv> kv, const model::AttentionShape& shape,
    const sparse::PolicyConfig& policy, const model::SparseState* state) {
  const int64_t group = shape.num_heads / shape.num_kv_heads;
  const int64_t page_tokens = kv->shape().page_tokens;
  if (!kernels::cpu::PagedAttentionSupported(shape.head_dim, group, page_tokens)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the CPU paged kernel does not support head_dim ", shape.head_dim,
                     ", GQA group ", group, ", page_tokens ", page_tokens));
  }
  FLUXION_ASSIGN_OR_RETURN(auto policies, MakePolicies(*kv, shape, policy, state));
  return std::unique_ptr<SparseAttention>(
      new SparseAttention(shape, std::move(kv), policy, std::move(policies)));
}

absl::Status SparseAttention::AppendToken(int layer, int64_t pos0, const float* k,
                                          const float* v) {
  if (layer < 0 || layer >= shape_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range"));
  }
  if (pos0 != kv_->length(layer)) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, ": tokens start at ", pos0,
                                                   " but the pages hold ", kv_->length(layer)));
  }
  // The policies' scratch of this layer's parity is the pending observation's: it ends first.
  if (pending_.active && (pending_.layer & 1) == (layer & 1)) FlushObserve();
  FLUXION_RETURN_IF_ERROR(kv_->Append(layer, 1, k, v, shape_.num_kv_heads * shape_.head_dim));
  step_layer_ = layer;
  step_context_ = pos0 + 1;
  if (guard_ != nullptr && layer == 0) guard_->BeginStep();  // layer 0 starts a decode step
  return absl::OkStatus();
}

bool SparseAttention::GuardDue() const {
  if (guard_ == nullptr) return false;
  for (int h = 0; h < shape_.num_kv_heads; ++h) {
    if (guard_->Due(step_layer_, h)) return true;
  }
  return false;
}

void SparseAttention::CheckLayer(const float* q, const float* out) {
  if (!GuardDue()) return;
  // A degenerate point (sinks + window cover the budget): the guard could move no row, so a
  // check would only read (docs/SPARSE.md).
  if (sparse::SplitContext(config_, step_context_).middle_rows_budget == 0) return;
  const int64_t d = shape_.head_dim, hkv = shape_.num_kv_heads;
  const int64_t group = shape_.num_heads / hkv, hd = group * d;
  const model::OutputProjection& proj = *config_.output_projection;
  if (step_layer_ >= proj.num_layers() || proj.width() != shape_.num_heads * d) return;
  check_out_.resize(hd);
  check_lse_.resize(group);
  for (int h = 0; h < hkv; ++h) {
    if (!guard_->Due(step_layer_, h)) continue;
    // The head exactly: every row of the context.
    check_spans_.clear();
    sparse::AppendTokenRange(*kv_, step_layer_, h, 0, step_context_, &check_spans_);
    kernels::cpu::PagedAttention(kv_->view(), check_spans_.data(), check_spans_.size(),
                                 {q + h * hd, group, shape_.scale},
                                 {check_out_.data(), check_lse_.data()});
    // The layer's output with this head exact: the denominator of e_h (the other heads'
    // exact outputs are not known; theirs are the step's sparse ones).
    check_layer_.assign(out, out + shape_.num_heads * d);
    std::copy(check_out_.begin(), check_out_.end(), check_layer_.begin() + h * hd);
    const double total = proj.Norm(step_layer_, check_layer_.data());
    const double error = model::HeadOutputError(proj, step_layer_, h * hd, check_out_.data(),
                                                out + h * hd, hd, total);
    guard_->Report(step_layer_, h, error, step_context_);
  }
}

sparse::GuardStats SparseAttention::guard_stats() const {
  return guard_ != nullptr ? guard_->stats() : sparse::GuardStats{};
}

sparse::SelectionInput SparseAttention::Input(int kv_head, const float* q) const {
  const int64_t group = shape_.num_heads / shape_.num_kv_heads;
  // Query heads kv_head*group .. kv_head*group+group-1 share the KV head and sit together.
  return {kv_.get(), step_layer_, kv_head, q + kv_head * group * shape_.head_dim, group,
          shape_.scale, step_context_};
}

void SparseAttention::SelectUnit(int unit, const float* q, const sparse::ScoredBlocks& scored,
                                 double budget_scale) {
  const int h = unit;
  CHECK(!pending_.active || (pending_.layer & 1) != (step_layer_ & 1))
      << "SelectUnit over a pending observation's scratch";
  std::vector<kernels::PageSpan>& spans = head_spans_[step_layer_ & 1][h];
  spans.clear();
  sparse::SelectionInput in = Input(h, q);
  in.budget_scale = budget_scale;
  if (guard_ != nullptr) in.budget_shift = guard_->Shift(step_layer_, h);
  unit_budget_[step_layer_ & 1][h] = {in.budget_scale, in.budget_shift};
  if (scored.data != nullptr) {
    in.block_scores = scored.data + h * scored.head_stride;
    in.block_score_tokens = scored.block_tokens;
  }
  if (scored.top != nullptr) {
    in.top_blocks = scored.top + h * scored.range.want;
    in.top_range = scored.range;
  }
  if (scored.picks != nullptr) {
    in.device_picks = scored.picks + scored.pick_offset[h];
    in.device_pick_count = scored.pick_count[h];
  }
  PolicyOf(unit).Select(in, &spans, &head_stats_[h]);
}

std::optional<sparse::DeviceAsk> SparseAttention::DevicePick(int unit, int layer,
                                                             int64_t position,
                                                             double budget_scale) const {
  sparse::SelectionInput in{kv_.get(), layer, unit, nullptr,
                            shape_.num_heads / shape_.num_kv_heads, shape_.scale, position + 1};
  in.budget_scale = budget_scale;
  if (guard_ != nullptr) in.budget_shift = guard_->Shift(layer, unit);
  return PolicyOf(unit).DevicePick(in);
}

void SparseAttention::CompleteUnit(int unit, const float* q, float* out, float* lse) {
  const int h = unit;
  const int64_t d = shape_.head_dim, group = shape_.num_heads / shape_.num_kv_heads;
  std::vector<float>& rest_out = rest_out_[unit];
  std::vector<float>& rest_lse = rest_lse_[unit];
  rest_out.resize(group * d);
  rest_lse.resize(group);
  // A policy may add an estimate for the rows it skipped (lfps_paper's bypass).
  if (PolicyOf(unit).ApproximateRest(Input(h, q), rest_out.data(), rest_lse.data())) {
    kernels::cpu::MergeAttentionStates(out + h * group * d, lse + h * group, rest_out.data(),
                                       rest_lse.data(), group, d);
  }
}

void SparseAttention::FinishUnit(int unit, const float* q, float* out, float* lse) {
  CompleteUnit(unit, q, out, lse);
  PolicyOf(unit).Observe(Input(unit, q), head_spans_[step_layer_ & 1][unit]);
}

void SparseAttention::DeferObserve(const float* q) {
  CHECK(!pending_.active) << "DeferObserve with an observation pending";
  pending_.active = true;
  pending_.layer = step_layer_;
  pending_.context = step_context_;
  pending_.q.assign(q, q + shape_.num_heads * shape_.head_dim);
}

void SparseAttention::ObservePending(int unit) {
  const int h = unit, parity = pending_.layer & 1;
  const int64_t group = shape_.num_heads / shape_.num_kv_heads;
  sparse::SelectionInput in{kv_.get(),   pending_.layer,
                            h,           pending_.q.data() + h * group * shape_.head_dim,
                            group,       shape_.scale,
                            pending_.context};
  in.budget_scale = unit_budget_[parity][h].scale;
  in.budget_shift = unit_budget_[parity][h].shift;
  sparse::SparsePolicy& policy = PolicyOf(unit);
  policy.Observe(in, head_spans_[parity][h]);
  // The next step of this (layer, head), as far as it is known now: one token more, the same
  // budget scale and guard shift (Select checks the prepared part against what it then gets).
  sparse::SelectionInput next = in;
  next.q = nullptr;
  next.context += 1;
  policy.PrepareNextStep(next);
}

void SparseAttention::FlushObserve() {
  if (!pending_.active) return;
  for (int u = 0; u < units(); ++u) ObservePending(u);
  EndObserve();
}

absl::Status SparseAttention::BeginDecode(int layer, int64_t pos0, const float* q,
                                          const float* k, const float* v) {
  FLUXION_RETURN_IF_ERROR(AppendToken(layer, pos0, k, v));
  for (int u = 0; u < units(); ++u) SelectUnit(u, q);
  return absl::OkStatus();
}

void SparseAttention::FinishDecode(const float* q, float* out, float* lse) {
  for (int u = 0; u < units(); ++u) FinishUnit(u, q, out, lse);
}

sparse::SelectionStats SparseAttention::stats() const {
  sparse::SelectionStats sum;
  for (const sparse::SelectionStats& s : head_stats_) sum.Add(s);
  return sum;
}

absl::Status SparseAttention::Forward(int layer, int64_t pos0, int64_t n, const float* q,
                                      const float* k, const float* v, float* out) {
  FlushObserve();  // this path observes at once (FinishDecode)
  if (n == 1) {
    FLUXION_RETURN_IF_ERROR(BeginDecode(layer, pos0, q, k, v));
    const int64_t d = shape_.head_dim, hkv = shape_.num_kv_heads;
    const int64_t group = shape_.num_heads / hkv;
    const kernels::PagedKvView view = kv_->view();
    tasks_.resize(hkv);
    head_lse_.resize(hkv * group);
    for (int kvh = 0; kvh < hkv; ++kvh) {
      const std::vector<kernels::PageSpan>& spans = head_spans_[layer & 1][kvh];
      tasks_[kvh] = {view, spans.data(), static_cast<int64_t>(spans.size()),
                     {q + kvh * group * d, group, shape_.scale},
                     {out + kvh * group * d, &head_lse_[kvh * group]}};
    }
    kernels::cpu::PagedAttentionBatch(tasks_.data(), hkv, 0);
    FinishDecode(q, out, head_lse_.data());
    CheckLayer(q, out);
    return absl::OkStatus();
  }
  if (layer < 0 || layer >= shape_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range"));
  }
  if (pos0 != kv_->length(layer)) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, ": tokens start at ", pos0,
                                                   " but the pages hold ", kv_->length(layer)));
  }
  const int64_t d = shape_.head_dim, hq = shape_.num_heads, hkv = shape_.num_kv_heads;
  const int64_t group = hq / hkv;
  FLUXION_RETURN_IF_ERROR(kv_->Append(layer, n, k, v, hkv * d));
  lse_.resize(group);
  const kernels::PagedKvView view = kv_->view();
  // More prompt (n > 1): causal full attention over the pages, row by row.
  for (int64_t i = 0; i < n; ++i) {
    const int64_t context = pos0 + i + 1;
    for (int kvh = 0; kvh < hkv; ++kvh) {
      const float* qg = q + (i * hq + kvh * group) * d;
      float* og = out + (i * hq + kvh * group) * d;
      spans_.clear();
      sparse::AppendTokenRange(*kv_, layer, kvh, 0, context, &spans_);
      kernels::cpu::PagedAttention(view, spans_.data(), spans_.size(), {qg, group, shape_.scale},
                                   {og, lse_.data()});
    }
  }
  return absl::OkStatus();
}

}  // namespace fluxion::decode

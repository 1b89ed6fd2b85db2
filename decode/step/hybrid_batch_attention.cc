#include "decode/step/hybrid_batch_attention.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "decode/step/paged_batch_attention.h"

namespace fluxion::decode {
// Adds the seconds since the last call (or construction) to a counter.
class HybridBatchAttention::PhaseClock {
 public:
  void Lap(double* counter) {
    const auto now = std::chrono::steady_clock::now();
    *counter += std::chrono::duration<double>(now - last_).count();
    last_ = now;
  }

 private:
  std::chrono::steady_clock::time_point last_ = std::chrono::steady_clock::now();
};

void AddCounters(const HybridCounters& from, HybridCounters* to) {
  to->resident_rows += from.resident_rows;
  to->host_rows += from.host_rows;
  to->mapped_rows += from.mapped_rows;
  to->host_pairs += from.host_pairs;
  to->pairs += from.pairs;
  to->layers_observed_in_finish += from.layers_observed_in_finish;
  to->to_host_s += from.to_host_s;
  to->plan_s += from.plan_s;
  to->append_s += from.append_s;
  to->scores_s += from.scores_s;
  to->select_s += from.select_s;
  to->host_s += from.host_s;
  to->host_prep_s += from.host_prep_s;
  to->host_kernel_s += from.host_kernel_s;
  to->finish_s += from.finish_s;
  to->merge_s += from.merge_s;
  to->guard_s += from.guard_s;
  to->lane_wait_s += from.lane_wait_s;
}

void TrimSpans(const kernels::PageSpan* begin, const kernels::PageSpan* end, int64_t front,
               int64_t back, std::vector<kernels::PageSpan>* out) {
  // Drop `back` rows from the end first (on a local end pointer and a cut last span).
  kernels::PageSpan last{};
  bool cut_last = false;
  while (back > 0 && end > begin) {
    const kernels::PageSpan& s = *(end - 1);
    if (s.rows <= back) {
      back -= s.rows;
      --end;
    } else {
      last = {s.page, s.first_row, static_cast<int32_t>(s.rows - back)};
      cut_last = true;
      --end;
      back = 0;
    }
  }
  // Then `front` rows from the start; what remains goes out in order.
  for (const kernels::PageSpan* s = begin; s < end; ++s) {
    if (front >= s->rows) {
      front -= s->rows;
      continue;
    }
    out->push_back({s->page, static_cast<int32_t>(s->first_row + front),
                    static_cast<int32_t>(s->rows - front)});
    front = 0;
  }
  if (cut_last) {
    if (front >= last.rows) return;
    out->push_back({last.page, static_cast<int32_t>(last.first_row + front),
                    static_cast<int32_t>(last.rows - front)});
  }
}

void SplitSpans(const kernels::PageSpan* begin, const kernels::PageSpan* end, int64_t front_rows,
                std::vector<kernels::PageSpan>* front, std::vector<kernels::PageSpan>* rest) {
  for (const kernels::PageSpan* s = begin; s < end; ++s) {
    if (front_rows >= s->rows) {
      front->push_back(*s);
      front_rows -= s->rows;
    } else if (front_rows > 0) {
      const int32_t cut = static_cast<int32_t>(front_rows);
      front->push_back({s->page, s->first_row, cut});
      rest->push_back({s->page, s->first_row + cut, s->rows - cut});
      front_rows = 0;
    } else {
      rest->push_back(*s);
    }
  }
}

int64_t DeviceRows(int64_t host_rows, double device_share) {
  return std::clamp<int64_t>(std::llround(device_share * static_cast<double>(host_rows)), 0,
                             host_rows);
}

absl::Status HybridBatchAttention::Attend(const model::LayerAttentionIo& io) {
  if (io.rows != static_cast<int64_t>(attentions_.size()) || seqs_.size() != attentions_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("attention for ", io.rows, " rows but ",
                                                   attentions_.size(), " requests"));
  }
  PhaseClock clock;
  // The CPU half reads q/k/v on the host (the copies wait for the layer's projections).
  const model::HostRows rows = model::RowsOnHost(io, shape_, ops_, &q_, &k_, &v_);
  // Then the device half, which runs while the CPU works: block scores for the policies that
  // rank page bounds, the rings' append and the resident rows of every pair, into io.out.
  window_->ScoreBlocks(io.layer, io.q, io.k);
  if (window_->shape().compact_slots > 0) {
    AskDevicePicks(io);
    window_->SelectRows(io.layer, io.q, io.k, asked_, asked_masks_);
  }
  window_->AppendAndAttend(io.layer, io.q, io.k, io.v, io.out);
  clock.Lap(&counters_.to_host_s);
  if (lane_ == nullptr) {
    FLUXION_RETURN_IF_ERROR(CpuPhase(io, rows.q, rows.k, rows.v, &clock));
  } else {
    // The wait for the device's block scores comes before the lane: waiting for the device is
    // no CPU work, and the other micro-batch's CPU phase can run meanwhile. (Without a lane the
    // host append overlaps the scoring instead.)
    double early_scores_s = 0;
    FLUXION_RETURN_IF_ERROR(window_->WaitBlockScores());
    clock.Lap(&early_scores_s);
    // The device work above (and the other micro-batch's) goes on during the lane's wait and
    // the phase.
    FLUXION_RETURN_IF_ERROR(lane_->Run([&]() -> absl::Status {
      clock.Lap(&counters_.lane_wait_s);
      counters_.scores_s += early_scores_s;
      counters_.plan_s += early_scores_s;
      return CpuPhase(io, rows.q, rows.k, rows.v, &clock);
    }));
  }
  window_->MergeHostStates(host_out_.data(), host_lse_.data(), io.out);
  clock.Lap(&counters_.merge_s);
  // The guard's checks run on the pool too: through the lane when there is one, and only when
  // some check is due (a lane round trip queues behind the other micro-batch's CPU phase: taken
  // every layer, it held each half back by the other's phase).
  if (GuardDue()) {
    FLUXION_RETURN_IF_ERROR(RunOnLane(lane_, [&] { return GuardChecks(io, rows.q); }));
  }
  clock.Lap(&counters_.guard_s);

  if (io.layer == shape_.num_layers - 1) {
    FLUXION_RETURN_IF_ERROR(window_->Sync());
    for (model::Sequence* seq : seqs_) seq->AdvanceLength(1);
  }
  return absl::OkStatus();
}

absl::Status HybridBatchAttention::CpuPhase(const model::LayerAttentionIo& io, const float* q,
                                            const float* k, const float* v, PhaseClock* clock) {
  const int64_t d = shape_.head_dim, hq = shape_.num_heads, hkv = shape_.num_kv_heads;
  const int64_t q_row = hq * d, kv_row = hkv * d;
  PhaseClock plan_parts;  // the three parts of plan_s
  statuses_.assign(io.rows, absl::OkStatus());
  ForEachRequest(pool_, io.rows, [&](int64_t i) {
    statuses_[i] = attentions_[i]->AppendToken(io.layer, io.positions[i], k + i * kv_row,
                                               v + i * kv_row);
  });
  FLUXION_RETURN_IF_ERROR(FirstRequestError(statuses_, io.layer));
  plan_parts.Lap(&counters_.append_s);
  if (lane_ == nullptr) FLUXION_RETURN_IF_ERROR(window_->WaitBlockScores());
  plan_parts.Lap(&counters_.scores_s);
  ListUnits(attentions_, &units_);
  // One arena for the batch; the device reads its zero-copy share through the window's view of
  // it (none: the CPU reads every host row).
  FLUXION_ASSIGN_OR_RETURN(const kernels::PagedKvView view, BatchArenaView(attentions_));
  std::optional<kernels::PagedKvView> mapped;
  if (device_share_ > 0) {
    absl::StatusOr<kernels::PagedKvView> m = window_->MappedView(view);
    if (m.ok()) mapped = *m;  // not pinned, or a shape the device kernel lacks: the CPU reads all
  }
  pair_plans_.resize(attentions_.size() * hkv);
  // The previous layer's observations (FinishUnit's second half, deferred) run beside this
  // layer's selections: they are listed after them, so the pool's threads take the selections
  // first, and at small batches (fewer selections than threads) the rest observe instead of
  // waiting at the barrier. Each observation also makes the next step's table picks
  // (SparsePolicy::PrepareNextStep), which leaves the selections less to do.
  pending_units_.clear();
  for (size_t i = 0; i < attentions_.size(); ++i) {
    if (!attentions_[i]->observe_pending()) continue;
    for (int u = 0; u < attentions_[i]->units(); ++u) {
      pending_units_.push_back({static_cast<int32_t>(i), u});
    }
  }
  const int64_t selections = static_cast<int64_t>(units_.size());
  ForEachRequest(pool_, selections + static_cast<int64_t>(pending_units_.size()),
                 [&](int64_t j) {
                   if (j >= selections) {
                     const RequestUnit& u = pending_units_[j - selections];
                     attentions_[u.request]->ObservePending(u.unit);
                     return;
                   }
                   const RequestUnit& u = units_[j];
                   attentions_[u.request]->SelectUnit(
                       u.unit, q + u.request * q_row,
                       window_->block_scores(static_cast<int>(u.request)), budget_scale_);
                   PlanPair(io, u.request, u.unit, mapped.has_value());
                 });
  for (SparseAttention* a : attentions_) {
    if (a->observe_pending()) a->EndObserve();
  }
  plan_parts.Lap(&counters_.select_s);
  clock->Lap(&counters_.plan_s);

  PhaseClock host_parts;  // the two parts of host_s
  kernels::PagedDecodeProblem p;
  FLUXION_RETURN_IF_ERROR(AssembleHostProblem(io, q, view, &p));
  if (mapped.has_value() && !device_spans_.empty()) {
    // The device starts now, while the CPU attends its part.
    window_->AttendMappedSpans(*mapped, device_indptr_.data(), device_spans_.data(),
                               static_cast<int64_t>(device_spans_.size()), io.q, io.out);
  }
  FLUXION_RETURN_IF_ERROR(backend_->Supports(p));
  const size_t workspace = backend_->WorkspaceBytes(p);
  if (workspace_.size() < workspace) workspace_.resize(workspace);
  host_parts.Lap(&counters_.host_prep_s);
  FLUXION_RETURN_IF_ERROR(backend_->Run(p, absl::MakeSpan(workspace_)));
  host_parts.Lap(&counters_.host_kernel_s);
  clock->Lap(&counters_.host_s);
  // Each policy completes its step on the CPU partial: its estimate of the skipped rows merges
  // in there (merging is associative). It observes its whole plan later, beside the next
  // layer's selections (above).
  // When the layer's selections fill the pool there are no idle threads for the observations
  // to use in the next layer, and running them there made the selections slower than running
  // them here (4 x 128K at 8B shapes, 16 threads, 32 selections a layer: step 725 -> 807 ms on
  // the H200 host): they run now, each unit's right after its completion, as FinishUnit does.
  // The rows selected are the same either way.
  for (size_t i = 0; i < attentions_.size(); ++i) attentions_[i]->DeferObserve(q + i * q_row);
  const bool observe_now = ObserveInFinish(static_cast<int64_t>(units_.size()));
  ForEachRequest(pool_, static_cast<int64_t>(units_.size()), [&](int64_t j) {
    const RequestUnit& u = units_[j];
    attentions_[u.request]->CompleteUnit(u.unit, q + u.request * q_row,
                                         host_out_.data() + u.request * q_row,
                                         host_lse_.data() + u.request * hq);
    if (observe_now) attentions_[u.request]->ObservePending(u.unit);
  });
  if (observe_now) {
    for (SparseAttention* a : attentions_) a->EndObserve();
    ++counters_.layers_observed_in_finish;
  }
  clock->Lap(&counters_.finish_s);
  return absl::OkStatus();
}

void HybridBatchAttention::AskDevicePicks(const model::LayerAttentionIo& io) {
  const int64_t hkv = shape_.num_kv_heads;
  asked_.assign(io.rows * hkv, kernels::CompactPick{0, 0, -1});
  asked_masks_.clear();
  for (int64_t i = 0; i < io.rows; ++i) {
    for (int64_t h = 0; h < hkv; ++h) {
      const std::optional<sparse::DeviceAsk> a = attentions_[i]->DevicePick(
          static_cast<int>(h), io.layer, io.positions[i], budget_scale_);
      if (!a.has_value()) continue;
      kernels::CompactPick& p = asked_[i * hkv + h];
      p = a->pick;
      if (a->candidates != nullptr && p.k > 0) {
        p.mask = static_cast<int32_t>(asked_masks_.size());
        asked_masks_.insert(asked_masks_.end(), a->candidates->begin(), a->candidates->end());
      }
    }
  }
}

bool HybridBatchAttention::ObserveInFinish(int64_t selections) const {
  const int threads = pool_ == nullptr ? 1 : pool_->threads();
  return selections >= threads;
}

bool HybridBatchAttention::GuardDue() const {
  for (SparseAttention* a : attentions_) {
    if (a->GuardDue()) return true;
  }
  return false;
}

absl::Status HybridBatchAttention::GuardChecks(const model::LayerAttentionIo& io,
                                               const float* q) {
  // The checks compare the step's final output (the window's rows merged in) with the exact one:
  // on a device, the layer's output comes to the host first. The copy is issued on the dense
  // ops' stream, after the merge, so it returns the merged rows.
  const int64_t q_row = shape_.num_heads * shape_.head_dim;
  const float* out = io.out;
  if (!io.host_memory) {
    out_host_.resize(io.rows * q_row);
    ops_->CopyToHost(out_host_.data(), io.out, out_host_.size() * sizeof(float));
    FLUXION_RETURN_IF_ERROR(ops_->Sync());
    out = out_host_.data();
  }
  ForEachRequest(pool_, io.rows, [&](int64_t i) {
    attentions_[i]->CheckLayer(q + i * q_row, out + i * q_row);
  });
  return absl::OkStatus();
}

void HybridBatchAttention::PlanPair(const model::LayerAttentionIo& io, int64_t i, int64_t h,
                                    bool mapped) {
  PairPlan& pp = pair_plans_[i * shape_.num_kv_heads + h];
  pp.device.clear();
  pp.cpu.clear();
  const std::vector<kernels::PageSpan>& plan = attentions_[i]->head_spans(static_cast<int>(h));
  // The resident rows are the plan's first and last ones (see the header).
  const WindowShape& w = window_->shape();
  const int64_t context = io.positions[i] + 1;
  const int64_t front = std::min(context, w.sink_tokens);
  const int64_t back = w.resident_rows(context) - front;
  pp.resident_rows = front + back;
  auto rows_of = [](const std::vector<kernels::PageSpan>& spans) {
    int64_t rows = 0;
    for (const kernels::PageSpan& s : spans) rows += s.rows;
    return rows;
  };
  if (!mapped) {
    TrimSpans(plan.data(), plan.data() + plan.size(), front, back, &pp.cpu);
    pp.host_rows = rows_of(pp.cpu);
    pp.device_rows = 0;
    return;
  }
  pp.trimmed.clear();
  TrimSpans(plan.data(), plan.data() + plan.size(), front, back, &pp.trimmed);
  pp.host_rows = rows_of(pp.trimmed);
  pp.device_rows = DeviceRows(pp.host_rows, device_share_);
  SplitSpans(pp.trimmed.data(), pp.trimmed.data() + pp.trimmed.size(), pp.device_rows,
             &pp.device, &pp.cpu);
}

absl::Status HybridBatchAttention::AssembleHostProblem(const model::LayerAttentionIo& io,
                                                       const float* q,
                                                       const kernels::PagedKvView& view,
                                                       kernels::PagedDecodeProblem* p) {
  size_t cpu_spans = 0, device_spans = 0;
  for (const PairPlan& pp : pair_plans_) {
    cpu_spans += pp.cpu.size();
    device_spans += pp.device.size();
  }
  spans_.resize(cpu_spans);
  device_spans_.resize(device_spans);
  indptr_.assign(1, 0);
  device_indptr_.assign(1, 0);
  size_t at = 0, device_at = 0;
  for (const PairPlan& pp : pair_plans_) {
    std::copy(pp.cpu.begin(), pp.cpu.end(), spans_.begin() + at);
    at += pp.cpu.size();
    indptr_.push_back(static_cast<int64_t>(at));
    std::copy(pp.device.begin(), pp.device.end(), device_spans_.begin() + device_at);
    device_at += pp.device.size();
    device_indptr_.push_back(static_cast<int64_t>(device_at));
    counters_.resident_rows += pp.resident_rows;
    counters_.host_rows += pp.host_rows - pp.device_rows;
    counters_.mapped_rows += pp.device_rows;
    counters_.host_pairs += pp.host_rows > 0;
    ++counters_.pairs;
  }
  p->kv = view;
  p->span_indptr = indptr_.data();
  p->spans = spans_.data();
  p->num_spans = static_cast<int64_t>(spans_.size());
  p->num_requests = io.rows;
  p->num_qo_heads = shape_.num_heads;
  p->num_kv_heads = shape_.num_kv_heads;
  p->head_dim = shape_.head_dim;
  p->sm_scale = shape_.scale;
  host_out_.resize(io.rows * shape_.num_heads * shape_.head_dim);
  host_lse_.resize(io.rows * shape_.num_heads);
  p->q = q;
  p->out = host_out_.data();
  p->lse = host_lse_.data();
  return absl::OkStatus();
}

}  // namespace fluxion::decode

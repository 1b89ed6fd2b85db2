#include "decode/sparse/fluxion_policy.h"

#include <algorithm>
#include <cmath>

#include "decode/sparse/policy_util.h"
#include "glog/logging.h"
#include "kernels/cpu/selection.h"
#include "kernels/cpu/topk.h"

namespace fluxion::decode::sparse {

FluxionPolicy::FluxionPolicy(const PolicyConfig& config,
                             std::shared_ptr<const FluxionPredictor> predictor)
    : LfpsPolicy(config, LfpsParams{}, /*paper_bypass=*/false), predictor_(std::move(predictor)) {}

absl::Status FluxionPolicy::Prepare(const PagedKv& kv, int layer, int kv_head,
                                    const model::HeadSparseState* state) {
  if (state != nullptr) {
    // Only the five scalar features: the tables are LFPS's and stay there.
    model::HeadSparseState f;
    f.middle_share = state->middle_share;
    f.need_fraction = state->need_fraction;
    f.sink_mass = state->sink_mass;
    f.local_mass = state->local_mass;
    f.entropy = state->entropy;
    features_[{layer, kv_head}] = f;
    // The prefill tail's attention mass per middle token (the vertical table), summed per block
    // of each candidate size: the coverage side of the granularity choice.
    const int64_t n = std::min<int64_t>(state->vertical.size(), kv.length(layer));
    const Regions r = SplitContext(config_, n);
    std::vector<double> mass(state->vertical.begin() + r.sink_end,
                             state->vertical.begin() + std::max(r.sink_end, r.local_begin));
    HeadScan& h = scans_[{layer, kv_head}];
    h.block_mass.clear();
    for (int64_t b : kFluxionBlocks) h.block_mass.push_back(BlockMass(mass, r.sink_end, b));
  } else {
    scans_.try_emplace({layer, kv_head});  // every head has its entry before the first step
  }
  return LfpsPolicy::Prepare(kv, layer, kv_head, state);
}

void FluxionPolicy::Select(const SelectionInput& in, std::vector<kernels::PageSpan>* spans,
                           SelectionStats* stats) {
  if (!DeviceSelects(config_)) {
    LfpsPolicy::Select(in, spans, stats);
    return;
  }
  const Regions r = StepRegions(in);
  ++stats->selections;
  std::vector<kernels::PageSpan>& middle = ScratchOf(in.layer, in.kv_head).middle;
  middle.clear();
  if (r.middle_rows_budget <= 0 || r.local_begin <= r.sink_end) {
    ++stats->streaming;
  } else {
    ScratchOf(in.layer, in.kv_head).compact.SelectMiddle(in, DeviceAskOf(r), &middle, stats);
  }
  AssembleSpans(in, r, middle, spans, stats);
}

void FluxionPolicy::Observe(const SelectionInput& in,
                            const std::vector<kernels::PageSpan>& spans) {
  if (!DeviceSelects(config_)) LfpsPolicy::Observe(in, spans);  // no tables to keep otherwise
}

void FluxionPolicy::PrepareNextStep(const SelectionInput& next) {
  if (!DeviceSelects(config_)) LfpsPolicy::PrepareNextStep(next);
}

std::optional<DeviceAsk> FluxionPolicy::DevicePick(const SelectionInput& in) {
  if (!DeviceSelects(config_)) return std::nullopt;
  return DeviceAskOf(StepRegions(in));
}

void FluxionPolicy::Allocate() {
  double total = 0;
  if (predictor_ != nullptr) {
    // Every layer of the model is prepared before the first step, so the largest layer seen
    // gives num_layers (a replay of one layer sees layer 0 only, and layer_frac 0).
    int num_layers = 0;
    for (const auto& [key, f] : features_) num_layers = std::max(num_layers, key.first + 1);
    for (const auto& [key, f] : features_) {
      const HeadPrediction p = predictor_->Predict(HeadFeatures(f, key.first, num_layers));
      weight_[key] = p.tier;  // 0 for a streaming head
      total += p.tier;
    }
  } else {
    for (const auto& [key, s] : states_) {
      const double share = s.MiddleShare();
      const bool streaming = share < 1.0 - params_.bypass_rho;
      const double w = streaming ? 0.0 : share * std::max(s.need_fraction, 1e-3);
      weight_[key] = w;
      total += w;
    }
  }
  const double heads = static_cast<double>(weight_.size());
  // An all-streaming request: the predictor means it (nothing from the middle); the rules keep
  // v1's uniform split.
  const double all_streaming = predictor_ != nullptr ? 0.0 : 1.0;
  for (auto& [key, w] : weight_) w = total > 0 ? w * heads / total : all_streaming;
}

double FluxionPolicy::HeadWeight(int layer, int kv_head) {
  // Heads select in parallel: the first to ask allocates, the others wait for it.
  absl::call_once(allocated_, &FluxionPolicy::Allocate, this);
  auto it = weight_.find({layer, kv_head});
  return it == weight_.end() ? 1.0 : it->second;
}

double FluxionPolicy::MiddleWeight(int layer, int kv_head) {
  return replaying() ? LfpsPolicy::MiddleWeight(layer, kv_head) : HeadWeight(layer, kv_head);
}

int64_t FluxionPolicy::MiddleBudget(int layer, int kv_head, const Regions& r, int64_t context) {
  // All heads are prepared before the first decode step; heads never seen at prefill (no tail
  // recorded) keep the uniform budget.
  const double w = HeadWeight(layer, kv_head);
  const int64_t middle = r.local_begin - r.sink_end;
  return std::clamp<int64_t>(static_cast<int64_t>(std::llround(w * r.middle_rows_budget)), 0,
                             middle);
}

FluxionPolicy::HeadScan& FluxionPolicy::Scan(int layer, int kv_head) {
  // find, not operator[]: heads look up their entries concurrently, and operator[] may insert.
  auto it = scans_.find({layer, kv_head});
  if (it == scans_.end()) it = scans_.try_emplace({layer, kv_head}).first;  // not prepared
  return it->second;
}

const FluxionPolicy::HeadScan* FluxionPolicy::FindScan(int layer, int kv_head) const {
  auto it = scans_.find({layer, kv_head});
  return it == scans_.end() ? nullptr : &it->second;
}

const float* FluxionPolicy::PageScores(const SelectionInput& in, int64_t first_page,
                                       int64_t end_page, SelectionStats* stats) {
  const int64_t pt = in.kv->shape().page_tokens, d = in.kv->shape().head_dim;
  const int64_t pages = end_page - first_page;
  if (in.block_scores != nullptr && in.block_score_tokens == pt) {
    stats->blocks_scored_elsewhere += pages;
    return in.block_scores + first_page;
  }
  std::vector<float>& out = ScratchOf(in.layer, in.kv_head).page_scores;
  out.resize(pages);
  kernels::cpu::QuestBlockBounds(in.kv->key_min(in.layer, in.kv_head),
                                 in.kv->key_max(in.layer, in.kv_head), d, first_page, pages,
                                 /*pages_per_block=*/1, in.q, in.group, out.data());
  stats->metadata_bytes += pages * 2 * d * int64_t{sizeof(float)};
  return out.data();
}

void FluxionPolicy::AddCandidates(const SelectionInput& in, const Regions& r, int64_t k,
                                  CandidateMarks* marks, SelectionStats* stats) {
  HeadScan& h = Scan(in.layer, in.kv_head);
  Scratch& x = ScratchOf(in.layer, in.kv_head);
  const int64_t middle = r.local_begin - r.sink_end;
  const StepShape shape{middle, k, in.kv->shape().head_dim, kScanOver, kScanMinBlocks};
  // Granularity for this head (§2.4.4): chosen at the first step, again when the context grew by
  // more than 25% (the cost terms scale with it; the coverage comes from the prefill). Under a
  // decision profile the block is the profile's.
  if (h.block == 0 || in.context * 4 > h.chosen_at_context * 5) {
    h.block = replaying() ? Replay(in.layer, in.kv_head).block_tokens
                          : ChooseGranularity(config_.host_cost, shape, h.coverage(k),
                                              kCoverageTolerance)
                                .block;
    h.chosen_at_context = in.context;
  }
  // Blocks align to absolute positions and hold whole pages (a block below the page size scans
  // at the page).
  const int64_t pt = in.kv->shape().page_tokens;
  const int64_t block = std::max(h.block, pt);
  const int64_t ppb = block / pt;
  const int64_t first_block = r.sink_end / block;
  const int64_t end_block = (r.local_begin + block - 1) / block;
  const int64_t nblocks = end_block - first_block;
  const int64_t want = std::min(nblocks, ScanBlocks(shape, block));
  if (want <= 0) return;
  const int64_t pages = (in.context + pt - 1) / pt;
  const int64_t first_page = first_block * ppb;
  const int64_t end_page = std::min(end_block * ppb, pages);
  const float* page_scores = PageScores(in, first_page, end_page, stats);
  // A block scores as its best page.
  x.block_scores.assign(nblocks, -INFINITY);
  for (int64_t p = first_page; p < end_page; ++p) {
    float& b = x.block_scores[(p - first_page) / ppb];
    b = std::max(b, page_scores[p - first_page]);
  }
  kernels::cpu::TopKIndices(x.block_scores.data(), nblocks, want, &x.top_blocks);
  for (int32_t b : x.top_blocks) {
    marks->MarkRun((first_block + b) * block, block);  // clipped to the middle
  }
}

std::vector<double> FluxionPolicy::HeadScan::coverage(int64_t k) const {
  std::vector<double> out;
  for (size_t i = 0; i < std::size(kFluxionBlocks); ++i) {
    const int64_t b = kFluxionBlocks[i];
    const int64_t rows = std::max(kScanOver * k, kScanMinBlocks * b);
    out.push_back(i < block_mass.size() ? BlockCoverage(block_mass[i], b, rows) : 1.0);
  }
  return out;
}

int64_t FluxionPolicy::RetrievalBlock(int layer, int kv_head) {
  // A refresh step before the head's first scan has no block yet: the one it will choose.
  const int64_t block = HeadBlock(layer, kv_head);
  if (block > 0) return block;
  return replaying() ? Replay(layer, kv_head).block_tokens : kFluxionBlocks[0];
}

int64_t FluxionPolicy::HeadBlock(int layer, int kv_head) {
  const HeadScan* h = FindScan(layer, kv_head);
  return h == nullptr ? 0 : h->block;
}

}  // namespace fluxion::decode::sparse

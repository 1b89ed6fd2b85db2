#include "bench/captured_attention_eval.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <optional>

#include "absl/strings/str_cat.h"
#include "bench/attention_quality.h"
#include "bench/eval/npy.h"
#include "common/status_macros.h"
#include "decode/sparse/policy_util.h"
#include "decode/step/sparse_attention.h"
#include "kernels/cpu/paged_attention_cpu.h"
#include "kernels/cpu/selection.h"
#include "kernels/cpu/topk.h"
#include "model/output_projection.h"
#include "model/safetensors.h"
#include "model/sparse_state.h"

namespace fluxion::bench {
namespace {

using eval::NpyArray;

absl::Status CheckShape(const std::string& what, const std::vector<int64_t>& got,
                        const std::vector<int64_t>& want) {
  if (got == want) return absl::OkStatus();
  auto str = [](const std::vector<int64_t>& v) {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); ++i) absl::StrAppend(&s, i ? "," : "", v[i]);
    return s + "]";
  };
  return absl::InvalidArgumentError(
      absl::StrCat(what, " has shape ", str(got), ", expected ", str(want)));
}

// The budgets the head table labels: 0 (sinks + local window only) and the two tiers of
// ALGORITHMS.md §2.4.4. Column names in the CSV follow this order.
constexpr double kTableBudgets[] = {0.0, 0.02, 0.05};
constexpr const char* kTableBudgetNames[] = {"0", "002", "005"};
constexpr int kNumTableBudgets = 3;

// One decode step's labels for every KV head of one layer (ALGORITHMS.md §2.4.2).
struct HeadLabels {
  // [kv_head][budget]: ||W_O^h (o_h - ô_h(b))|| / ||sum_h' W_O^h' o_h'|| with o, ô the
  // sink-free partial outputs (attention renormalised over everything after the sinks), as the
  // spec defines e_h(b); and the same after merging the sinks back in (the error that reaches
  // the residual stream), for comparison.
  std::vector<std::array<double, kNumTableBudgets>> err, err_merged;
  std::vector<double> contribution;  // [kv_head]: c_h of the sink-free outputs
  std::vector<int64_t> middle_rows;  // [budget]: middle rows the budget leaves at this context
};

double Norm(const std::vector<double>& y) {
  double sum = 0;
  for (double v : y) sum += v * v;
  return std::sqrt(sum);
}

// Merges two partial attention states of one query head (natural-base LSEs) into `out`.
void MergeInto(const float* o1, float lse1, const float* o2, float lse2, int64_t d,
               std::vector<double>* out) {
  const double m = std::max(lse1, lse2);
  const double w1 = std::isinf(lse1) ? 0.0 : std::exp(lse1 - m);
  const double w2 = std::isinf(lse2) ? 0.0 : std::exp(lse2 - m);
  const double z = w1 + w2;
  for (int64_t i = 0; i < d; ++i) out->push_back(z > 0 ? (w1 * o1[i] + w2 * o2[i]) / z : 0.0);
}

// Labels of every KV head of the replayed layer (layer 0 of `kv`) at one step with context
// `ctx`: exact top-k of the middle region by the group's largest logit within each budget,
// sinks and local window always attended.
HeadLabels ComputeHeadLabels(const decode::PagedKv& kv, const std::vector<float>& w_o,
                             int64_t hidden, int64_t hq, int64_t hkv, int64_t d, float scale,
                             const float* q_row, int64_t ctx) {
  const int64_t group = hq / hkv, hd = group * d;
  decode::sparse::PolicyConfig config;  // default sinks and window, as every policy uses
  HeadLabels labels;
  labels.err.resize(hkv);
  labels.err_merged.resize(hkv);
  // Outputs per budget, [budget][hq * d], sink-free and merged; and the exact ones.
  std::vector<std::vector<double>> sparse(kNumTableBudgets), sparse_merged(kNumTableBudgets);
  std::vector<double> exact, exact_merged;
  std::vector<float> sink_out(hd), sink_lse(group), out(hd), lse(group);
  std::vector<kernels::PageSpan> spans;
  std::vector<float> scores;
  std::vector<int32_t> picked;
  for (int64_t h = 0; h < hkv; ++h) {
    const int kvh = static_cast<int>(h);
    const kernels::DecodeQuery q{q_row + h * hd, group, scale};
    config.budget = 0;
    const decode::sparse::Regions r0 = decode::sparse::SplitContext(config, ctx);
    spans.clear();
    decode::sparse::AppendTokenRange(kv, 0, kvh, 0, r0.sink_end, &spans);
    if (spans.empty()) {
      std::fill(sink_lse.begin(), sink_lse.end(), -std::numeric_limits<float>::infinity());
    } else {
      kernels::cpu::PagedAttention(kv.view(), spans.data(), spans.size(), q,
                                   {sink_out.data(), sink_lse.data()});
    }
    spans.clear();
    decode::sparse::AppendTokenRange(kv, 0, kvh, r0.sink_end, ctx, &spans);
    kernels::cpu::PagedAttention(kv.view(), spans.data(), spans.size(), q,
                                 {out.data(), lse.data()});
    exact.insert(exact.end(), out.begin(), out.end());
    for (int64_t g = 0; g < group; ++g) {
      MergeInto(&sink_out[g * d], sink_lse[g], &out[g * d], lse[g], d, &exact_merged);
    }
    // The middle's scores once; each budget takes its top rows of them.
    const int64_t n = r0.local_begin - r0.sink_end;
    if (n > 0) {
      spans.clear();
      decode::sparse::AppendTokenRange(kv, 0, kvh, r0.sink_end, r0.local_begin, &spans);
      scores.resize(n);
      kernels::cpu::MaxGroupScores(kv.view(), spans.data(), spans.size(), q.q, group,
                                   scores.data());
    }
    for (int b = 0; b < kNumTableBudgets; ++b) {
      config.budget = kTableBudgets[b];
      const decode::sparse::Regions r = decode::sparse::SplitContext(config, ctx);
      if (h == 0) labels.middle_rows.push_back(r.middle_rows_budget);
      spans.clear();
      if (r.middle_rows_budget > 0 && n > 0) {
        kernels::cpu::TopKIndices(scores.data(), n, r.middle_rows_budget, &picked);
        std::sort(picked.begin(), picked.end());
        for (int32_t& i : picked) i += static_cast<int32_t>(r.sink_end);
        decode::sparse::AppendPositions(kv, 0, kvh, picked, &spans);
      }
      decode::sparse::AppendTokenRange(kv, 0, kvh, r.local_begin, ctx, &spans);
      kernels::cpu::PagedAttention(kv.view(), spans.data(), spans.size(), q,
                                   {out.data(), lse.data()});
      sparse[b].insert(sparse[b].end(), out.begin(), out.end());
      for (int64_t g = 0; g < group; ++g) {
        MergeInto(&sink_out[g * d], sink_lse[g], &out[g * d], lse[g], d, &sparse_merged[b]);
      }
    }
  }
  auto as_float = [](const std::vector<double>& x) {
    return std::vector<float>(x.begin(), x.end());
  };
  const double total = Norm(Project(w_o, hidden, hq * d, as_float(exact)));
  const double total_merged = Norm(Project(w_o, hidden, hq * d, as_float(exact_merged)));
  // e_h as the online guard computes it (model/output_projection.h): one definition.
  const model::OutputProjection proj(hidden, hq * d, {w_o.data()});
  double contribution_sum = 0;
  for (int64_t h = 0; h < hkv; ++h) {
    labels.contribution.push_back(proj.SliceNorm(0, h * hd, exact.data() + h * hd, hd));
    contribution_sum += labels.contribution.back();
    for (int b = 0; b < kNumTableBudgets; ++b) {
      labels.err[h][b] = model::HeadOutputError(proj, 0, h * hd, exact.data() + h * hd,
                                                sparse[b].data() + h * hd, hd, total);
      labels.err_merged[h][b] =
          model::HeadOutputError(proj, 0, h * hd, exact_merged.data() + h * hd,
                                 sparse_merged[b].data() + h * hd, hd, total_merged);
    }
  }
  for (double& c : labels.contribution) c /= std::max(contribution_sum, 1e-30);
  return labels;
}

std::string HeadTableHeader() {
  std::string h =
      "sample,task,context,seed,step,position,layer,num_layers,kv_head,middle_share,"
      "need_fraction,sink_mass,local_mass,entropy,layer_frac,contribution";
  for (const char* b : kTableBudgetNames) absl::StrAppend(&h, ",e_", b);
  for (const char* b : kTableBudgetNames) absl::StrAppend(&h, ",e_merged_", b);
  for (const char* b : kTableBudgetNames) absl::StrAppend(&h, ",middle_rows_", b);
  return h + "\n";
}

// The captured model's attention shape and its output projections, from the capture's
// index.json and the checkpoint.
struct CapturedModel {
  int64_t layers = 0, hq = 0, hkv = 0, d = 0, group = 0, hidden = 0;
  float scale = 0;
  std::vector<std::vector<float>> w_o;  // per layer: [hidden][hq * d]
};

absl::StatusOr<CapturedModel> OpenCapturedModel(const nlohmann::json& index,
                                                const std::string& model_dir_flag) {
  const auto& sh = index["shape"];
  CapturedModel m;
  m.layers = sh.value("num_layers", 0);
  m.hq = sh.value("num_heads", 0);
  m.hkv = sh.value("num_kv_heads", 0);
  m.d = sh.value("head_dim", 0);
  m.scale = sh.value("scale", 0.0f);
  if (m.layers <= 0 || m.hq <= 0 || m.hkv <= 0 || m.d <= 0 || m.hq % m.hkv != 0) {
    return absl::InvalidArgumentError("capture index has a bad shape");
  }
  m.group = m.hq / m.hkv;
  if (!kernels::cpu::PagedAttentionSupported(m.d, m.group, 16)) {
    return absl::InvalidArgumentError("the CPU kernel does not support this model's heads");
  }
  const std::string model_dir =
      model_dir_flag.empty() ? index.value("model", std::string()) : model_dir_flag;
  FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<model::Checkpoint> ckpt,
                           model::Checkpoint::Open(model_dir));
  FLUXION_ASSIGN_OR_RETURN(const model::TensorView* embed, ckpt->Find("model.embed_tokens.weight"));
  m.hidden = embed->shape.size() == 2 ? embed->shape[1] : 0;
  m.w_o.resize(m.layers);
  for (int64_t l = 0; l < m.layers; ++l) {
    const std::string name = absl::StrCat("model.layers.", l, ".self_attn.o_proj.weight");
    FLUXION_ASSIGN_OR_RETURN(const model::TensorView* t, ckpt->Find(name));
    FLUXION_ASSIGN_OR_RETURN(m.w_o[l], model::ReadAsFloat(*t, {m.hidden, m.hq * m.d}));
  }
  return m;
}

// One captured sample: where its arrays are and what it was.
struct CapturedSample {
  std::string dir, name, task;
  int64_t prompt = 0;  // prompt tokens
  int64_t rows = 0;    // decode rows of the `full` policy, at positions prompt, prompt + 1, ...
  int64_t context = 0;
  uint64_t seed = 0;
};

// One layer of one sample: the prompt's K/V, the `full` decode's q/k/v rows and the sparse state
// the prefill tail (its last 32 query rows) gives history-based policies, as
// SparseAttention::FromDense does in serving.
struct CapturedLayer {
  NpyArray<float> k, v, q, kd, vd;
  model::SparseState state;
};

absl::StatusOr<CapturedLayer> ReadLayer(const CapturedModel& m, const CapturedSample& s,
                                        int64_t l) {
  CapturedLayer c;
  auto file = [&](const char* what) { return absl::StrCat(s.dir, "/", what, l, ".npy"); };
  FLUXION_ASSIGN_OR_RETURN(c.k, eval::ReadNpyFloat(file("k_l")));
  FLUXION_ASSIGN_OR_RETURN(c.v, eval::ReadNpyFloat(file("v_l")));
  FLUXION_ASSIGN_OR_RETURN(c.q, eval::ReadNpyFloat(file("full_q_l")));
  FLUXION_ASSIGN_OR_RETURN(c.kd, eval::ReadNpyFloat(file("full_k_l")));
  FLUXION_ASSIGN_OR_RETURN(c.vd, eval::ReadNpyFloat(file("full_v_l")));
  FLUXION_RETURN_IF_ERROR(CheckShape("k", c.k.shape, {s.prompt, m.hkv, m.d}));
  FLUXION_RETURN_IF_ERROR(CheckShape("v", c.v.shape, {s.prompt, m.hkv, m.d}));
  FLUXION_RETURN_IF_ERROR(CheckShape("full_q", c.q.shape, {s.rows, m.hq, m.d}));
  FLUXION_RETURN_IF_ERROR(CheckShape("full_k", c.kd.shape, {s.rows, m.hkv, m.d}));
  FLUXION_RETURN_IF_ERROR(CheckShape("full_v", c.vd.shape, {s.rows, m.hkv, m.d}));
  FLUXION_ASSIGN_OR_RETURN(NpyArray<float> tail_q, eval::ReadNpyFloat(file("prompt_q_l")));
  FLUXION_ASSIGN_OR_RETURN(NpyArray<int64_t> tail_pos,
                           eval::ReadNpyInt64(s.dir + "/prompt_positions.npy"));
  const int64_t tail_rows = std::min<int64_t>(32, tail_pos.data.size());
  std::vector<int64_t> tail_positions(tail_pos.data.end() - tail_rows, tail_pos.data.end());
  std::vector<float> tail_queries(tail_q.data.end() - tail_rows * m.hq * m.d, tail_q.data.end());
  const model::AttentionShape one_layer{1, static_cast<int>(m.hq), static_cast<int>(m.hkv),
                                        static_cast<int>(m.d), m.scale};
  FLUXION_ASSIGN_OR_RETURN(c.state,
                           model::CaptureSparseState({c.k.data.data()}, s.prompt, {tail_queries},
                                                     {tail_positions}, one_layer));
  return c;
}

// Every config's policy, prepared over the prompt's pages of every KV head, and for a guarded
// config its error guard over this layer's KV heads.
struct LayerPolicies {
  std::vector<std::unique_ptr<decode::sparse::SparsePolicy>> policies;
  std::vector<std::unique_ptr<decode::sparse::ErrorGuard>> guards;  // null: unguarded
};

absl::StatusOr<LayerPolicies> PreparePolicies(
    const std::vector<decode::sparse::PolicyConfig>& configs, const decode::PagedKv& kv,
    const model::SparseState& state, int64_t hkv) {
  LayerPolicies lp;
  for (const auto& c : configs) {
    lp.policies.push_back(decode::sparse::MakePolicy(c));
    for (int64_t h = 0; h < hkv; ++h) {
      FLUXION_RETURN_IF_ERROR(
          lp.policies.back()->Prepare(kv, 0, static_cast<int>(h), &state.head(0, h)));
    }
    decode::sparse::SparsePolicy* policy = lp.policies.back().get();
    lp.guards.push_back(
        decode::sparse::GuardActive(c)
            ? std::make_unique<decode::sparse::ErrorGuard>(
                  decode::sparse::GuardFor(c), 1, static_cast<int>(hkv),
                  [policy](int layer, int kv_head) { return policy->MiddleWeight(layer, kv_head); })
            : nullptr);
  }
  return lp;
}

// --head-table: one row per KV head of decode row `r` of layer `l`. Returns the rows written.
int64_t WriteHeadRows(std::ofstream& table, const CapturedModel& m, const CapturedSample& s,
                      const model::SparseState& state, const decode::PagedKv& kv, int64_t l,
                      int64_t r, const float* qr, int64_t ctx) {
  const HeadLabels labels =
      ComputeHeadLabels(kv, m.w_o[l], m.hidden, m.hq, m.hkv, m.d, m.scale, qr, ctx);
  for (int64_t h = 0; h < m.hkv; ++h) {
    const model::HeadSparseState& f = state.head(0, static_cast<int>(h));
    table << s.name << ',' << s.task << ',' << s.context << ',' << s.seed << ',' << r << ','
          << ctx - 1 << ',' << l << ',' << m.layers << ',' << h << ',' << f.middle_share << ','
          << f.need_fraction << ',' << f.sink_mass << ',' << f.local_mass << ',' << f.entropy << ','
          << static_cast<double>(l) / static_cast<double>(m.layers) << ','
          << labels.contribution[h];
    for (double e : labels.err[h]) table << ',' << e;
    for (double e : labels.err_merged[h]) table << ',' << e;
    for (int64_t x : labels.middle_rows) table << ',' << x;
    table << '\n';
  }
  return m.hkv;
}

// One policy's step over every KV head of one decode row against full attention (`full`,
// `full_lse`): recall, overlap and read summed over KV heads, the layer's output error after its
// real W_O, and the guard's checks as SparseAttention::CheckLayer makes them (the exact output of
// a checked head is `full`'s).
Metrics PolicyStep(const CapturedModel& m, int64_t l, const decode::PagedKv& kv,
                   decode::sparse::SparsePolicy& policy, decode::sparse::ErrorGuard* guard,
                   const decode::sparse::PolicyConfig& config, const float* qr, int64_t ctx,
                   const std::vector<float>& full, const std::vector<float>& full_lse,
                   const std::vector<double>& y_full) {
  const int64_t group = m.group, d = m.d, hd = group * d;
  Metrics step;
  std::vector<float> out(m.hq * d), lse(group);
  std::vector<kernels::PageSpan> spans;
  if (guard != nullptr) guard->BeginStep();
  for (int64_t h = 0; h < m.hkv; ++h) {
    decode::sparse::SelectionStats stats;
    const float* qg = qr + h * hd;
    decode::sparse::SelectionInput in{&kv, 0, static_cast<int>(h), qg, group, m.scale, ctx};
    if (guard != nullptr) in.budget_shift = guard->Shift(0, static_cast<int>(h));
    decode::RunPolicyStep(policy, in, &spans, &stats, &out[h * hd], lse.data());
    AddSelectionQuality(kv, 0, static_cast<int>(h), qg, group, m.scale, ctx, spans, config,
                        &full_lse[h * group], stats.rows_attended, &step);
  }
  // The layer's output error counts once per step; the other metrics are summed over KV heads.
  step.rel_err = RelativeError(Project(m.w_o[l], m.hidden, m.hq * d, out), y_full) * m.hkv;
  const model::OutputProjection layer_proj(m.hidden, m.hq * d, {m.w_o[l].data()});
  for (int64_t h = 0; guard != nullptr && h < m.hkv; ++h) {
    if (!guard->Due(0, static_cast<int>(h))) continue;
    std::vector<float> check_layer = out;
    std::copy(full.begin() + h * hd, full.begin() + (h + 1) * hd, check_layer.begin() + h * hd);
    const double total = layer_proj.Norm(0, check_layer.data());
    guard->Report(
        0, static_cast<int>(h),
        model::HeadOutputError(layer_proj, 0, h * hd, &full[h * hd], &out[h * hd], hd, total), ctx);
    step.guard_read += 1.0;  // the whole context of one head-step (read's unit)
  }
  return step;
}

// Replays layer `l` of a sample: the prompt's pages, then each `full` decode row appended and
// attended exactly and by every config. Adds to `per_task` and the head table.
absl::Status ReplayLayer(const CapturedModel& m, const CapturedSample& s, int64_t l,
                         const std::vector<decode::sparse::PolicyConfig>& configs,
                         std::ofstream& table, int64_t* table_rows,
                         std::map<std::pair<std::string, size_t>, Metrics>* per_task) {
  FLUXION_ASSIGN_OR_RETURN(CapturedLayer c, ReadLayer(m, s, l));
  const int64_t hkv = m.hkv, d = m.d, group = m.group;
  // One arena per layer replay: prompt + decode rows for every KV head.
  const decode::KvShape kv_shape{1, static_cast<int>(hkv), static_cast<int>(d), 16};
  FLUXION_ASSIGN_OR_RETURN(
      std::unique_ptr<decode::KvArena> arena,
      decode::KvArena::Create(kv_shape.page_bytes(), hkv * ((s.prompt + s.rows) / 16 + 2)));
  FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<decode::PagedKv> kv,
                           decode::PagedKv::Create(arena.get(), kv_shape));
  FLUXION_RETURN_IF_ERROR(kv->Append(0, s.prompt, c.k.data.data(), c.v.data.data(), hkv * d));
  FLUXION_ASSIGN_OR_RETURN(LayerPolicies lp, PreparePolicies(configs, *kv, c.state, hkv));
  std::vector<float> full(m.hq * d), full_lse(m.hq);
  std::vector<kernels::PageSpan> spans;
  for (int64_t r = 0; r < s.rows; ++r) {
    FLUXION_RETURN_IF_ERROR(
        kv->Append(0, 1, &c.kd.data[r * hkv * d], &c.vd.data[r * hkv * d], hkv * d));
    const int64_t ctx = s.prompt + r + 1;
    const float* qr = &c.q.data[r * m.hq * d];
    for (int64_t h = 0; h < hkv; ++h) {
      spans.clear();
      decode::sparse::AppendTokenRange(*kv, 0, static_cast<int>(h), 0, ctx, &spans);
      kernels::cpu::PagedAttention(kv->view(), spans.data(), spans.size(),
                                   {qr + h * group * d, group, m.scale},
                                   {&full[h * group * d], &full_lse[h * group]});
    }
    if (table.is_open()) *table_rows += WriteHeadRows(table, m, s, c.state, *kv, l, r, qr, ctx);
    if (configs.empty()) continue;
    const std::vector<double> y_full = Project(m.w_o[l], m.hidden, m.hq * d, full);
    for (size_t p = 0; p < configs.size(); ++p) {
      (*per_task)[{s.task, p}].Add(PolicyStep(m, l, *kv, *lp.policies[p], lp.guards[p].get(),
                                              configs[p], qr, ctx, full, full_lse, y_full));
    }
  }
  return absl::OkStatus();
}

// A sample of index.json, its decode rows checked to follow the prompt; nullopt for one without
// prompt K/V (above --capture-kv-max) or without a `full` decode.
absl::StatusOr<std::optional<CapturedSample>> ReadSample(const std::string& capture_dir,
                                                         const nlohmann::json& sample) {
  if (!sample.value("kv", false) || !sample.contains("policies") ||
      !sample["policies"].contains("full")) {
    return std::optional<CapturedSample>();
  }
  CapturedSample s;
  s.name = sample.value("dir", std::string());
  s.dir = capture_dir + "/" + s.name;
  s.task = sample.value("task", std::string("?"));
  s.prompt = sample.value("prompt_tokens", int64_t{0});
  s.context = sample.value("context", int64_t{0});
  s.seed = sample.value("seed", uint64_t{0});
  FLUXION_ASSIGN_OR_RETURN(NpyArray<int64_t> positions,
                           eval::ReadNpyInt64(s.dir + "/full_positions.npy"));
  s.rows = static_cast<int64_t>(positions.data.size());
  for (int64_t r = 0; r < s.rows; ++r) {
    if (positions.data[r] != s.prompt + r) {
      return absl::InvalidArgumentError(absl::StrCat(s.dir, ": decode rows do not follow the ",
                                                     "prompt (row ", r, " at position ",
                                                     positions.data[r], ")"));
    }
  }
  return std::optional<CapturedSample>(std::move(s));
}

// Prints the quality table and returns its rows as JSON.
nlohmann::json ReportQuality(const std::vector<decode::sparse::PolicyConfig>& configs,
                             const std::map<std::pair<std::string, size_t>, Metrics>& per_task,
                             const std::map<std::string, int64_t>& task_context) {
  nlohmann::json results = nlohmann::json::array();
  if (configs.empty()) return results;
  PrintQualityHeader("task (captured)");
  for (const auto& [key, m] : per_task) {
    const auto& [task, p] = key;
    const std::string label = decode::sparse::PolicyLabel(configs[p]);
    m.Print(task, task_context.at(task), label);
    nlohmann::json row = m.ToJson();
    row.update({{"task", task},
                {"context", task_context.at(task)},
                {"policy", configs[p].name},
                {"label", label},
                {"guard", decode::sparse::GuardActive(configs[p])},
                {"budget", configs[p].budget},
                {"source", "captured"}});
    results.push_back(row);
  }
  return results;
}

}  // namespace

absl::StatusOr<nlohmann::json> EvalCapturedAttention(
    const std::string& capture_dir, const std::string& model_dir_flag,
    const std::vector<decode::sparse::PolicyConfig>& configs, const std::string& head_table_csv) {
  std::ifstream in(capture_dir + "/index.json");
  if (!in) return absl::NotFoundError(absl::StrCat("no index.json in ", capture_dir));
  nlohmann::json index = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (index.is_discarded() || !index.contains("shape") || !index.contains("samples")) {
    return absl::InvalidArgumentError(absl::StrCat(capture_dir, "/index.json is not a capture"));
  }
  FLUXION_ASSIGN_OR_RETURN(CapturedModel m, OpenCapturedModel(index, model_dir_flag));
  std::ofstream table;
  if (!head_table_csv.empty()) {
    table.open(head_table_csv);
    if (!table) return absl::InternalError(absl::StrCat("cannot write ", head_table_csv));
    table << HeadTableHeader();
  }
  int64_t table_rows = 0, samples_used = 0;
  // Totals per (task, policy); the context each task was captured at.
  std::map<std::pair<std::string, size_t>, Metrics> per_task;
  std::map<std::string, int64_t> task_context;
  for (const auto& entry : index["samples"]) {
    FLUXION_ASSIGN_OR_RETURN(std::optional<CapturedSample> s, ReadSample(capture_dir, entry));
    if (!s.has_value()) continue;
    task_context[s->task] = s->context;
    for (int64_t l = 0; l < m.layers; ++l) {
      FLUXION_RETURN_IF_ERROR(ReplayLayer(m, *s, l, configs, table, &table_rows, &per_task));
    }
    ++samples_used;
  }
  if (samples_used == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        capture_dir, " holds no sample with prompt K/V and a `full` decode: capture with ",
        "`fluxion eval tasks --policy full --capture-dir DIR` and prompts within "
        "--capture-kv-max"));
  }
  if (table.is_open()) {
    table.close();
    if (!table) return absl::InternalError(absl::StrCat("writing ", head_table_csv, " failed"));
    std::printf("wrote %lld head-table rows from %lld samples to %s\n",
                static_cast<long long>(table_rows), static_cast<long long>(samples_used),
                head_table_csv.c_str());
  }
  return ReportQuality(configs, per_task, task_context);
}

}  // namespace fluxion::bench

#include "bench/captured_attention_eval.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>

#include "absl/strings/str_cat.h"
#include "bench/attention_quality.h"
#include "bench/eval/npy.h"
#include "common/status_macros.h"
#include "decode/sparse/policy_util.h"
#include "decode/sparse_attention.h"
#include "kernels/cpu/selection.h"
#include "kernels/cpu/topk.h"
#include "kernels/cpu/paged_attention_cpu.h"
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
  auto as_float = [](const std::vector<double>& x) { return std::vector<float>(x.begin(), x.end()); };
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
  const auto& sh = index["shape"];
  const int64_t layers = sh.value("num_layers", 0), hq = sh.value("num_heads", 0),
                hkv = sh.value("num_kv_heads", 0), d = sh.value("head_dim", 0);
  const float scale = sh.value("scale", 0.0f);
  if (layers <= 0 || hq <= 0 || hkv <= 0 || d <= 0 || hq % hkv != 0) {
    return absl::InvalidArgumentError("capture index has a bad shape");
  }
  const int64_t group = hq / hkv;
  if (!kernels::cpu::PagedAttentionSupported(d, group, 16)) {
    return absl::InvalidArgumentError("the CPU kernel does not support this model's heads");
  }
  const std::string model_dir =
      model_dir_flag.empty() ? index.value("model", std::string()) : model_dir_flag;
  FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<model::Checkpoint> ckpt,
                           model::Checkpoint::Open(model_dir));
  FLUXION_ASSIGN_OR_RETURN(const model::TensorView* embed,
                           ckpt->Find("model.embed_tokens.weight"));
  const int64_t hidden = embed->shape.size() == 2 ? embed->shape[1] : 0;
  std::vector<std::vector<float>> w_o(layers);
  for (int64_t l = 0; l < layers; ++l) {
    const std::string name = absl::StrCat("model.layers.", l, ".self_attn.o_proj.weight");
    FLUXION_ASSIGN_OR_RETURN(const model::TensorView* t, ckpt->Find(name));
    FLUXION_ASSIGN_OR_RETURN(w_o[l], model::ReadAsFloat(*t, {hidden, hq * d}));
  }

  std::ofstream table;
  if (!head_table_csv.empty()) {
    table.open(head_table_csv);
    if (!table) return absl::InternalError(absl::StrCat("cannot write ", head_table_csv));
    table << HeadTableHeader();
  }
  int64_t table_rows = 0;
  // Totals per (task, policy) and over everything per policy.
  std::map<std::pair<std::string, size_t>, Metrics> per_task;
  std::map<std::string, int64_t> task_context;
  const decode::KvShape kv_shape{1, hkv, d, 16};
  int64_t samples_used = 0;
  for (const auto& sample : index["samples"]) {
    if (!sample.value("kv", false) || !sample.contains("policies") ||
        !sample["policies"].contains("full")) {
      continue;  // K/V not captured (prompt above --capture-kv-max) or no full decode
    }
    const std::string dir = capture_dir + "/" + sample.value("dir", std::string());
    const std::string task = sample.value("task", std::string("?"));
    const int64_t prompt = sample.value("prompt_tokens", int64_t{0});
    task_context[task] = sample.value("context", int64_t{0});
    FLUXION_ASSIGN_OR_RETURN(NpyArray<int64_t> positions,
                             eval::ReadNpyInt64(dir + "/full_positions.npy"));
    const int64_t rows = static_cast<int64_t>(positions.data.size());
    for (int64_t r = 0; r < rows; ++r) {
      if (positions.data[r] != prompt + r) {
        return absl::InvalidArgumentError(absl::StrCat(dir, ": decode rows do not follow the ",
                                                       "prompt (row ", r, " at position ",
                                                       positions.data[r], ")"));
      }
    }
    for (int64_t l = 0; l < layers; ++l) {
      FLUXION_ASSIGN_OR_RETURN(NpyArray<float> k, eval::ReadNpyFloat(absl::StrCat(dir, "/k_l", l, ".npy")));
      FLUXION_ASSIGN_OR_RETURN(NpyArray<float> v, eval::ReadNpyFloat(absl::StrCat(dir, "/v_l", l, ".npy")));
      FLUXION_ASSIGN_OR_RETURN(NpyArray<float> q, eval::ReadNpyFloat(absl::StrCat(dir, "/full_q_l", l, ".npy")));
      FLUXION_ASSIGN_OR_RETURN(NpyArray<float> kd, eval::ReadNpyFloat(absl::StrCat(dir, "/full_k_l", l, ".npy")));
      FLUXION_ASSIGN_OR_RETURN(NpyArray<float> vd, eval::ReadNpyFloat(absl::StrCat(dir, "/full_v_l", l, ".npy")));
      FLUXION_RETURN_IF_ERROR(CheckShape("k", k.shape, {prompt, hkv, d}));
      FLUXION_RETURN_IF_ERROR(CheckShape("v", v.shape, {prompt, hkv, d}));
      FLUXION_RETURN_IF_ERROR(CheckShape("full_q", q.shape, {rows, hq, d}));
      FLUXION_RETURN_IF_ERROR(CheckShape("full_k", kd.shape, {rows, hkv, d}));
      FLUXION_RETURN_IF_ERROR(CheckShape("full_v", vd.shape, {rows, hkv, d}));
      // One arena per layer replay: prompt + decode rows for every KV head.
      FLUXION_ASSIGN_OR_RETURN(
          std::unique_ptr<decode::KvArena> arena,
          decode::KvArena::Create(kv_shape.page_bytes(), hkv * ((prompt + rows) / 16 + 2)));
      FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<decode::PagedKv> kv,
                               decode::PagedKv::Create(arena.get(), kv_shape));
      FLUXION_RETURN_IF_ERROR(kv->Append(0, prompt, k.data.data(), v.data.data(), hkv * d));
      // The prefill tail (the last 32 prompt rows' queries) gives the sparse state that primes
      // history-based policies, as SparseAttention::FromDense does in serving.
      FLUXION_ASSIGN_OR_RETURN(NpyArray<float> tail_q,
                               eval::ReadNpyFloat(absl::StrCat(dir, "/prompt_q_l", l, ".npy")));
      FLUXION_ASSIGN_OR_RETURN(NpyArray<int64_t> tail_pos,
                               eval::ReadNpyInt64(dir + "/prompt_positions.npy"));
      const int64_t tail_rows = std::min<int64_t>(32, tail_pos.data.size());
      std::vector<int64_t> tail_positions(tail_pos.data.end() - tail_rows, tail_pos.data.end());
      std::vector<float> tail_queries(tail_q.data.end() - tail_rows * hq * d, tail_q.data.end());
      const model::AttentionShape one_layer{1, hq, hkv, d, scale};
      FLUXION_ASSIGN_OR_RETURN(model::SparseState state,
                               model::CaptureSparseState({k.data.data()}, prompt, {tail_queries},
                                                         {tail_positions}, one_layer));
      std::vector<std::unique_ptr<decode::sparse::SparsePolicy>> policies;
      // The error guard of a guarded config: over this layer's KV heads, with this layer's W_O.
      std::vector<std::unique_ptr<decode::sparse::ErrorGuard>> guards;
      const model::OutputProjection layer_proj(hidden, hq * d, {w_o[l].data()});
      for (const auto& c : configs) {
        policies.push_back(decode::sparse::MakePolicy(c));
        for (int64_t h = 0; h < hkv; ++h) {
          FLUXION_RETURN_IF_ERROR(
              policies.back()->Prepare(*kv, 0, static_cast<int>(h), &state.head(0, h)));
        }
        decode::sparse::SparsePolicy* policy = policies.back().get();
        guards.push_back(decode::sparse::GuardActive(c)
                             ? std::make_unique<decode::sparse::ErrorGuard>(
                                   decode::sparse::GuardFor(c), 1, static_cast<int>(hkv),
                                   [policy](int layer, int kv_head) {
                                     return policy->MiddleWeight(layer, kv_head);
                                   })
                             : nullptr);
      }
      std::vector<float> check_layer(hq * d);
      std::vector<float> full(hq * d), full_lse(hq), out(hq * d), lse(group);
      std::vector<kernels::PageSpan> spans;
      for (int64_t r = 0; r < rows; ++r) {
        FLUXION_RETURN_IF_ERROR(kv->Append(0, 1, &kd.data[r * hkv * d], &vd.data[r * hkv * d],
                                           hkv * d));
        const int64_t ctx = prompt + r + 1;
        const float* qr = &q.data[r * hq * d];
        for (int64_t h = 0; h < hkv; ++h) {
          spans.clear();
          decode::sparse::AppendTokenRange(*kv, 0, static_cast<int>(h), 0, ctx, &spans);
          kernels::cpu::PagedAttention(kv->view(), spans.data(), spans.size(),
                                       {qr + h * group * d, group, scale},
                                       {&full[h * group * d], &full_lse[h * group]});
        }
        if (table.is_open()) {
          const HeadLabels labels =
              ComputeHeadLabels(*kv, w_o[l], hidden, hq, hkv, d, scale, qr, ctx);
          for (int64_t h = 0; h < hkv; ++h) {
            const model::HeadSparseState& f = state.head(0, static_cast<int>(h));
            table << sample.value("dir", std::string()) << ',' << task << ','
                  << task_context[task] << ',' << sample.value("seed", uint64_t{0}) << ',' << r
                  << ',' << ctx - 1 << ',' << l << ',' << layers << ',' << h << ','
                  << f.middle_share << ',' << f.need_fraction << ',' << f.sink_mass << ','
                  << f.local_mass << ',' << f.entropy << ','
                  << static_cast<double>(l) / static_cast<double>(layers) << ','
                  << labels.contribution[h];
            for (double e : labels.err[h]) table << ',' << e;
            for (double e : labels.err_merged[h]) table << ',' << e;
            for (int64_t m : labels.middle_rows) table << ',' << m;
            table << '\n';
            ++table_rows;
          }
        }
        if (configs.empty()) continue;
        const std::vector<double> y_full = Project(w_o[l], hidden, hq * d, full);
        for (size_t p = 0; p < configs.size(); ++p) {
          Metrics step;
          decode::sparse::ErrorGuard* guard = guards[p].get();
          if (guard != nullptr) guard->BeginStep();
          for (int64_t h = 0; h < hkv; ++h) {
            decode::sparse::SelectionStats stats;
            const float* qg = qr + h * group * d;
            decode::sparse::SelectionInput in{kv.get(), 0, static_cast<int>(h), qg, group, scale,
                                              ctx};
            if (guard != nullptr) in.budget_shift = guard->Shift(0, static_cast<int>(h));
            decode::RunPolicyStep(*policies[p], in, &spans, &stats, &out[h * group * d],
                                  lse.data());
            AddSelectionQuality(*kv, 0, static_cast<int>(h), qg, group, scale, ctx, spans,
                                configs[p], &full_lse[h * group], stats.rows_attended, &step);
          }
          // The layer's output error after its real W_O counts once per step; recall, overlap
          // and read are already summed over KV heads.
          step.rel_err = RelativeError(Project(w_o[l], hidden, hq * d, out), y_full) * hkv;
          // The guard's checks, as SparseAttention::CheckLayer makes them (the exact output of
          // a checked head is `full`'s, computed above).
          for (int64_t h = 0; guard != nullptr && h < hkv; ++h) {
            if (!guard->Due(0, static_cast<int>(h))) continue;
            const int64_t hd = group * d;
            check_layer = out;
            std::copy(full.begin() + h * hd, full.begin() + (h + 1) * hd,
                      check_layer.begin() + h * hd);
            const double total = layer_proj.Norm(0, check_layer.data());
            guard->Report(0, static_cast<int>(h),
                          model::HeadOutputError(layer_proj, 0, h * hd, &full[h * hd],
                                                 &out[h * hd], hd, total),
                          ctx);
            step.guard_read += 1.0;  // the whole context of one head-step (read's unit)
          }
          per_task[{task, p}].Add(step);
        }
      }
    }
    ++samples_used;
  }
  if (samples_used == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        capture_dir, " holds no sample with prompt K/V and a `full` decode: capture with ",
        "`fluxion eval tasks --policy full --capture-dir DIR` and prompts within --capture-kv-max"));
  }
  if (table.is_open()) {
    table.close();
    if (!table) return absl::InternalError(absl::StrCat("writing ", head_table_csv, " failed"));
    std::printf("wrote %lld head-table rows from %lld samples to %s\n",
                static_cast<long long>(table_rows), static_cast<long long>(samples_used),
                head_table_csv.c_str());
  }
  nlohmann::json results = nlohmann::json::array();
  if (configs.empty()) return results;
  PrintQualityHeader("task (captured)");
  for (const auto& [key, m] : per_task) {
    const auto& [task, p] = key;
    const std::string label = decode::sparse::PolicyLabel(configs[p]);
    m.Print(task, task_context[task], label);
    nlohmann::json row = m.ToJson();
    row.update({{"task", task},
                {"context", task_context[task]},
                {"policy", configs[p].name},
                {"label", label},
                {"guard", decode::sparse::GuardActive(configs[p])},
                {"budget", configs[p].budget},
                {"source", "captured"}});
    results.push_back(row);
  }
  return results;
}

}  // namespace fluxion::bench

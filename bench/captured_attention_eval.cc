#include "bench/captured_attention_eval.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>

#include "absl/strings/str_cat.h"
#include "bench/attention_quality.h"
#include "bench/eval/npy.h"
#include "common/status_macros.h"
#include "decode/sparse_attention.h"
#include "kernels/cpu/paged_attention_cpu.h"
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

}  // namespace

absl::StatusOr<nlohmann::json> EvalCapturedAttention(
    const std::string& capture_dir, const std::string& model_dir_flag,
    const std::vector<decode::sparse::PolicyConfig>& configs) {
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
      for (const auto& c : configs) {
        policies.push_back(decode::sparse::MakePolicy(c));
        for (int64_t h = 0; h < hkv; ++h) {
          FLUXION_RETURN_IF_ERROR(
              policies.back()->Prepare(*kv, 0, static_cast<int>(h), &state.head(0, h)));
        }
      }
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
        const std::vector<double> y_full = Project(w_o[l], hidden, hq * d, full);
        for (size_t p = 0; p < configs.size(); ++p) {
          Metrics step;
          for (int64_t h = 0; h < hkv; ++h) {
            decode::sparse::SelectionStats stats;
            const float* qg = qr + h * group * d;
            decode::RunPolicyStep(*policies[p],
                                  {kv.get(), 0, static_cast<int>(h), qg, group, scale, ctx},
                                  &spans, &stats, &out[h * group * d], lse.data());
            AddSelectionQuality(*kv, 0, static_cast<int>(h), qg, group, scale, ctx, spans,
                                configs[p], &full_lse[h * group], stats.rows_attended, &step);
          }
          // The layer's output error after its real W_O counts once per step; recall, overlap
          // and read are already summed over KV heads.
          step.rel_err = RelativeError(Project(w_o[l], hidden, hq * d, out), y_full) * hkv;
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
  nlohmann::json results = nlohmann::json::array();
  PrintQualityHeader("task (captured)");
  for (const auto& [key, m] : per_task) {
    const auto& [task, p] = key;
    const std::string label = decode::sparse::PolicyLabel(configs[p]);
    m.Print(task, task_context[task], label);
    nlohmann::json row = m.ToJson();
    row.update({{"task", task},
                {"context", task_context[task]},
                {"policy", configs[p].name},
                {"budget", configs[p].budget},
                {"source", "captured"}});
    results.push_back(row);
  }
  return results;
}

}  // namespace fluxion::bench

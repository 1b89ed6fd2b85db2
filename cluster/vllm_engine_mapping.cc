#include "cluster/vllm_engine_mapping.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cluster/finish_reason.h"

namespace fluxion::cluster {
namespace {

namespace ve = vllm::grpc::engine;

// Which SamplingParams fields carry something Fluxion would have to drop.
void UnsupportedSampling(const ve::SamplingParams& s, std::vector<std::string>* bad) {
  auto add = [bad](const char* name) { bad->push_back(absl::StrCat("sampling_params.", name)); };
  if (s.min_p() != 0) add("min_p");
  if (std::abs(s.frequency_penalty()) > 2) add("frequency_penalty ([-2, 2])");
  if (std::abs(s.presence_penalty()) > 2) add("presence_penalty ([-2, 2])");
  if (s.repetition_penalty() < 0) add("repetition_penalty (> 0; 0 reads as 1)");
  if (s.n() > 1) add("n (one sequence per request)");
  // vLLM's -1 (the whole vocabulary) and anything beyond 20 alternatives.
  if (s.has_logprobs() && (s.logprobs() < 0 || s.logprobs() > 20)) add("logprobs (0 to 20)");
  if (s.has_prompt_logprobs() && (s.prompt_logprobs() < 0 || s.prompt_logprobs() > 20)) {
    add("prompt_logprobs (0 to 20)");
  }
  if (!s.logit_bias().empty()) add("logit_bias");
  if (s.has_truncate_prompt_tokens()) add("truncate_prompt_tokens");
  switch (s.constraint_case()) {
    case ve::SamplingParams::kJsonSchema:
      add("json_schema");
      break;
    case ve::SamplingParams::kRegex:
      add("regex");
      break;
    case ve::SamplingParams::kGrammar:
      add("grammar");
      break;
    case ve::SamplingParams::kStructuralTag:
      add("structural_tag");
      break;
    case ve::SamplingParams::kJsonObject:
      add("json_object");
      break;
    case ve::SamplingParams::kChoice:
      add("choice");
      break;
    case ve::SamplingParams::CONSTRAINT_NOT_SET:
      break;
  }
}

int32_t ClampInt32(uint64_t v) {
  return static_cast<int32_t>(std::min<uint64_t>(v, std::numeric_limits<int32_t>::max()));
}

}  // namespace

absl::Status ValidateVllmRequest(const ve::GenerateRequest& request) {
  std::vector<std::string> bad;
  if (request.has_sampling_params()) UnsupportedSampling(request.sampling_params(), &bad);
  if (request.has_kv_transfer_params()) bad.push_back("kv_transfer_params");
  if (request.has_kv_transfer_params_json()) bad.push_back("kv_transfer_params_json");
  if (request.has_mm_inputs()) bad.push_back("mm_inputs");
  if (request.extra_mm_inputs_size() > 0) bad.push_back("extra_mm_inputs");
  if (request.has_media_refs()) bad.push_back("media_refs");
  if (request.has_data_parallel_rank() && request.data_parallel_rank() != 0) {
    bad.push_back("data_parallel_rank (one rank, 0)");
  }
  if (!bad.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request ", request.request_id().substr(0, 128), ": unsupported by Fluxion: ",
        absl::StrJoin(bad, ", "), " (leave them unset; docs/PROTOCOL.md, \"VllmEngine\")"));
  }
  if (request.input_case() == ve::GenerateRequest::INPUT_NOT_SET) {
    return absl::InvalidArgumentError(absl::StrCat("request ", request.request_id().substr(0, 128),
                                                   ": no input (set tokenized or text)"));
  }
  return absl::OkStatus();
}

v1::GenerateRequest ToFluxionRequest(const ve::GenerateRequest& request,
                                     const std::vector<uint32_t>& prompt_ids) {
  v1::GenerateRequest out;
  out.set_request_id(request.request_id());
  out.mutable_prompt_token_ids()->Reserve(static_cast<int>(prompt_ids.size()));
  for (uint32_t id : prompt_ids) out.add_prompt_token_ids(id);
  const ve::SamplingParams& s = request.sampling_params();
  v1::SamplingParams* d = out.mutable_sampling();
  if (s.has_temperature()) d->set_temperature(s.temperature());
  if (s.top_p() != 0) d->set_top_p(s.top_p());  // vLLM's servicer reads 0 as 1.0 (off)
  d->set_top_k(s.top_k());
  // vLLM's seed is a signed 32-bit int; any value names one stream, so keep its bits.
  if (s.has_seed()) d->set_seed(static_cast<uint64_t>(static_cast<uint32_t>(s.seed())));
  if (s.has_max_tokens()) d->set_max_tokens(s.max_tokens());
  for (uint32_t id : s.stop_token_ids()) d->add_stop_token_ids(id);
  d->set_ignore_eos(s.ignore_eos());
  d->set_presence_penalty(s.presence_penalty());
  d->set_frequency_penalty(s.frequency_penalty());
  // vLLM's servicer reads an unset (0) repetition penalty as 1, as it does top_p.
  if (s.repetition_penalty() != 0 && s.repetition_penalty() != 1) {
    d->set_repetition_penalty(s.repetition_penalty());
  }
  d->set_min_tokens(s.min_tokens());
  if (s.has_logprobs()) d->set_logprobs(static_cast<uint32_t>(s.logprobs()));
  if (s.has_prompt_logprobs()) d->set_prompt_logprobs(static_cast<uint32_t>(s.prompt_logprobs()));
  return out;
}

void AppendOutputLogprobs(const v1::GenerateChunk& chunk, int tokens, ve::OutputLogProbs* out) {
  const int n = std::min({tokens, chunk.logprobs_size(), chunk.token_ids_size()});
  for (int i = 0; i < n; ++i) {
    const v1::TokenLogprobs& l = chunk.logprobs(i);
    out->add_token_logprobs(l.logprob());
    out->add_token_ids(chunk.token_ids(i));
    ve::TopLogProbs* top = out->add_top_logprobs();
    *top->mutable_values() = l.top_logprobs();
    *top->mutable_token_ids() = l.top_token_ids();
  }
}

ve::InputLogProbs ToVllmInputLogprobs(const google::protobuf::RepeatedField<uint32_t>& prompt,
                                      const v1::GenerateChunk& chunk) {
  ve::InputLogProbs out;
  for (int i = 0; i < prompt.size(); ++i) {
    out.add_token_ids(prompt.Get(i));
    ve::InputTokenLogProb* value = out.add_token_logprobs();
    ve::TopLogProbs* top = out.add_top_logprobs();
    if (i == 0 || i - 1 >= chunk.prompt_logprobs_size()) continue;  // the first has none
    const v1::TokenLogprobs& l = chunk.prompt_logprobs(i - 1);
    value->set_value(l.logprob());
    *top->mutable_values() = l.top_logprobs();
    *top->mutable_token_ids() = l.top_token_ids();
  }
  return out;
}

ve::GenerateComplete ToVllmComplete(const v1::GenerateComplete& complete, uint32_t prompt_tokens,
                                    const std::vector<uint32_t>& output_ids) {
  ve::GenerateComplete out;
  for (uint32_t id : output_ids) out.add_output_ids(id);
  out.set_finish_reason(FinishReasonText(complete.finish_reason()));
  out.set_prompt_tokens(complete.has_usage() ? complete.usage().prompt_tokens() : prompt_tokens);
  out.set_completion_tokens(complete.usage().completion_tokens());
  if (complete.finish_reason() == v1::FINISH_REASON_STOP && complete.has_matched_stop_token_id()) {
    out.set_matched_token_id(complete.matched_stop_token_id());
  }
  return out;
}

ve::GetLoadsResponse ToVllmLoads(const v1::DecodeLoad& load, absl::Time now) {
  ve::GetLoadsResponse out;
  out.set_timestamp(absl::FormatTime("%Y-%m-%dT%H:%M:%E6S+00:00", now, absl::UTCTimeZone()));
  out.set_version(load.server().build_version());
  out.set_dp_rank_count(1);
  ve::SchedulerLoad* l = out.add_loads();
  l->set_dp_rank(0);
  const uint64_t waiting = uint64_t{load.waiting_requests()} + load.prefilling_requests();
  l->set_num_running_reqs(ClampInt32(load.running_requests()));
  l->set_num_waiting_reqs(ClampInt32(waiting));
  l->set_num_total_reqs(ClampInt32(waiting + load.running_requests()));
  // A page holds page_tokens tokens of one layer and one KV head, so a sequence of T tokens
  // takes T / page_tokens pages per (layer, head).
  const v1::ModelLayout& layout = load.server().layout();
  const uint64_t per_token_set = uint64_t{layout.num_layers()} * layout.num_kv_heads();
  if (per_token_set > 0 && load.total_kv_pages() >= load.free_kv_pages()) {
    const uint64_t used = load.total_kv_pages() - load.free_kv_pages();
    l->set_num_used_tokens(ClampInt32(used / per_token_set * load.page_tokens()));
    l->set_max_total_num_tokens(
        ClampInt32(load.total_kv_pages() / per_token_set * load.page_tokens()));
  }
  l->set_token_usage(std::clamp<double>(load.kv_usage(), 0.0, 1.0));
  return out;
}

}  // namespace fluxion::cluster

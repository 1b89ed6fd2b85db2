#include "cluster/vllm_engine_mapping.h"

#include <string>

#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fluxion::cluster {
namespace {

namespace ve = vllm::grpc::engine;
using ::testing::HasSubstr;

ve::GenerateRequest TokenRequest() {
  ve::GenerateRequest r;
  r.set_request_id("r1");
  r.mutable_tokenized()->add_input_ids(5);
  r.mutable_tokenized()->add_input_ids(7);
  return r;
}

// What SMG's client sends for a plain request (crates/grpc_client/src/vllm_engine.rs): defaults
// spelled out, which must not count as unsupported.
TEST(VllmEngineMapping, AcceptsSmgDefaults) {
  ve::GenerateRequest r = TokenRequest();
  ve::SamplingParams* s = r.mutable_sampling_params();
  s->set_temperature(1.0f);
  s->set_top_p(1.0f);
  s->set_repetition_penalty(1.0f);
  s->set_n(1);
  s->set_skip_special_tokens(true);
  s->set_spaces_between_special_tokens(true);
  r.set_data_parallel_rank(0);
  r.set_stream(true);
  EXPECT_TRUE(ValidateVllmRequest(r).ok()) << ValidateVllmRequest(r);
}

TEST(VllmEngineMapping, NamesEveryUnsupportedField) {
  ve::GenerateRequest r = TokenRequest();
  ve::SamplingParams* s = r.mutable_sampling_params();
  s->set_min_p(0.1f);
  s->set_frequency_penalty(2.5f);
  s->set_repetition_penalty(-1.0f);
  s->set_n(2);
  s->set_logprobs(-1);  // vLLM's whole vocabulary
  (*s->mutable_logit_bias())[5] = 1.0f;
  s->set_regex("a+");
  r.mutable_kv_transfer_params()->set_remote_host("h");
  r.mutable_mm_inputs();
  r.set_data_parallel_rank(3);
  const absl::Status st = ValidateVllmRequest(r);
  ASSERT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  for (const char* name :
       {"sampling_params.min_p", "sampling_params.frequency_penalty",
        "sampling_params.repetition_penalty", "sampling_params.n", "sampling_params.logprobs",
        "sampling_params.logit_bias", "sampling_params.regex", "kv_transfer_params", "mm_inputs",
        "data_parallel_rank", "request r1"}) {
    EXPECT_THAT(std::string(st.message()), HasSubstr(name));
  }
  EXPECT_THAT(std::string(st.message()), ::testing::Not(HasSubstr("presence_penalty")));
}

TEST(VllmEngineMapping, PenaltiesAndMinTokensMapOneToOne) {
  ve::GenerateRequest r = TokenRequest();
  ve::SamplingParams* s = r.mutable_sampling_params();
  s->set_presence_penalty(0.5f);
  s->set_frequency_penalty(-0.25f);
  s->set_repetition_penalty(1.3f);
  s->set_min_tokens(3);
  ASSERT_TRUE(ValidateVllmRequest(r).ok()) << ValidateVllmRequest(r);
  const v1::SamplingParams g = ToFluxionRequest(r, {5}).sampling();
  EXPECT_FLOAT_EQ(g.presence_penalty(), 0.5f);
  EXPECT_FLOAT_EQ(g.frequency_penalty(), -0.25f);
  EXPECT_FLOAT_EQ(g.repetition_penalty(), 1.3f);
  EXPECT_EQ(g.min_tokens(), 3u);
  s->set_repetition_penalty(0);  // SMG's unset
  EXPECT_FALSE(ToFluxionRequest(r, {5}).sampling().has_repetition_penalty());
}

TEST(VllmEngineMapping, LogprobsMapBothWays) {
  ve::GenerateRequest r = TokenRequest();
  r.mutable_sampling_params()->set_logprobs(2);
  r.mutable_sampling_params()->set_prompt_logprobs(0);
  ASSERT_TRUE(ValidateVllmRequest(r).ok()) << ValidateVllmRequest(r);
  const v1::GenerateRequest g = ToFluxionRequest(r, {5, 6, 7});
  EXPECT_EQ(g.sampling().logprobs(), 2u);
  EXPECT_TRUE(g.sampling().has_prompt_logprobs());
  EXPECT_EQ(g.sampling().prompt_logprobs(), 0u);
  EXPECT_FALSE(ToFluxionRequest(TokenRequest(), {5}).sampling().has_logprobs());

  v1::GenerateChunk chunk;
  for (uint32_t id : {11u, 12u}) {
    chunk.add_token_ids(id);
    v1::TokenLogprobs* l = chunk.add_logprobs();
    l->set_logprob(-0.25f * id);
    l->add_top_token_ids(id);
    l->add_top_logprobs(-0.25f * id);
  }
  chunk.add_prompt_logprobs()->set_logprob(-1.0f);
  chunk.add_prompt_logprobs()->set_logprob(-2.0f);
  ve::OutputLogProbs out;
  AppendOutputLogprobs(chunk, 1, &out);  // the second token was cut by a stop string
  ASSERT_EQ(out.token_logprobs_size(), 1);
  EXPECT_EQ(out.token_ids(0), 11u);
  EXPECT_FLOAT_EQ(out.token_logprobs(0), -2.75f);
  EXPECT_EQ(out.top_logprobs(0).token_ids(0), 11u);
  const ve::InputLogProbs in = ToVllmInputLogprobs(g.prompt_token_ids(), chunk);
  ASSERT_EQ(in.token_ids_size(), 3);
  EXPECT_FALSE(in.token_logprobs(0).has_value());
  EXPECT_FLOAT_EQ(in.token_logprobs(2).value(), -2.0f);
}

TEST(VllmEngineMapping, EachConstraintIsNamed) {
  for (int i = 0; i < 6; ++i) {
    ve::GenerateRequest r = TokenRequest();
    ve::SamplingParams* s = r.mutable_sampling_params();
    const char* names[] = {"json_schema",    "regex",       "grammar",
                           "structural_tag", "json_object", "choice"};
    switch (i) {
      case 0:
        s->set_json_schema("{}");
        break;
      case 1:
        s->set_regex("x");
        break;
      case 2:
        s->set_grammar("g");
        break;
      case 3:
        s->set_structural_tag("t");
        break;
      case 4:
        s->set_json_object(true);
        break;
      case 5:
        s->mutable_choice()->add_choices("a");
        break;
    }
    const absl::Status st = ValidateVllmRequest(r);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(st.message()), HasSubstr(names[i]));
  }
}

TEST(VllmEngineMapping, RejectsMissingInput) {
  ve::GenerateRequest r;
  r.set_request_id("r2");
  const absl::Status st = ValidateVllmRequest(r);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("tokenized or text"));
  r.set_text("hello");
  EXPECT_TRUE(ValidateVllmRequest(r).ok());
}

TEST(VllmEngineMapping, MapsSamplingOntoFluxion) {
  ve::GenerateRequest r = TokenRequest();
  ve::SamplingParams* s = r.mutable_sampling_params();
  s->set_temperature(0.0f);
  s->set_top_k(40);
  s->set_seed(-1);
  s->set_max_tokens(9);
  s->add_stop_token_ids(2);
  s->set_ignore_eos(true);
  const v1::GenerateRequest out = ToFluxionRequest(r, {5, 7});
  EXPECT_EQ(out.request_id(), "r1");
  ASSERT_EQ(out.prompt_token_ids_size(), 2);
  EXPECT_EQ(out.prompt_token_ids(1), 7u);
  EXPECT_TRUE(out.sampling().has_temperature());  // 0 = greedy must stay distinct from absent
  EXPECT_EQ(out.sampling().temperature(), 0.0f);
  EXPECT_FALSE(out.sampling().has_top_p());  // vLLM's 0 means off
  EXPECT_EQ(out.sampling().top_k(), 40u);
  EXPECT_EQ(out.sampling().seed(), 0xffffffffu);
  EXPECT_EQ(out.sampling().max_tokens(), 9u);
  ASSERT_EQ(out.sampling().stop_token_ids_size(), 1);
  EXPECT_TRUE(out.sampling().ignore_eos());
  EXPECT_FALSE(out.has_timeout_ms());

  ve::GenerateRequest plain = TokenRequest();
  const v1::GenerateRequest d = ToFluxionRequest(plain, {5});
  EXPECT_FALSE(d.sampling().has_temperature());
  EXPECT_FALSE(d.sampling().has_max_tokens());
  EXPECT_FALSE(d.sampling().has_seed());
}

TEST(VllmEngineMapping, CompleteCarriesReasonUsageAndStopToken) {
  v1::GenerateComplete c;
  c.set_finish_reason(v1::FINISH_REASON_STOP);
  c.set_matched_stop_token_id(2);
  c.mutable_usage()->set_prompt_tokens(4);
  c.mutable_usage()->set_completion_tokens(3);
  const ve::GenerateComplete out = ToVllmComplete(c, 4, {9, 8, 2});
  EXPECT_EQ(out.finish_reason(), "stop");
  EXPECT_EQ(out.matched_token_id(), 2u);
  EXPECT_EQ(out.prompt_tokens(), 4u);
  EXPECT_EQ(out.completion_tokens(), 3u);
  EXPECT_EQ(out.output_ids_size(), 3);

  c.set_finish_reason(v1::FINISH_REASON_ABORT);
  EXPECT_EQ(ToVllmComplete(c, 4, {}).finish_reason(), "abort");
  EXPECT_EQ(ToVllmComplete(c, 4, {}).matched_stop_case(),
            ve::GenerateComplete::MATCHED_STOP_NOT_SET);
  c.set_finish_reason(v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(ToVllmComplete(c, 4, {}).finish_reason(), "length");
}

TEST(VllmEngineMapping, LoadsCountPrefillingAsWaitingAndPagesAsTokens) {
  v1::DecodeLoad load;
  load.set_running_requests(3);
  load.set_prefilling_requests(2);
  load.set_waiting_requests(1);
  load.set_total_kv_pages(4 * 2 * 100);  // 4 layers x 2 KV heads x 100 pages each
  load.set_free_kv_pages(4 * 2 * 75);
  load.set_page_tokens(16);
  load.set_kv_usage(0.25f);
  load.mutable_server()->mutable_layout()->set_num_layers(4);
  load.mutable_server()->mutable_layout()->set_num_kv_heads(2);
  load.mutable_server()->set_build_version("fluxion test");
  const ve::GetLoadsResponse out = ToVllmLoads(load, absl::FromUnixSeconds(0));
  EXPECT_EQ(out.timestamp(), "1970-01-01T00:00:00.000000+00:00");
  EXPECT_EQ(out.version(), "fluxion test");
  EXPECT_EQ(out.dp_rank_count(), 1);
  ASSERT_EQ(out.loads_size(), 1);
  const ve::SchedulerLoad& l = out.loads(0);
  EXPECT_EQ(l.num_running_reqs(), 3);
  EXPECT_EQ(l.num_waiting_reqs(), 3);
  EXPECT_EQ(l.num_total_reqs(), 6);
  EXPECT_EQ(l.num_used_tokens(), 25 * 16);
  EXPECT_EQ(l.max_total_num_tokens(), 100 * 16);
  EXPECT_DOUBLE_EQ(l.token_usage(), 0.25);
}

}  // namespace
}  // namespace fluxion::cluster

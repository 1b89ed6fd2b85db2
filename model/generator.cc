#include "model/generator.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/decode_step.h"

namespace fluxion::model {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

bool Contains(const std::vector<int32_t>& ids, int32_t id) {
  return std::find(ids.begin(), ids.end(), id) != ids.end();
}

}  // namespace

const char* FinishReasonName(FinishReason reason) {
  return reason == FinishReason::kStop ? "stop" : "length";
}

absl::StatusOr<GenerationResult> Generate(const Model& model, absl::Span<const int32_t> prompt,
                                          const GenerationOptions& options,
                                          const std::function<void(int32_t)>& on_token) {
  if (prompt.empty()) return absl::InvalidArgumentError("the prompt has no tokens");
  if (options.max_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_tokens must be >= 1, got ", options.max_tokens));
  }
  FLUXION_RETURN_IF_ERROR(ValidateSamplingParams(options.sampling));
  const ModelConfig& config = model.config();
  const int64_t limit = config.max_position_embeddings;
  if (limit > 0 && static_cast<int64_t>(prompt.size()) >= limit) {
    return absl::InvalidArgumentError(absl::StrCat("prompt of ", prompt.size(),
                                                   " tokens leaves no room in the model's ",
                                                   limit, "-token context"));
  }
  std::vector<int32_t> stop_ids = options.stop_token_ids;
  if (!options.ignore_eos) {
    for (int64_t id : config.eos_token_ids) stop_ids.push_back(static_cast<int32_t>(id));
  }

  std::unique_ptr<DecodeStepRunner> runner;
  if (options.decode_ops != nullptr) {
    FLUXION_ASSIGN_OR_RETURN(runner, DecodeStepRunner::Create(model, options.decode_ops));
  }
  GenerationResult result;
  Sampler sampler(options.sampling);
  auto dense = std::make_unique<DenseAttention>(model.attention_shape());
  const DenseAttention* prefilled = dense.get();
  // Sparse policies initialise from the prompt's last query rows (LFPS: the last 32).
  const int64_t prompt_len = static_cast<int64_t>(prompt.size());
  dense->RecordQueries(std::max<int64_t>(0, prompt_len - kPrefillTailRows), prompt_len);
  auto seq = std::make_unique<Sequence>(std::move(dense));
  std::vector<float> logits;
  auto t0 = std::chrono::steady_clock::now();
  FLUXION_RETURN_IF_ERROR(model.Forward(*seq, prompt, &logits));
  if (options.decode_attention) {
    FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<SequenceAttention> attention,
                             options.decode_attention(*prefilled));
    seq = std::make_unique<Sequence>(std::move(attention), seq->length());
  }
  int32_t token = sampler.Sample(logits);
  result.prefill_seconds = SecondsSince(t0);
  t0 = std::chrono::steady_clock::now();
  while (true) {
    result.tokens.push_back(token);
    if (on_token) on_token(token);
    if (Contains(stop_ids, token)) {
      result.finish_reason = FinishReason::kStop;
      break;
    }
    if (static_cast<int64_t>(result.tokens.size()) >= options.max_tokens ||
        (limit > 0 && seq->length() >= limit)) {
      result.finish_reason = FinishReason::kLength;
      break;
    }
    if (runner != nullptr) {
      Sequence* row = seq.get();
      SequenceBatchAttention attention(absl::MakeConstSpan(&row, 1), model.attention_shape(),
                                       options.decode_ops);
      const int64_t position = seq->length();
      logits.resize(config.vocab_size);
      FLUXION_RETURN_IF_ERROR(runner->Step(absl::MakeConstSpan(&token, 1),
                                           absl::MakeConstSpan(&position, 1), attention,
                                           logits.data()));
    } else {
      FLUXION_RETURN_IF_ERROR(model.Forward(*seq, absl::MakeConstSpan(&token, 1), &logits));
    }
    token = sampler.Sample(logits);
  }
  result.decode_seconds = SecondsSince(t0);
  result.sequence = std::move(seq);
  return result;
}

}  // namespace fluxion::model

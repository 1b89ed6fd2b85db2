#include "bench/eval/task_codec.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/byte_tokenizer.h"

namespace fluxion::eval {

using ::fluxion::model::ByteTokenizer;

bool IsAnswerTerminator(int32_t token) { return token == '\n' || token == ByteTokenizer::kEos; }

std::string AnswerText(absl::Span<const int32_t> generated) {
  auto end = std::find_if(generated.begin(), generated.end(), IsAnswerTerminator);
  return ByteTokenizer::Decode(absl::MakeConstSpan(generated.begin(), end));
}

int64_t DefaultMaxNewTokens(const std::string& answer) {
  return static_cast<int64_t>(answer.size()) + 16;
}

TaskCodec TaskCodec::Bytes() { return TaskCodec(); }

TaskCodec TaskCodec::ForTokenizer(std::shared_ptr<const model::Tokenizer> tokenizer, int64_t bos,
                                  std::vector<int64_t> eos_ids) {
  TaskCodec codec;
  codec.tokenizer_ = std::move(tokenizer);
  codec.bos_ = bos;
  codec.eos_ids_ = std::move(eos_ids);
  return codec;
}

absl::StatusOr<TaskCodec> TaskCodec::ForModel(const std::string& model_dir, int64_t bos,
                                              std::vector<int64_t> eos_ids) {
  if (!std::filesystem::exists(model_dir + "/tokenizer.json")) return Bytes();
  FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<model::Tokenizer> tokenizer,
                           model::LoadTokenizer(model_dir));
  return ForTokenizer(std::move(tokenizer), bos, std::move(eos_ids));
}

absl::StatusOr<TaskSample> TaskCodec::Sample(const std::string& task, int64_t context_tokens,
                                             uint64_t seed) const {
  if (bytes()) return MakeTaskSample(task, context_tokens, seed);
  // Bytes per token varies little within one task's text, so the scaled length lands within a
  // few tries; each try aims at 0.95 L, the middle of the accepted range.
  constexpr int kTries = 8;
  int64_t text_bytes = context_tokens;
  int64_t last_tokens = 0;
  for (int attempt = 0; attempt < kTries; ++attempt) {
    FLUXION_ASSIGN_OR_RETURN(TaskSample sample, MakeTaskSample(task, text_bytes, seed));
    FLUXION_ASSIGN_OR_RETURN(std::vector<int32_t> ids, tokenizer_->Encode(sample.prompt_text));
    if (bos_ >= 0) ids.insert(ids.begin(), static_cast<int32_t>(bos_));
    last_tokens = static_cast<int64_t>(ids.size());
    if (10 * last_tokens >= 9 * context_tokens && last_tokens <= context_tokens) {
      sample.prompt_ids = std::move(ids);
      sample.context = context_tokens;
      return sample;
    }
    const int64_t scaled = std::llround(static_cast<double>(text_bytes) * 0.95 *
                                        static_cast<double>(context_tokens) /
                                        static_cast<double>(last_tokens));
    // Never stand still: a rounding that gives the same length moves it one byte the right way.
    text_bytes = scaled != text_bytes ? scaled
                                      : text_bytes + (last_tokens < context_tokens ? 1 : -1);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "task ", task, " seed ", seed, ": the tokenizer's ids of the prompt could not be brought ",
      "within [0.9 L, L] of context ", context_tokens, " tokens (the last try had ", last_tokens,
      ")"));
}

bool TaskCodec::EndsAnswer(int32_t token) const {
  if (bytes()) return IsAnswerTerminator(token);
  if (std::find(eos_ids_.begin(), eos_ids_.end(), token) != eos_ids_.end()) return true;
  std::string text;
  tokenizer_->AppendTokenBytes(token, /*skip_special=*/true, &text);
  return text.find('\n') != std::string::npos;
}

std::string TaskCodec::AnswerText(absl::Span<const int32_t> generated) const {
  if (bytes()) return eval::AnswerText(generated);
  auto end = std::find_if(generated.begin(), generated.end(),
                          [this](int32_t t) { return EndsAnswer(t); });
  // A newline token's text before its newline belongs to the answer ("42\n" as one token); an
  // EOS id's does not.
  if (end != generated.end() &&
      std::find(eos_ids_.begin(), eos_ids_.end(), *end) == eos_ids_.end()) {
    ++end;
  }
  std::string text = tokenizer_->Decode(absl::MakeConstSpan(generated.begin(), end),
                                        /*skip_special=*/true);
  return text.substr(0, text.find('\n'));
}

int64_t TaskCodec::MaxNewTokens(const std::string& answer) const {
  if (bytes()) return DefaultMaxNewTokens(answer);
  absl::StatusOr<std::vector<int32_t>> ids = tokenizer_->Encode(answer);
  // An answer is ASCII from our own generators, so Encode cannot fail on it; bytes bound tokens.
  return (ids.ok() ? static_cast<int64_t>(ids->size()) : static_cast<int64_t>(answer.size())) +
         16;
}

}  // namespace fluxion::eval

// The docs/TASKS.md tasks in a model's own vocabulary: what lets `fluxion eval tasks` and
// `fluxion calibrate` run on a user's checkpoint, not only on our byte-level models.
//
// The task generators (tasks.h) size a prompt in bytes, which are tokens for the byte tokenizer.
// Through another tokenizer the codec regenerates the sample at a byte length scaled by the
// measured bytes per token until its ids (BOS, when the model has one, plus the tokenizer's ids of
// the text) fall in [0.9 L, L] tokens, so `--contexts` means the model's tokens either way. An
// answer ends at the first token whose text holds a newline or at one of the model's EOS ids, and
// is the decoded text before that newline.
//
// Thread-safe: immutable after construction.
#ifndef FLUXION_BENCH_EVAL_TASK_CODEC_H_
#define FLUXION_BENCH_EVAL_TASK_CODEC_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "bench/eval/tasks.h"
#include "model/tokenizer.h"

namespace fluxion::eval {

// The byte tokenizer's scoring (TASKS.md "Scoring"), what TaskCodec::Bytes() does:
// tokens that end an answer are "\n" and the byte tokenizer's EOS;
bool IsAnswerTerminator(int32_t token);
// the answer is the continuation up to (excluding) the first terminator, decoded as text;
std::string AnswerText(absl::Span<const int32_t> generated);
// and at most len(answer) + 16 tokens are generated for it.
int64_t DefaultMaxNewTokens(const std::string& answer);

class TaskCodec {
 public:
  // Our byte-level models: TaskSample's own ids, "\n" and the byte tokenizer's EOS end answers
  // (the scoring of TASKS.md, unchanged).
  static TaskCodec Bytes();
  // A model with its own tokenizer; `bos` < 0 when the model has none, `eos_ids` from its config.
  static TaskCodec ForTokenizer(std::shared_ptr<const model::Tokenizer> tokenizer, int64_t bos,
                                std::vector<int64_t> eos_ids);
  // The codec of the model in `model_dir` (its config's `bos` and `eos_ids`): ForTokenizer over
  // its tokenizer.json when it has one, else Bytes(). LoadTokenizer's errors.
  static absl::StatusOr<TaskCodec> ForModel(const std::string& model_dir, int64_t bos,
                                            std::vector<int64_t> eos_ids);

  // The sample of (task, context, seed) whose ids number [0.9 L, L] tokens, L = `context_tokens`;
  // its `context` is L. MakeTaskSample's errors; InvalidArgument when the tokenizer's ids of the
  // text cannot be brought within the range.
  absl::StatusOr<TaskSample> Sample(const std::string& task, int64_t context_tokens,
                                    uint64_t seed) const;
  // Whether `token` ends an answer.
  bool EndsAnswer(int32_t token) const;
  // The answer `generated` spells: its text up to the first newline or ending token.
  std::string AnswerText(absl::Span<const int32_t> generated) const;
  // Tokens to generate at most for `answer`: its token count + 16 (TASKS.md's len(answer) + 16).
  int64_t MaxNewTokens(const std::string& answer) const;
  // Whether this codec is the byte tokenizer's (the vocabulary must then hold its ids).
  bool bytes() const { return tokenizer_ == nullptr; }

 private:
  TaskCodec() = default;
  std::shared_ptr<const model::Tokenizer> tokenizer_;  // null: the byte tokenizer
  int64_t bos_ = -1;
  std::vector<int64_t> eos_ids_;
};

}  // namespace fluxion::eval

#endif  // FLUXION_BENCH_EVAL_TASK_CODEC_H_

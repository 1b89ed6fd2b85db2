// The single-process generation loop: prefill the prompt, then decode token by token with a
// Sampler until a stop token, max_tokens, or the model's context limit.
#ifndef FLUXION_MODEL_GENERATOR_H_
#define FLUXION_MODEL_GENERATOR_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "model/dense_attention.h"
#include "model/dense_ops.h"
#include "model/model.h"
#include "model/sampler.h"

namespace fluxion::model {

// Prompt rows whose queries the prefill records for sparse policies (ALGORITHMS.md §1.3.3: s = 32).
inline constexpr int64_t kPrefillTailRows = 32;

// Builds the attention decode steps run on from the full-attention prefill state (copied, not
// kept). `decode/` passes one for its paged, sparse policies; `model/` never depends on them.
using DecodeAttentionFactory =
    std::function<absl::StatusOr<std::unique_ptr<SequenceAttention>>(const DenseAttention&)>;

struct GenerationOptions {
  SamplingParams sampling;
  int64_t max_tokens = 16;
  std::vector<int32_t> stop_token_ids;  // in addition to the model's EOS ids
  bool ignore_eos = false;              // keep going past EOS (not past stop_token_ids)
  DecodeAttentionFactory decode_attention;  // empty: decode continues on the prefill's cache
  // Decode steps through the batched seam (decode_step.h) on these dense ops, e.g. CUDA's, with
  // the attention on the host; the weights are uploaded once per Generate, before the prefill's
  // timer starts. Null: Model::Forward on the CPU. The prompt is prefilled on the CPU either way.
  DenseOps* decode_ops = nullptr;
};

enum class FinishReason { kStop, kLength };
const char* FinishReasonName(FinishReason reason);

struct GenerationResult {
  std::vector<int32_t> tokens;  // generated ids; a stop token that ended generation is included
  FinishReason finish_reason = FinishReason::kLength;
  double prefill_seconds = 0;   // prompt forward + first token
  double decode_seconds = 0;    // every later token
  // The finished sequence, so the caller can inspect its attention (e.g. the budget a sparse
  // policy spent); it owns whatever the decode_attention factory returned.
  std::unique_ptr<Sequence> sequence;
};

// Generates from `prompt` on a fresh sequence of `model`. `on_token` (optional) sees each token as
// it is produced. InvalidArgument for an empty prompt, bad sampling parameters, max_tokens < 1, or
// a prompt that already fills max_position_embeddings.
absl::StatusOr<GenerationResult> Generate(const Model& model, absl::Span<const int32_t> prompt,
                                          const GenerationOptions& options,
                                          const std::function<void(int32_t)>& on_token = nullptr);

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_GENERATOR_H_

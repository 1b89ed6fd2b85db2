#include "prefill/cpu_prefill_device.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/dense_attention.h"
#include "model/generator.h"
#include "model/logprobs.h"
#include "model/sparse_state.h"
#include "transfer/kv_pages.h"
#include "transfer/page_meta.h"

namespace fluxion::prefill {
namespace {

// The prompt's own full attention, which hands every computed piece of a layer (a prompt chunk:
// the model runs long prompts in chunks) to `on_rows(layer, first, end)` right after storing it:
// the engine packs and sends those rows' pages while the model goes on with the next layer. An
// error from the hook stops this prompt's forward.
class ReportingAttention : public model::SequenceAttention {
 public:
  ReportingAttention(const model::AttentionShape& shape, int64_t tokens,
                     std::function<absl::Status(int, int64_t, int64_t)> on_rows)
      : dense_(shape), on_rows_(std::move(on_rows)) {
    dense_.RecordQueries(std::max<int64_t>(0, tokens - model::kPrefillTailRows), tokens);
  }

  absl::Status Forward(int layer, int64_t pos0, int64_t n, const float* q, const float* k,
                       const float* v, float* out) override {
    FLUXION_RETURN_IF_ERROR(dense_.Forward(layer, pos0, n, q, k, v, out));
    return on_rows_(layer, pos0, pos0 + n);
  }

  const model::DenseAttention& dense() const { return dense_; }

 private:
  model::DenseAttention dense_;
  std::function<absl::Status(int, int64_t, int64_t)> on_rows_;
};

}  // namespace

// One prompt of a batch: its tokens, its sequence (the cache the pages come from) and its pages'
// geometry. A PromptPages: the engine keeps it (DevicePrefillResult::pages) until its writes end.
class CpuPrefillDevice::Prompt final : public PromptPages {
 public:
  Prompt(const model::Model& model, size_t index, const DevicePrompt& p,
         const BatchPiecesReady& ready)
      : tokens_(p.tokens.begin(), p.tokens.end()),
        geo_{model.config().num_layers, model.config().num_kv_heads, model.config().head_dim,
             p.page_tokens},
        shape_(model.attention_shape()),
        capture_(p.capture_state),
        prompt_logprobs_(p.prompt_logprobs) {
    // DevicePrompt::cancelled is polled by `ready`'s caller (the engine checks it in its
    // callback, where a cancelled request of a batch is answered at once): a second poll here
    // could take the prompt out of the batch without that answer.
    auto attention = std::make_unique<ReportingAttention>(
        shape_, static_cast<int64_t>(tokens_.size()),
        [index, &ready](int layer, int64_t first, int64_t end) -> absl::Status {
          return ready(index, layer, first, end);
        });
    attention_ = attention.get();
    seq_ = std::make_unique<model::Sequence>(std::move(attention));
  }

  absl::Status Copy(int layer, int64_t first_page, int64_t end_page, uint8_t* pages,
                    uint8_t* records) const override {
    const int64_t n = static_cast<int64_t>(tokens_.size());
    if (layer < 0 || layer >= geo_.num_layers || first_page < 0 || end_page <= first_page ||
        end_page > geo_.pages_per_head(n)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cpu prefill: pages [", first_page, ", ", end_page, ") of layer ", layer,
          " are not the prompt's (", geo_.pages_per_head(n), " per head, ", geo_.num_layers,
          " layers)"));
    }
    const model::DenseAttention& dense = attention_->dense();
    transfer::PackPageRange(geo_, n, first_page, end_page, dense.keys(layer), dense.values(layer),
                            shape_.num_kv_heads * shape_.head_dim, pages);
    if (records != nullptr) {
      transfer::EncodePackedPageMeta(geo_, n, pages, first_page, end_page, records);
    }
    return absl::OkStatus();
  }

  absl::Span<const int32_t> tokens() const { return tokens_; }
  model::Sequence& seq() { return *seq_; }
  bool capture() const { return capture_; }
  int32_t prompt_logprobs() const { return prompt_logprobs_; }
  // Rows [first, first + rows) of the prompt's logits ([rows][vocab]): each row's log-probability
  // of the token after it, for every one the prompt has.
  void AddLogprobs(int64_t first, int64_t rows, const float* logits, int64_t vocab) {
    const int64_t n = static_cast<int64_t>(tokens_.size());
    for (int64_t r = 0; r < rows && first + r + 1 < n; ++r) {
      logprobs_.push_back(model::LogprobsOfRow(absl::MakeConstSpan(logits + r * vocab, vocab),
                                               tokens_[first + r + 1], prompt_logprobs_));
    }
  }
  std::vector<model::TokenLogprobs> TakeLogprobs() { return std::move(logprobs_); }
  absl::StatusOr<model::SparseState> Capture() const {
    return model::CaptureSparseState(attention_->dense(), shape_);
  }

 private:
  const std::vector<int32_t> tokens_;
  const transfer::KvPageGeometry geo_;
  const model::AttentionShape shape_;
  const bool capture_;
  const int32_t prompt_logprobs_;
  std::vector<model::TokenLogprobs> logprobs_;
  ReportingAttention* attention_ = nullptr;  // owned by seq_
  std::unique_ptr<model::Sequence> seq_;
};

CpuPrefillDevice::CpuPrefillDevice(const model::Model* model, int64_t piece_tokens)
    : model_(model), piece_tokens_(std::max<int64_t>(1, piece_tokens)) {}

CpuPrefillDevice::~CpuPrefillDevice() = default;

const model::ModelConfig& CpuPrefillDevice::config() const { return model_->config(); }

absl::StatusOr<uint8_t*> CpuPrefillDevice::HostStaging(size_t bytes) {
  std::lock_guard<std::mutex> lock(staging_mu_);
  if (staging_.size() < bytes) staging_.resize(bytes);
  return staging_.data();
}

void CpuPrefillDevice::Forward(absl::Span<Prompt* const> prompts,
                               std::vector<absl::Status>* statuses,
                               std::vector<std::vector<float>>* logits) {
  const size_t count = prompts.size();
  statuses->assign(count, absl::OkStatus());
  logits->assign(count, {});
  // Prompts that ask for their prompt logprobs need every row's logits, which the batched
  // forward does not give: they run alone (few requests ask; lm-eval's loglikelihood does).
  std::vector<Prompt*> together;
  std::vector<size_t> together_index;
  for (size_t i = 0; i < count; ++i) {
    if (count == 1 || prompts[i]->prompt_logprobs() >= 0) {
      (*statuses)[i] = ForwardAlone(*prompts[i], &(*logits)[i]);
    } else {
      together.push_back(prompts[i]);
      together_index.push_back(i);
    }
  }
  if (together.empty()) return;
  std::vector<absl::Status> together_statuses;
  std::vector<std::vector<float>> together_logits;
  ForwardTogether(together, &together_statuses, &together_logits);
  for (size_t b = 0; b < together.size(); ++b) {
    (*statuses)[together_index[b]] = std::move(together_statuses[b]);
    (*logits)[together_index[b]] = std::move(together_logits[b]);
  }
}

absl::Status CpuPrefillDevice::ForwardAlone(Prompt& p, std::vector<float>* logits) {
  const int64_t n = static_cast<int64_t>(p.tokens().size());
  const int64_t vocab = model_->config().vocab_size;
  const bool all = p.prompt_logprobs() >= 0;
  std::vector<float> piece_logits;
  for (int64_t first = 0; first < n; first += piece_tokens_) {
    const int64_t rows = std::min(piece_tokens_, n - first);
    FLUXION_RETURN_IF_ERROR(
        model_->Forward(p.seq(), p.tokens().subspan(first, rows), &piece_logits, all));
    if (all) p.AddLogprobs(first, rows, piece_logits.data(), vocab);
  }
  if (all) {
    logits->assign(piece_logits.end() - vocab, piece_logits.end());  // the last row's
  } else {
    *logits = std::move(piece_logits);
  }
  return absl::OkStatus();
}

void CpuPrefillDevice::ForwardTogether(absl::Span<Prompt* const> prompts,
                                       std::vector<absl::Status>* statuses,
                                       std::vector<std::vector<float>>* logits) {
  const size_t count = prompts.size();
  statuses->assign(count, absl::OkStatus());
  logits->assign(count, {});
  // Piece p of every prompt still computing goes through one batched forward. A prompt whose
  // hook fails (cancelled, a send refused) leaves the batch at that layer.
  std::vector<model::Sequence*> seqs;
  std::vector<absl::Span<const int32_t>> spans;
  std::vector<size_t> in;
  std::vector<std::vector<float>> piece_logits;
  std::vector<absl::Status> piece_statuses;
  for (int64_t first = 0;; first += piece_tokens_) {
    seqs.clear();
    spans.clear();
    in.clear();
    for (size_t i = 0; i < count; ++i) {
      const int64_t n = static_cast<int64_t>(prompts[i]->tokens().size());
      if (!(*statuses)[i].ok() || first >= n) continue;
      in.push_back(i);
      seqs.push_back(&prompts[i]->seq());
      spans.push_back(prompts[i]->tokens().subspan(first, std::min(piece_tokens_, n - first)));
    }
    if (in.empty()) return;
    const absl::Status s = model_->ForwardBatch(seqs, spans, &piece_logits, &piece_statuses);
    for (size_t b = 0; b < in.size(); ++b) {
      const size_t i = in[b];
      (*statuses)[i] = s.ok() ? piece_statuses[b] : s;
      const int64_t n = static_cast<int64_t>(prompts[i]->tokens().size());
      if ((*statuses)[i].ok() && first + piece_tokens_ >= n) {
        (*logits)[i] = std::move(piece_logits[b]);
      }
    }
  }
}

absl::StatusOr<std::vector<absl::StatusOr<DevicePrefillResult>>> CpuPrefillDevice::RunBatch(
    absl::Span<const DevicePrompt> prompts, const BatchPiecesReady& ready) {
  std::lock_guard<std::mutex> batch_lock(batch_mu_);
  std::vector<std::shared_ptr<Prompt>> batch;
  std::vector<Prompt*> raw;
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (prompts[i].tokens.empty() || prompts[i].page_tokens < 1) {
      return absl::InvalidArgumentError("the cpu prefill needs prompts and a page size");
    }
    batch.push_back(std::make_shared<Prompt>(*model_, i, prompts[i], ready));
    raw.push_back(batch.back().get());
  }
  {
    std::lock_guard<std::mutex> lock(last_mu_);
    last_ = batch;
  }
  std::vector<absl::Status> statuses;
  std::vector<std::vector<float>> logits;
  Forward(raw, &statuses, &logits);
  const auto forward_end = std::chrono::steady_clock::now();
  {
    // From here on a prompt's pages are its result's (a request's cache must not outlive its
    // writes because a later batch has not started yet).
    std::lock_guard<std::mutex> lock(last_mu_);
    last_.clear();
  }
  std::vector<absl::StatusOr<DevicePrefillResult>> results;
  for (size_t i = 0; i < batch.size(); ++i) {
    if (!statuses[i].ok()) {
      results.push_back(statuses[i]);
      continue;
    }
    DevicePrefillResult r;
    r.logits = std::move(logits[i]);
    r.prompt_logprobs = batch[i]->TakeLogprobs();
    r.forward_end = forward_end;
    if (batch[i]->capture()) {
      absl::StatusOr<model::SparseState> state = batch[i]->Capture();
      if (!state.ok()) {
        results.push_back(state.status());
        continue;
      }
      r.state = *std::move(state);
    }
    r.pages = batch[i];
    results.push_back(std::move(r));
  }
  return results;
}

absl::Status CpuPrefillDevice::CopyPages(size_t prompt, int layer, int64_t first_page,
                                         int64_t end_page, uint8_t* pages, uint8_t* records) {
  std::shared_ptr<Prompt> p;
  {
    std::lock_guard<std::mutex> lock(last_mu_);
    if (prompt >= last_.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("cpu prefill: no prompt ", prompt, " in the running batch (",
                       last_.size(), "; after a batch its pages are its result's)"));
    }
    p = last_[prompt];
  }
  return p->Copy(layer, first_page, end_page, pages, records);
}

}  // namespace fluxion::prefill

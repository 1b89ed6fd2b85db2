#include "decode/step/step_executor.h"

#include <algorithm>

#include "glog/logging.h"
#include "decode/step/paged_batch_attention.h"
#include "kernels/cpu/attention_backend_cpu.h"
#include "model/cpu_dense_ops.h"
#include "model/decode_step.h"

namespace fluxion::decode {
namespace {

class CpuStepExecutor : public StepExecutor {
 public:
  CpuStepExecutor(const model::Model* model, const kernels::cpu::CpuPool* pool,
                  std::unique_ptr<kernels::AttentionBackend> backend)
      : model_(model),
        ops_(pool),
        backend_(std::move(backend)),
        attention_(backend_.get(), pool, model->attention_shape()) {}
  absl::string_view name() const override { return "cpu"; }

  void Step(absl::Span<const StepRequest> batch, std::vector<float>* logits,
            std::vector<absl::Status>* statuses) override {
    seqs_.clear();
    attentions_.clear();
    tokens_.clear();
    positions_.clear();
    for (const StepRequest& r : batch) {
      seqs_.push_back(r.seq);
      attentions_.push_back(r.attention);
      tokens_.push_back(r.token);
      positions_.push_back(r.seq->length());
    }
    attention_.SetBatch(seqs_, attentions_);
    // The step fails as a whole: one request's attention error leaves every cache unspecified,
    // so every request of the batch gets the error.
    statuses->assign(batch.size(), RunStep(logits));
  }

 private:
  // One runner for the executor's life: its step buffers grow to the largest batch and are then
  // reused (Model::DecodeStep would make them again every step). The host DenseOps borrows the
  // model's weights, so making it copies no weight.
  absl::Status RunStep(std::vector<float>* logits) {
    if (runner_ == nullptr) {
      absl::StatusOr<std::unique_ptr<model::DecodeStepRunner>> runner =
          model::DecodeStepRunner::Create(*model_, &ops_);
      if (!runner.ok()) return runner.status();
      runner_ = std::move(*runner);
    }
    logits->resize(tokens_.size() * model_->config().vocab_size);
    return runner_->Step(tokens_, positions_, attention_, logits->data());
  }

  const model::Model* const model_;
  model::CpuDenseOps ops_;
  const std::unique_ptr<kernels::AttentionBackend> backend_;
  PagedBatchAttention attention_;
  std::unique_ptr<model::DecodeStepRunner> runner_;
  std::vector<model::Sequence*> seqs_;
  std::vector<SparseAttention*> attentions_;
  std::vector<int64_t> positions_;
  std::vector<int32_t> tokens_;
};

class PerRequestStepExecutor : public StepExecutor {
 public:
  explicit PerRequestStepExecutor(const model::Model* model) : model_(model) {}
  absl::string_view name() const override { return "per-request"; }

  void Step(absl::Span<const StepRequest> batch, std::vector<float>* logits,
            std::vector<absl::Status>* statuses) override {
    const int64_t vocab = model_->config().vocab_size;
    logits->resize(batch.size() * vocab);
    statuses->assign(batch.size(), absl::OkStatus());
    for (size_t i = 0; i < batch.size(); ++i) {
      (*statuses)[i] = model_->Forward(*batch[i].seq, absl::MakeConstSpan(&batch[i].token, 1),
                                       &one_);
      if ((*statuses)[i].ok()) std::copy(one_.begin(), one_.end(), logits->begin() + i * vocab);
    }
  }

 private:
  const model::Model* const model_;
  std::vector<float> one_;
};

}  // namespace

void SampleRows(absl::Span<const StepRequest> batch, absl::Span<const float> logits,
                absl::Span<const absl::Status> statuses, std::vector<int32_t>* tokens) {
  tokens->assign(batch.size(), -1);
  if (batch.empty()) return;
  const size_t vocab = logits.size() / batch.size();
  for (size_t i = 0; i < batch.size(); ++i) {
    if (batch[i].sampler == nullptr || !statuses[i].ok()) continue;
    (*tokens)[i] = batch[i].sampler->Sample(logits.subspan(i * vocab, vocab));
  }
}

void StepExecutor::StepAndSample(absl::Span<const StepRequest> batch,
                                 std::vector<int32_t>* tokens, std::vector<float>* logits,
                                 std::vector<absl::Status>* statuses) {
  Step(batch, logits, statuses);
  SampleRows(batch, *logits, *statuses, tokens);
}

std::unique_ptr<StepExecutor> NewCpuStepExecutor(const model::Model* model,
                                                 const kernels::cpu::CpuPool* pool) {
  // The dispatched ISA never fails to construct (only a forced one can).
  absl::StatusOr<std::unique_ptr<kernels::AttentionBackend>> backend =
      kernels::cpu::NewCpuAttentionBackend({pool, std::nullopt});
  CHECK(backend.ok()) << backend.status();
  return std::make_unique<CpuStepExecutor>(model, pool, std::move(*backend));
}

std::unique_ptr<StepExecutor> NewPerRequestStepExecutor(const model::Model* model) {
  return std::make_unique<PerRequestStepExecutor>(model);
}

}  // namespace fluxion::decode

#include "decode/step_executor.h"

#include <algorithm>

namespace fluxion::decode {
namespace {

class CpuStepExecutor : public StepExecutor {
 public:
  CpuStepExecutor(const model::Model* model, const kernels::cpu::CpuPool* pool)
      : model_(model), pool_(pool) {}
  absl::string_view name() const override { return "cpu"; }

  void Step(absl::Span<model::Sequence* const> seqs, absl::Span<const int32_t> tokens,
            std::vector<float>* logits, std::vector<absl::Status>* statuses) override {
    // Model::DecodeStep fails as a whole: one request's attention error leaves every cache
    // unspecified, so every request of the batch gets the error.
    const absl::Status s = model_->DecodeStep(seqs, tokens, pool_, logits);
    statuses->assign(seqs.size(), s);
  }

 private:
  const model::Model* const model_;
  const kernels::cpu::CpuPool* const pool_;
};

class PerRequestStepExecutor : public StepExecutor {
 public:
  explicit PerRequestStepExecutor(const model::Model* model) : model_(model) {}
  absl::string_view name() const override { return "per-request"; }

  void Step(absl::Span<model::Sequence* const> seqs, absl::Span<const int32_t> tokens,
            std::vector<float>* logits, std::vector<absl::Status>* statuses) override {
    const int64_t vocab = model_->config().vocab_size;
    logits->resize(seqs.size() * vocab);
    statuses->assign(seqs.size(), absl::OkStatus());
    for (size_t i = 0; i < seqs.size(); ++i) {
      (*statuses)[i] = model_->Forward(*seqs[i], tokens.subspan(i, 1), &one_);
      if ((*statuses)[i].ok()) std::copy(one_.begin(), one_.end(), logits->begin() + i * vocab);
    }
  }

 private:
  const model::Model* const model_;
  std::vector<float> one_;
};

}  // namespace

std::unique_ptr<StepExecutor> NewCpuStepExecutor(const model::Model* model,
                                                 const kernels::cpu::CpuPool* pool) {
  return std::make_unique<CpuStepExecutor>(model, pool);
}

std::unique_ptr<StepExecutor> NewPerRequestStepExecutor(const model::Model* model) {
  return std::make_unique<PerRequestStepExecutor>(model);
}

}  // namespace fluxion::decode

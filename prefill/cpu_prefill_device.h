// The host's cores as a PrefillDevice (prefill/prefill_device.h): the prefill node's CPU path.
// RunBatch runs the model's forward over the prompts in pieces of `piece_tokens` (one prompt alone
// through model::Model::Forward, several stacked through ForwardBatch), each prompt with a full
// attention cache of its own (model::DenseAttention) that reports every computed (piece, layer) to
// the engine as it is stored. Its pages are packed from that cache (rounded to bf16, their records
// encoded from the packed pages) when the engine asks, during the batch (CopyPages) and after it
// (DevicePrefillResult::pages: PagesOutliveBatch), and its sparse state is captured from the same
// cache. Unlike the GPU's, a prompt's pages live as long as its result does: the engine can answer
// a request while its writes are still in flight, and a stuck decode node holds only its own
// requests' caches.
//
// Thread-safe: one batch at a time (RunBatch serialises); the pages of earlier batches are read
// while later ones run.
#ifndef FLUXION_PREFILL_CPU_PREFILL_DEVICE_H_
#define FLUXION_PREFILL_CPU_PREFILL_DEVICE_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "model/model.h"
#include "prefill/prefill_device.h"

namespace fluxion::prefill {

class CpuPrefillDevice final : public PrefillDevice {
 public:
  // `model` must outlive the device. piece_tokens < 1 is taken as 1.
  CpuPrefillDevice(const model::Model* model, int64_t piece_tokens);
  ~CpuPrefillDevice() override;

  const model::ModelConfig& config() const override;
  // Plain host memory (nothing to pin); the engine gives requests of this device staging of
  // their own instead (PagesOutliveBatch), so it is only there for the interface.
  absl::StatusOr<uint8_t*> HostStaging(size_t bytes) override;
  absl::StatusOr<std::vector<absl::StatusOr<DevicePrefillResult>>> RunBatch(
      absl::Span<const DevicePrompt> prompts, const BatchPiecesReady& ready) override;
  absl::Status CopyPages(size_t prompt, int layer, int64_t first_page, int64_t end_page,
                         uint8_t* pages, uint8_t* records) override;
  bool PagesOutliveBatch() const override { return true; }
  bool ComputesPromptLogprobs() const override { return true; }

 private:
  class Prompt;
  // The forward of `prompts`, piece by piece; each prompt's outcome in *statuses, the logits of
  // its last token in *logits. A prompt's hook holds RunBatch's `ready`: it runs only in here.
  void Forward(absl::Span<Prompt* const> prompts, std::vector<absl::Status>* statuses,
               std::vector<std::vector<float>>* logits);
  // One prompt alone, piece by piece; with its prompt logprobs when it asks for them (every
  // piece's logits, reduced to the logprobs as they come).
  absl::Status ForwardAlone(Prompt& p, std::vector<float>* logits);
  // Several prompts stacked through Model::ForwardBatch, piece by piece.
  void ForwardTogether(absl::Span<Prompt* const> prompts, std::vector<absl::Status>* statuses,
                       std::vector<std::vector<float>>* logits);

  const model::Model* const model_;
  const int64_t piece_tokens_;
  std::mutex batch_mu_;  // one RunBatch at a time
  std::mutex last_mu_;   // guards last_
  std::vector<std::shared_ptr<Prompt>> last_;  // the running batch's prompts (CopyPages)
  std::mutex staging_mu_;
  std::vector<uint8_t> staging_;
};

}  // namespace fluxion::prefill

#endif  // FLUXION_PREFILL_CPU_PREFILL_DEVICE_H_

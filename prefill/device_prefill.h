// The prefill forward on one GPU (issue 15): the prompt in chunks through every layer on a CUDA
// DenseOps (model/layer.h's halves, bf16 weights in HBM), each layer's K/V written straight into
// the wire's page layout in HBM and attended there by a causal flash-style kernel
// (kernels/cuda/prefill_attention.h). After every (chunk, layer) the caller hears, on a copy
// thread, which rows are done, and pulls the pages they completed to the host (CopyPages, on the
// copy stream) to send them over UCX while the GPU goes on with the next layer. Then the last
// token's logits and, when asked, the sparse state captured on the device from the last query
// rows (kernels/cuda/sparse_capture.h).
//
// Why chunk-major (a chunk through all layers, then the next): activations stay O(chunk) at any
// prompt length, and a layer's pages still leave the GPU piece by piece as they complete. The
// cache stays in HBM for the whole prompt (the attention of later chunks reads it); at Llama-3.1-8B
// shapes 128K tokens are 16 GiB beside the 16 GiB of weights.
//
// Host memory is the caller's: pages go where CopyPages is told (a slot of the engine's bounded
// staging ring, prefill/staging_ring.h), as [head][page] runs, with, when the run encoded them,
// the pages' selection records (key min / max, computed on the device), so the host never reads
// the pages to build them. Pages stay in HBM until the next Run, so a caller whose ring is full
// sends the rest later. Rows past the prompt's end are zero on the device.
//
// Several prompts run as one batch (RunBatch): their rows are packed into the same chunks, so the
// GEMMs of short prompts run at a chunk's size instead of each prompt's (the weights are read
// once per chunk, not once per prompt), while each prompt keeps its own pages, attention,
// pieces, cancellation and result. A long prompt spans chunks and shares its last one with the
// next prompt's first rows.
//
// Thread-safe: Run() / RunBatch() serialize their callers (one batch at a time owns the GPU).
#ifndef FLUXION_PREFILL_DEVICE_PREFILL_H_
#define FLUXION_PREFILL_DEVICE_PREFILL_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "model/config.h"
#include "model/dense_ops.h"
#include "model/layer.h"
#include "model/sparse_state.h"
#include "prefill/prefill_device.h"

namespace fluxion::prefill {

// Called on the copy thread, in (chunk, layer) order, once rows [first, end) of `layer` are
// computed in HBM (the pages they complete may be pulled with CopyPages). An error stops the run
// (Run returns it).
using PiecesReady = std::function<absl::Status(int layer, int64_t first, int64_t end)>;

struct DevicePrefillOptions {
  // Prompt rows per forward pass through the layers (a multiple of the page size is best).
  int64_t chunk_tokens = 2048;
  model::SparseStateParams sparse;
};

class DevicePrefill : public PrefillDevice {
 public:
  // `ops` must be a CUDA DenseOps holding `params` (Model::UploadParams or model::RandomParams);
  // the prefill owns both. FailedPrecondition for host-memory ops; InvalidArgument for a shape
  // the kernels do not cover (head_dim other than 32, 64, 128).
  static absl::StatusOr<std::unique_ptr<DevicePrefill>> Create(const model::ModelConfig& config,
                                                               std::unique_ptr<model::DenseOps> ops,
                                                               model::ModelParams params,
                                                               const DevicePrefillOptions& options);
  ~DevicePrefill() override;
  DevicePrefill(const DevicePrefill&) = delete;
  DevicePrefill& operator=(const DevicePrefill&) = delete;

  const model::ModelConfig& config() const override;

  // PrefillDevice. The staging is pinned: the device-to-host copies run at the link's rate into
  // it (into pageable memory they ran at ~0.5 GB/s in the first device run, faulting each fresh
  // page in); grown on demand and kept, so the pinning cost is paid once: call it at start-up
  // with the largest size to pay it before serving.
  absl::StatusOr<uint8_t*> HostStaging(size_t bytes) override;

  // Prefills `prompt` (ids already validated against the vocabulary) into pages of `page_tokens`
  // tokens in HBM (config's layers x KV heads x ceil(n / page_tokens) pages of 2 * page_tokens *
  // head_dim bf16), each page's selection record (transfer/page_meta.h, computed on the device
  // by kernels/cuda/page_meta_encode.h) beside it when `encode_meta`. `ready` hears of each
  // piece; `cancelled` is polled between layers. Errors: Cancelled, the first error of `ready`,
  // ResourceExhausted (HBM), Internal (a CUDA failure).
  absl::StatusOr<DevicePrefillResult> Run(absl::Span<const int32_t> prompt, int64_t page_tokens,
                                          bool encode_meta, bool capture_state,
                                          const std::function<bool()>& cancelled,
                                          const PiecesReady& ready);

  // PrefillDevice: the prompts' rows packed into shared chunks in the order given.
  // ResourceExhausted when the pages of all of them do not fit HBM; Internal for a CUDA failure.
  absl::StatusOr<std::vector<absl::StatusOr<DevicePrefillResult>>> RunBatch(
      absl::Span<const DevicePrompt> prompts, const BatchPiecesReady& ready) override;

  // PrefillDevice (prompt 0 after Run): from HBM on the copy stream; pinned destinations copy at
  // the link's rate. Internal for a CUDA failure.
  absl::Status CopyPages(size_t prompt, int layer, int64_t first_page, int64_t end_page,
                         uint8_t* pages, uint8_t* records) override;

 private:
  struct Impl;
  explicit DevicePrefill(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace fluxion::prefill

#endif  // FLUXION_PREFILL_DEVICE_PREFILL_H_

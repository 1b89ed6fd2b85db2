// What the prefill engine needs of whatever computes prompts: batches of prompts through one
// forward, each (chunk, layer) piece reported as it completes, its pages pulled to the host while
// the next layer computes, and the host memory those pages are staged in. DevicePrefill
// (prefill/device_prefill.h) is the GPU's, CpuPrefillDevice (prefill/cpu_prefill_device.h) the
// host cores'; unit tests put a stand-in behind the same interface.
#ifndef FLUXION_PREFILL_PREFILL_DEVICE_H_
#define FLUXION_PREFILL_PREFILL_DEVICE_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "model/config.h"
#include "model/logprobs.h"
#include "model/sparse_state.h"

namespace fluxion::prefill {

// A prompt's computed pages, kept by a device whose pages outlive its batches
// (PrefillDevice::PagesOutliveBatch): Copy is CopyPages for this prompt, valid for as long as the
// object lives, whatever batches run meanwhile.
class PromptPages {
 public:
  virtual ~PromptPages() = default;
  virtual absl::Status Copy(int layer, int64_t first_page, int64_t end_page, uint8_t* pages,
                            uint8_t* records) const = 0;
};

struct DevicePrefillResult {
  std::vector<float> logits;                // the last prompt token's [vocab_size]
  // With DevicePrompt::prompt_logprobs >= 0: one entry per prompt token after the first.
  std::vector<model::TokenLogprobs> prompt_logprobs;
  std::optional<model::SparseState> state;  // when the run was asked to capture it
  std::chrono::steady_clock::time_point forward_end;  // before the capture
  // The prompt's pages from now on, when the device keeps them (PagesOutliveBatch); else null.
  std::shared_ptr<const PromptPages> pages;
};

// Called (on a thread of the device's) in (chunk, layer) order, once rows [first, end) of `layer`
// of prompt `prompt` (its index in RunBatch's span) are computed: the pages they complete may be
// pulled with CopyPages. An error stops that prompt only: it leaves the batch and its result is
// the error.
using BatchPiecesReady =
    std::function<absl::Status(size_t prompt, int layer, int64_t first, int64_t end)>;

// One prompt of a batch: ids already validated against the vocabulary, pages of `page_tokens`
// tokens, each page's selection record (transfer/page_meta.h) computed beside it when
// `encode_meta`, the sparse state captured after the forward when `capture_state`. `cancelled`
// (may be empty) is polled between layers; once true the prompt leaves the batch (Cancelled). A
// device may leave that to `ready`, whose error takes the prompt out too (CpuPrefillDevice does:
// the engine checks cancellation there).
struct DevicePrompt {
  absl::Span<const int32_t> tokens;
  int64_t page_tokens = 16;
  bool encode_meta = false;
  bool capture_state = false;
  std::function<bool()> cancelled;
  // Each prompt token's log-probability after the first and the position's `prompt_logprobs`
  // most likely tokens (-1: none). Only for a device that ComputesPromptLogprobs.
  int32_t prompt_logprobs = -1;
};

class PrefillDevice {
 public:
  virtual ~PrefillDevice() = default;

  virtual const model::ModelConfig& config() const = 0;

  // Host memory of at least `bytes` for the engine's staging rings and the page records that
  // CopyPages writes. The pointer stays valid until a larger call; one caller at a time (the
  // engine holds its device lock). ResourceExhausted when the memory cannot be had.
  virtual absl::StatusOr<uint8_t*> HostStaging(size_t bytes) = 0;

  // Several prompts through one forward, in the order given. The outer error is the batch's (the
  // device's memory, a device failure); otherwise one result per prompt: its logits and state, or
  // its own error (Cancelled, the first error `ready` returned for it). Pieces of different
  // prompts interleave; those of one prompt come in order.
  virtual absl::StatusOr<std::vector<absl::StatusOr<DevicePrefillResult>>> RunBatch(
      absl::Span<const DevicePrompt> prompts, const BatchPiecesReady& ready) = 0;

  // Copies pages [first_page, end_page) of every KV head of `layer` of prompt `prompt` of the last
  // batch to `pages` as [head][end_page - first_page] pages (transfer::PackPageRange's layout),
  // and, when `records` is not null and that prompt encoded them, their records into `records`,
  // the layer's block (record (head, page) at its place in the block). Call it from `ready` for
  // rows it reported, or after the batch returned and before the next. InvalidArgument for a
  // prompt, range or layer the last batch does not have.
  virtual absl::Status CopyPages(size_t prompt, int layer, int64_t first_page, int64_t end_page,
                                 uint8_t* pages, uint8_t* records) = 0;

  // Whether each prompt's pages stay readable after its batch, in DevicePrefillResult::pages,
  // whatever batches follow (the CPU's: each prompt's own cache). The engine then gives every
  // request staging of its own (HostStaging is not asked) and answers it without waiting for its
  // writes: a decode node that does not take them holds only its own requests. False (the GPU's):
  // the pages live in device memory the next batch reuses, staging is HostStaging's, and a batch's
  // writes all land before the next batch.
  virtual bool PagesOutliveBatch() const { return false; }

  // Whether RunBatch computes DevicePrompt::prompt_logprobs (every prompt row through the LM
  // head). The GPU's does not yet: the engine refuses such requests before they reach it.
  virtual bool ComputesPromptLogprobs() const { return false; }
};

}  // namespace fluxion::prefill

#endif  // FLUXION_PREFILL_PREFILL_DEVICE_H_

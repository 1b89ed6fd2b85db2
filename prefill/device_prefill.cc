#include "prefill/device_prefill.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/page_meta_encode.h"
#include "kernels/cuda/prefill_attention.h"
#include "kernels/cuda/sparse_capture.h"
#include "model/generator.h"

namespace fluxion::prefill {
namespace {

using Clock = std::chrono::steady_clock;

absl::Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("device prefill: ", what, ": ", cudaGetErrorString(e)));
}

// An owned CUDA stream / event: destroyed with the object.
class Stream {
 public:
  Stream() = default;
  ~Stream() {
    if (s_ != nullptr) cudaStreamDestroy(s_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  absl::Status Init() {
    return CudaStatus(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "copy stream");
  }
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

class Event {
 public:
  Event() = default;
  ~Event() {
    if (e_ != nullptr) cudaEventDestroy(e_);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  absl::Status Init() {
    return CudaStatus(cudaEventCreateWithFlags(&e_, cudaEventDisableTiming), "event");
  }
  cudaEvent_t get() const { return e_; }

 private:
  cudaEvent_t e_ = nullptr;
};

// One computed piece: rows [first, end) of `layer` of prompt `prompt`, complete on the compute
// stream at `ready`.
struct Piece {
  size_t prompt = 0;
  int layer = 0;
  int64_t first = 0, end = 0;
  cudaEvent_t ready = nullptr;
};

// The copy thread: waits for each piece, in order, and tells the caller's callback (which pulls
// the pages it wants with CopyPages, on the copy stream). A callback's error stops its prompt
// (later pieces of it are dropped); a failed wait stops them all. The compute loop polls
// failed() between layers.
class PieceReporter {
 public:
  PieceReporter(int device, size_t prompts, const BatchPiecesReady& ready)
      : device_(device), ready_(ready), status_(prompts), thread_([this] { Loop(); }) {}
  ~PieceReporter() { Finish(); }

  void Push(const Piece& p) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(p);
    cv_.notify_one();
  }
  bool failed(size_t prompt) const {
    std::lock_guard<std::mutex> lock(mu_);
    return !all_.ok() || !status_[prompt].ok();
  }
  // Reports what is queued and stops the thread.
  void Finish() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = true;
      cv_.notify_one();
    }
    if (thread_.joinable()) thread_.join();
  }
  // After Finish: a failed wait (every prompt's), then each prompt's first callback error.
  const absl::Status& all() const { return all_; }
  const absl::Status& status(size_t prompt) const { return status_[prompt]; }

 private:
  void Loop() {
    cudaSetDevice(device_);
    for (;;) {
      Piece p;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return closed_ || !queue_.empty(); });
        if (queue_.empty()) return;
        p = queue_.front();
        queue_.pop_front();
        // Drain without work after a failure.
        if (!all_.ok() || !status_[p.prompt].ok()) continue;
      }
      if (absl::Status s = CudaStatus(cudaEventSynchronize(p.ready), "wait for a piece"); !s.ok()) {
        std::lock_guard<std::mutex> lock(mu_);
        all_ = s;
        continue;
      }
      if (absl::Status s = ready_(p.prompt, p.layer, p.first, p.end); !s.ok()) {
        std::lock_guard<std::mutex> lock(mu_);
        status_[p.prompt] = s;
      }
    }
  }

  const int device_;
  const BatchPiecesReady& ready_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Piece> queue_;
  bool closed_ = false;
  absl::Status all_;
  std::vector<absl::Status> status_;
  std::thread thread_;  // last: starts after everything it reads
};

// A page's selection record: key min and max, bf16 (transfer/page_meta.h): 4 bytes per dim.
constexpr size_t kRecordBytesPerDim = 4;

// Where one prompt of the last batch lives in HBM, for CopyPages and the capture.
struct PromptLayout {
  int64_t tokens = 0, page_tokens = 0, pages_per_head = 0, tail_rows = 0;
  size_t page_bytes = 0, layer_bytes = 0, pages_offset = 0;  // bytes into the pages buffer
  size_t meta_layer_bytes = 0, meta_offset = 0;               // 0 / unused without records
  size_t tail_offset = 0;  // floats into the tail queries: [layer][tail row][q head][head_dim]
  bool meta = false;
};

// Rows [first, first + rows) of prompt `prompt` at rows [offset, offset + rows) of a chunk.
struct Segment {
  size_t prompt = 0;
  int64_t first = 0, rows = 0, offset = 0;
};

// A batch's prompts laid out in HBM: each prompt's pages (every layer), records and tail queries,
// and what the three buffers and the batch's rows add up to.
struct BatchLayout {
  std::vector<PromptLayout> prompts;
  size_t pages_bytes = 0, meta_bytes = 0, tail_floats = 0;
  int64_t total_rows = 0;
};

absl::StatusOr<BatchLayout> LayOut(absl::Span<const DevicePrompt> prompts,
                                   const model::ModelConfig& c) {
  const int64_t hkv = c.num_kv_heads, d = c.head_dim, hq = c.num_heads, layers = c.num_layers;
  BatchLayout b;
  b.prompts.resize(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    const DevicePrompt& p = prompts[i];
    const int64_t n = static_cast<int64_t>(p.tokens.size());
    if (n < 1 || p.page_tokens < 1) {
      return absl::InvalidArgumentError("the device prefill needs prompts and a page size");
    }
    PromptLayout& l = b.prompts[i];
    l.tokens = n;
    l.page_tokens = p.page_tokens;
    l.pages_per_head = (n + p.page_tokens - 1) / p.page_tokens;
    l.tail_rows = std::min<int64_t>(model::kPrefillTailRows, n);
    l.page_bytes = static_cast<size_t>(2 * p.page_tokens * d) * 2;
    l.layer_bytes = static_cast<size_t>(hkv * l.pages_per_head) * l.page_bytes;
    l.pages_offset = b.pages_bytes;
    b.pages_bytes += l.layer_bytes * layers;
    l.meta = p.encode_meta;
    if (l.meta) {  // the records of a layer: (head, page) in the pages' order, 4 * head_dim bytes
      l.meta_layer_bytes = static_cast<size_t>(hkv * l.pages_per_head) * kRecordBytesPerDim * d;
      l.meta_offset = b.meta_bytes;
      b.meta_bytes += l.meta_layer_bytes * layers;
    }
    l.tail_offset = b.tail_floats;
    b.tail_floats += static_cast<size_t>(layers * l.tail_rows * hq * d);
    b.total_rows += n;
  }
  return b;
}

// One segment's device work at `layer` of the chunk in `buf`: its K/V into its pages `lp`, the
// records of every page its rows touched (into `layer_meta` when l.meta), its causal attention,
// and the queries of its rows in the prompt's tail (into `tail_q`, the batch's tail queries).
absl::Status SegmentLayer(const model::StepBuffers& buf, const PromptLayout& l,
                          const kernels::cuda::LayerPages& lp, const Segment& sg, int64_t layer,
                          int64_t hq, float scale, uint8_t* layer_meta, float* tail_q,
                          cudaStream_t stream) {
  const int64_t d = lp.head_dim, kv_row = lp.num_kv_heads * d;
  FLUXION_RETURN_IF_ERROR(CudaStatus(
      kernels::cuda::WriteLayerPages(lp, buf.k + sg.offset * kv_row, buf.v + sg.offset * kv_row,
                                     kv_row, sg.first, sg.rows, stream),
      "write pages"));
  if (l.meta) {
    FLUXION_RETURN_IF_ERROR(CudaStatus(
        kernels::cuda::EncodePageMeta(lp, l.tokens, sg.first / l.page_tokens,
                                      (sg.first + sg.rows + l.page_tokens - 1) / l.page_tokens,
                                      layer_meta, stream),
        "page records"));
  }
  FLUXION_RETURN_IF_ERROR(CudaStatus(
      kernels::cuda::CausalPrefillAttention(lp, buf.q + sg.offset * hq * d, sg.first, sg.rows, hq,
                                            scale, buf.attn + sg.offset * hq * d, stream),
      "attention"));
  const int64_t tail0 = l.tokens - l.tail_rows;
  const int64_t t_begin = std::max(sg.first, tail0), t_end = sg.first + sg.rows;
  if (t_end <= t_begin) return absl::OkStatus();  // no row of the tail
  return CudaStatus(
      cudaMemcpyAsync(tail_q + l.tail_offset + ((layer * l.tail_rows) + (t_begin - tail0)) * hq * d,
                      buf.q + (sg.offset + t_begin - sg.first) * hq * d,
                      sizeof(float) * (t_end - t_begin) * hq * d, cudaMemcpyDeviceToDevice,
                      stream),
      "tail queries");
}

// The next chunk of at most `chunk` rows: the rows of the prompts still in (`still_in(i, 0)`), in
// order, each from where it stopped (*next, advanced), their tokens and positions into `tokens`
// and `positions`, their segments into *segments; *first_open skips the prompts done or gone.
// Returns the chunk's rows (0: nothing left).
template <typename StillIn>
int64_t PackChunk(absl::Span<const DevicePrompt> prompts, int64_t chunk, StillIn& still_in,
                  size_t* first_open, std::vector<int64_t>* next, std::vector<Segment>* segments,
                  int32_t* tokens, int64_t* positions) {
  segments->clear();
  int64_t rows = 0;
  for (size_t i = *first_open; i < prompts.size() && rows < chunk; ++i) {
    const int64_t n = static_cast<int64_t>(prompts[i].tokens.size());
    int64_t& at = (*next)[i];
    if (at == n || !still_in(i, 0)) {
      if (i == *first_open) ++*first_open;
      continue;
    }
    const int64_t take = std::min(chunk - rows, n - at);
    segments->push_back({i, at, take, rows});
    std::copy_n(prompts[i].tokens.data() + at, take, tokens + rows);
    for (int64_t r = 0; r < take; ++r) positions[rows + r] = at + r;
    at += take;
    rows += take;
  }
  return rows;
}

}  // namespace

struct DevicePrefill::Impl {
  model::ModelConfig config;
  std::unique_ptr<model::DenseOps> ops;
  model::ModelParams params;
  DevicePrefillOptions options;
  int device = 0;
  std::mutex mu;  // one Run at a time
  Stream copy_stream;
  model::StepBuffers buf;
  std::unique_ptr<model::OpsBuffer> pages, meta, logits, tail_q;
  std::mutex copy_mu;               // CopyPages: the copy stream and `last`
  std::vector<PromptLayout> last;  // of the last batch, set before its first piece is reported
  std::mutex staging_mu;
  void* staging = nullptr;  // pinned (cudaHostAlloc), grown by HostStaging, freed with the prefill
  size_t staging_bytes = 0;
  ~Impl() {
    if (staging != nullptr) cudaFreeHost(staging);
  }

  // The buffers of a batch laid out as `b` of `count` prompts, its pages cleared (rows past a
  // prompt's end in each head's last page go out as zeros).
  absl::Status ReserveBatch(const BatchLayout& b, size_t count, cudaStream_t stream) {
    FLUXION_RETURN_IF_ERROR(Reserve(pages, b.pages_bytes));
    FLUXION_RETURN_IF_ERROR(Reserve(tail_q, sizeof(float) * b.tail_floats));
    FLUXION_RETURN_IF_ERROR(Reserve(logits, sizeof(float) * count * config.vocab_size));
    if (b.meta_bytes > 0) FLUXION_RETURN_IF_ERROR(Reserve(meta, b.meta_bytes));
    return CudaStatus(cudaMemsetAsync(pages->data(), 0, b.pages_bytes, stream), "clear pages");
  }

  // Grows `b` to at least `bytes` (contents not kept).
  absl::Status Reserve(std::unique_ptr<model::OpsBuffer>& b, size_t bytes) {
    if (b != nullptr && b->size() >= bytes) return absl::OkStatus();
    b.reset();
    FLUXION_ASSIGN_OR_RETURN(b, ops->Allocate(bytes));
    return absl::OkStatus();
  }

  // A prompt's result once the forward is over: `logits`, and its sparse state when `capture`
  // (from its pages, first layer's at `first_layer`, and the batch's tail queries `tail_q`).
  absl::StatusOr<DevicePrefillResult> Result(const PromptLayout& l,
                                             const kernels::cuda::LayerPages& first_layer,
                                             bool capture, std::vector<float> logits,
                                             Clock::time_point forward_end, const float* tail_q,
                                             cudaStream_t stream) {
    DevicePrefillResult r;
    r.logits = std::move(logits);
    r.forward_end = forward_end;
    if (capture) {
      FLUXION_ASSIGN_OR_RETURN(r.state, Capture(first_layer, l.layer_bytes, l.tokens, l.tail_rows,
                                                tail_q + l.tail_offset, stream));
    }
    return r;
  }

  // The sparse state of one prompt from its pages and its tail queries ([layer][row][head][dim]).
  absl::StatusOr<model::SparseState> Capture(const kernels::cuda::LayerPages& first_layer,
                                             size_t layer_bytes, int64_t tokens, int64_t rows,
                                             const float* tail_q_base, cudaStream_t stream);
};

DevicePrefill::DevicePrefill(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DevicePrefill::~DevicePrefill() = default;

const model::ModelConfig& DevicePrefill::config() const { return impl_->config; }

absl::StatusOr<uint8_t*> DevicePrefill::HostStaging(size_t bytes) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.staging_mu);
  if (m.staging_bytes >= bytes) return static_cast<uint8_t*>(m.staging);
  if (m.staging != nullptr) cudaFreeHost(m.staging);
  m.staging = nullptr;
  m.staging_bytes = 0;
  FLUXION_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(m.device), "device"));
  if (cudaHostAlloc(&m.staging, bytes, cudaHostAllocDefault) != cudaSuccess) {
    m.staging = nullptr;
    return absl::ResourceExhaustedError(
        absl::StrCat("device prefill: cannot pin ", bytes >> 20, " MiB of host staging"));
  }
  m.staging_bytes = bytes;
  return static_cast<uint8_t*>(m.staging);
}

absl::StatusOr<std::unique_ptr<DevicePrefill>> DevicePrefill::Create(
    const model::ModelConfig& config, std::unique_ptr<model::DenseOps> ops,
    model::ModelParams params, const DevicePrefillOptions& options) {
  if (ops == nullptr || ops->host_memory() || ops->native_stream() == nullptr) {
    return absl::FailedPreconditionError("the device prefill needs CUDA dense ops");
  }
  if (config.head_dim != 32 && config.head_dim != 64 && config.head_dim != 128) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the device prefill's attention covers head_dim 32, 64 and 128, not ", config.head_dim));
  }
  if (options.chunk_tokens < 1) {
    return absl::InvalidArgumentError("the device prefill's chunk must hold at least one token");
  }
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  impl->options = options;
  FLUXION_RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&impl->device), "device"));
  FLUXION_RETURN_IF_ERROR(model::FuseParams(*ops, &params));
  FLUXION_ASSIGN_OR_RETURN(impl->buf,
                           model::StepBuffers::Create(*ops, config, options.chunk_tokens));
  FLUXION_RETURN_IF_ERROR(impl->copy_stream.Init());
  impl->ops = std::move(ops);
  impl->params = std::move(params);
  FLUXION_RETURN_IF_ERROR(impl->ops->Sync());
  return std::unique_ptr<DevicePrefill>(new DevicePrefill(std::move(impl)));
}

absl::StatusOr<DevicePrefillResult> DevicePrefill::Run(absl::Span<const int32_t> prompt,
                                                       int64_t page_tokens, bool encode_meta,
                                                       bool capture_state,
                                                       const std::function<bool()>& cancelled,
                                                       const PiecesReady& ready) {
  const DevicePrompt one[] = {{prompt, page_tokens, encode_meta, capture_state, cancelled}};
  FLUXION_ASSIGN_OR_RETURN(
      std::vector<absl::StatusOr<DevicePrefillResult>> results,
      RunBatch(one, [&](size_t, int layer, int64_t first, int64_t end) {
        return ready(layer, first, end);
      }));
  return std::move(results[0]);
}

absl::StatusOr<std::vector<absl::StatusOr<DevicePrefillResult>>> DevicePrefill::RunBatch(
    absl::Span<const DevicePrompt> prompts, const BatchPiecesReady& ready) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  const model::ModelConfig& c = m.config;
  const size_t count = prompts.size();
  std::vector<absl::StatusOr<DevicePrefillResult>> results(count, absl::UnknownError("not run"));
  if (count == 0) return results;
  FLUXION_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(m.device), "device"));
  model::DenseOps& ops = *m.ops;
  cudaStream_t stream = static_cast<cudaStream_t>(ops.native_stream());
  const int64_t hkv = c.num_kv_heads, d = c.head_dim, hq = c.num_heads, layers = c.num_layers;
  // Each prompt's place in HBM: its pages (every layer), its records, its tail queries.
  FLUXION_ASSIGN_OR_RETURN(const BatchLayout batch, LayOut(prompts, c));
  const std::vector<PromptLayout>& layout = batch.prompts;
  FLUXION_RETURN_IF_ERROR(m.ReserveBatch(batch, count, stream));
  uint8_t* dev_pages = static_cast<uint8_t*>(m.pages->data());
  uint8_t* dev_meta = batch.meta_bytes > 0 ? static_cast<uint8_t*>(m.meta->data()) : nullptr;
  float* tail_q = static_cast<float*>(m.tail_q->data());
  float* logits = static_cast<float*>(m.logits->data());
  auto layer_pages = [&](size_t i, int64_t layer) {
    const PromptLayout& l = layout[i];
    return kernels::cuda::LayerPages{dev_pages + l.pages_offset + layer * l.layer_bytes, hkv, d,
                                     l.page_tokens, l.pages_per_head};
  };
  {
    std::lock_guard<std::mutex> copy_lock(m.copy_mu);
    m.last = layout;
  }

  const int64_t chunk = m.options.chunk_tokens;
  // Packed chunks number at most this (fewer once prompts leave).
  std::vector<Event> events(static_cast<size_t>((batch.total_rows + chunk - 1) / chunk * layers));
  for (Event& e : events) FLUXION_RETURN_IF_ERROR(e.Init());
  PieceReporter reporter(m.device, count, ready);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<int32_t> tokens(chunk);
  std::vector<int64_t> positions(chunk);
  std::vector<int64_t> next(count, 0);           // each prompt's next row to compute
  std::vector<absl::Status> left_batch(count);  // why a prompt left (Cancelled), else OK
  std::vector<Segment> segments;
  // Leaves the batch when cancelled or its callback failed; true while it is still in.
  auto still_in = [&](size_t i, int64_t layer) {
    if (!left_batch[i].ok() || reporter.failed(i)) return false;
    if (prompts[i].cancelled && prompts[i].cancelled()) {
      left_batch[i] = absl::CancelledError(absl::StrCat("prefill cancelled at layer ", layer + 1));
      return false;
    }
    return true;
  };
  absl::Status forward;
  for (size_t ci = 0, first_open = 0; forward.ok(); ++ci) {
    const int64_t rows = PackChunk(prompts, chunk, still_in, &first_open, &next, &segments,
                                   tokens.data(), positions.data());
    if (rows == 0) break;
    model::EmbedRows(ops, m.params, c, m.buf, tokens.data(), positions.data(), rows);
    absl::StatusOr<int64_t> computed = model::RunLayers(
        ops, c, m.params, m.buf, rows, [&](int layer, int64_t r) -> absl::StatusOr<int64_t> {
          bool any = false;
          for (const Segment& sg : segments) {
            if (!still_in(sg.prompt, layer)) continue;  // its rows go on, unread
            any = true;
            const PromptLayout& l = layout[sg.prompt];
            uint8_t* layer_meta =
                l.meta ? dev_meta + l.meta_offset + layer * l.meta_layer_bytes : nullptr;
            FLUXION_RETURN_IF_ERROR(SegmentLayer(m.buf, l, layer_pages(sg.prompt, layer), sg,
                                                 layer, hq, scale, layer_meta, tail_q, stream));
          }
          if (!any) return 0;  // every prompt of the chunk left: stop it here
          cudaEvent_t done = events[ci * layers + layer].get();
          FLUXION_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(done, stream), "event"));
          for (const Segment& sg : segments) {
            if (left_batch[sg.prompt].ok() && !reporter.failed(sg.prompt)) {
              reporter.Push({sg.prompt, layer, sg.first, sg.first + sg.rows, done});
            }
          }
          return r;
        });
    if (!computed.ok()) {
      forward = computed.status();
    } else if (*computed > 0) {  // the prompts that ended in this chunk: their last token's logits
      for (const Segment& sg : segments) {
        if (sg.first + sg.rows != layout[sg.prompt].tokens || !left_batch[sg.prompt].ok()) continue;
        model::LmHead(ops, m.params, c, m.buf, m.buf.x + (sg.offset + sg.rows - 1) * c.hidden_size,
                      1, logits + sg.prompt * c.vocab_size);
      }
    }
  }
  std::vector<std::vector<float>> host_logits(count);
  if (forward.ok()) {
    for (size_t i = 0; i < count; ++i) {
      if (next[i] != layout[i].tokens || !left_batch[i].ok()) continue;
      host_logits[i].resize(c.vocab_size);
      ops.CopyToHost(host_logits[i].data(), logits + i * c.vocab_size,
                     c.vocab_size * sizeof(float));
    }
    forward = ops.Sync();
  } else {
    (void)ops.Sync();  // the reporter may still wait on what was queued
  }
  const Clock::time_point forward_end = Clock::now();
  reporter.Finish();
  FLUXION_RETURN_IF_ERROR(reporter.all());
  FLUXION_RETURN_IF_ERROR(forward);
  for (size_t i = 0; i < count; ++i) {
    // The copy thread's error first: a prompt that left because of it says only that.
    if (!reporter.status(i).ok()) {
      results[i] = reporter.status(i);
      continue;
    }
    if (!left_batch[i].ok()) {
      results[i] = left_batch[i];
      continue;
    }
    results[i] = m.Result(layout[i], layer_pages(i, 0), prompts[i].capture_state,
                          std::move(host_logits[i]), forward_end, tail_q, stream);
  }
  return results;
}

absl::Status DevicePrefill::CopyPages(size_t prompt, int layer, int64_t first_page,
                                      int64_t end_page, uint8_t* pages, uint8_t* records) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.copy_mu);
  if (prompt >= m.last.size()) {
    return absl::InvalidArgumentError(absl::StrCat("device prefill: no prompt ", prompt,
                                                   " in the last batch (", m.last.size(), ")"));
  }
  const PromptLayout& r = m.last[prompt];
  if (layer < 0 || layer >= m.config.num_layers || first_page < 0 || end_page <= first_page ||
      end_page > r.pages_per_head) {
    return absl::InvalidArgumentError(
        absl::StrCat("device prefill: pages [", first_page, ", ", end_page, ") of layer ", layer,
                     " are not pages of prompt ", prompt, " (", r.pages_per_head, " per head, ",
                     m.config.num_layers, " layers)"));
  }
  FLUXION_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(m.device), "device"));
  const cudaStream_t stream = m.copy_stream.get();
  const int64_t hkv = m.config.num_kv_heads, count = end_page - first_page;
  const size_t record_bytes = kRecordBytesPerDim * m.config.head_dim;
  const auto* dev_pages =
      static_cast<const uint8_t*>(m.pages->data()) + r.pages_offset + layer * r.layer_bytes;
  for (int64_t h = 0; h < hkv; ++h) {
    const int64_t index = h * r.pages_per_head + first_page;  // (head, page) in the layer
    FLUXION_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(pages + h * count * r.page_bytes, dev_pages + index * r.page_bytes,
                        static_cast<size_t>(count) * r.page_bytes, cudaMemcpyDeviceToHost, stream),
        "pages to host"));
    if (records != nullptr && r.meta) {
      const auto* dev_meta = static_cast<const uint8_t*>(m.meta->data()) + r.meta_offset +
                             layer * r.meta_layer_bytes;
      FLUXION_RETURN_IF_ERROR(CudaStatus(
          cudaMemcpyAsync(records + index * record_bytes, dev_meta + index * record_bytes,
                          static_cast<size_t>(count) * record_bytes, cudaMemcpyDeviceToHost,
                          stream),
          "page records to host"));
    }
  }
  return CudaStatus(cudaStreamSynchronize(stream), "pages to host");
}

absl::StatusOr<model::SparseState> DevicePrefill::Impl::Capture(
    const kernels::cuda::LayerPages& first_layer, size_t layer_bytes, int64_t tokens,
    int64_t rows, const float* tail_q_base, cudaStream_t stream) {
  namespace kc = kernels::cuda;
  const model::ModelConfig& c = config;
  const int64_t hkv = c.num_kv_heads, hq = c.num_heads, group = hq / hkv, d = c.head_dim;
  const model::SparseStateParams& sp = options.sparse;
  std::unique_ptr<model::OpsBuffer> scratch, tables, stats;
  FLUXION_ASSIGN_OR_RETURN(scratch,
                           ops->Allocate(kc::TailCaptureScratchBytes(rows, hq, hkv, tokens)));
  FLUXION_ASSIGN_OR_RETURN(tables, ops->Allocate(sizeof(float) * 2 * hkv * tokens));
  const size_t stats_bytes =
      sizeof(kc::TailRowHeadStats) * rows * hq + sizeof(kc::TailRowMiddle) * rows * hkv;
  FLUXION_ASSIGN_OR_RETURN(stats, ops->Allocate(stats_bytes));
  float* vertical = static_cast<float*>(tables->data());
  float* slash = vertical + hkv * tokens;
  auto* row_heads = static_cast<kc::TailRowHeadStats*>(stats->data());
  auto* middles = reinterpret_cast<kc::TailRowMiddle*>(row_heads + rows * hq);

  model::SparseState st;
  st.num_layers = c.num_layers;
  st.num_kv_heads = hkv;
  st.group = group;
  st.tokens = tokens;
  st.tail_rows = rows;
  st.params = sp;
  st.heads.resize(c.num_layers * hkv);
  std::vector<float> host_tables(2 * hkv * tokens);
  std::vector<kc::TailRowHeadStats> host_rows(rows * hq);
  std::vector<kc::TailRowMiddle> host_middles(rows * hkv);
  kc::TailCaptureParams params{tokens,        rows,       hq, 1.0f / std::sqrt(static_cast<float>(d)),
                               sp.decay,      sp.sink_tokens, sp.local_tokens, sp.coverage};
  for (int64_t l = 0; l < c.num_layers; ++l) {
    kc::LayerPages lp = first_layer;
    lp.base = static_cast<uint8_t*>(first_layer.base) + l * layer_bytes;
    FLUXION_RETURN_IF_ERROR(CudaStatus(
        kc::CaptureLayerTail(lp, tail_q_base + l * rows * hq * d, params, scratch->data(),
                             vertical, slash, row_heads, middles, stream),
        "sparse-state capture"));
    ops->CopyToHost(host_tables.data(), vertical, sizeof(float) * 2 * hkv * tokens);
    ops->CopyToHost(host_rows.data(), row_heads, sizeof(kc::TailRowHeadStats) * rows * hq);
    ops->CopyToHost(host_middles.data(), middles, sizeof(kc::TailRowMiddle) * rows * hkv);
    FLUXION_RETURN_IF_ERROR(ops->Sync());
    for (int64_t h = 0; h < hkv; ++h) {
      model::HeadSparseState& hs = st.heads[l * hkv + h];
      hs.vertical.assign(host_tables.begin() + h * tokens, host_tables.begin() + (h + 1) * tokens);
      hs.slash.assign(host_tables.begin() + (hkv + h) * tokens,
                      host_tables.begin() + (hkv + h + 1) * tokens);
      // The features as model::CaptureSparseState averages them.
      double share_max = 0, need_sum = 0, sink = 0, local = 0, entropy = 0;
      int64_t need_rows = 0;
      for (int64_t i = 0; i < rows; ++i) {
        const kc::TailRowMiddle& mid = host_middles[i * hkv + h];
        share_max = std::max(share_max, std::min(1.0, static_cast<double>(mid.share)));
        if (mid.middle > 0 && mid.share > 0) {
          need_sum += static_cast<double>(mid.needed) / static_cast<double>(mid.middle);
          ++need_rows;
        }
        for (int64_t g = 0; g < group; ++g) {
          const kc::TailRowHeadStats& r = host_rows[i * hq + h * group + g];
          sink += r.sink;
          local += r.local;
          entropy += r.entropy;
        }
      }
      const double head_rows = static_cast<double>(rows * group);
      hs.middle_share = static_cast<float>(share_max);
      hs.need_fraction = need_rows > 0 ? static_cast<float>(need_sum / need_rows) : 1.0f;
      hs.sink_mass = static_cast<float>(sink / head_rows);
      hs.local_mass = static_cast<float>(local / head_rows);
      hs.entropy = static_cast<float>(entropy / head_rows);
    }
  }
  return st;
}

}  // namespace fluxion::prefill

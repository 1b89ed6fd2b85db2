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

// One computed piece: rows [first, end) of `layer`, complete on the compute stream at `ready`.
struct Piece {
  int layer = 0;
  int64_t first = 0, end = 0;
  cudaEvent_t ready = nullptr;
};

// The copy thread: waits for each piece, in order, and tells the caller's callback (which pulls
// the pages it wants with CopyPages, on the copy stream). The first error (a wait's or the
// callback's) is kept and stops further work; the compute loop polls failed() between layers.
class PieceReporter {
 public:
  PieceReporter(int device, const PiecesReady& ready)
      : device_(device), ready_(ready), thread_([this] { Loop(); }) {}
  ~PieceReporter() { (void)Finish(); }

  void Push(const Piece& p) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(p);
    cv_.notify_one();
  }
  bool failed() const {
    std::lock_guard<std::mutex> lock(mu_);
    return !status_.ok();
  }
  // Reports what is queued, stops the thread, and returns the first error.
  absl::Status Finish() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = true;
      cv_.notify_one();
    }
    if (thread_.joinable()) thread_.join();
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }

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
        if (!status_.ok()) continue;  // drain without work after a failure
      }
      absl::Status s = CudaStatus(cudaEventSynchronize(p.ready), "wait for a piece");
      if (s.ok()) s = ready_(p.layer, p.first, p.end);
      if (!s.ok()) {
        std::lock_guard<std::mutex> lock(mu_);
        if (status_.ok()) status_ = s;
      }
    }
  }

  const int device_;
  const PiecesReady& ready_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Piece> queue_;
  bool closed_ = false;
  absl::Status status_;
  std::thread thread_;  // last: starts after everything it reads
};

// The shape of the last Run's pages in HBM, for CopyPages.
struct RunLayout {
  int64_t pages_per_head = 0;
  size_t page_bytes = 0, layer_bytes = 0, record_bytes = 0, meta_layer_bytes = 0;
  bool meta = false;
};

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
  std::mutex copy_mu;  // CopyPages: the copy stream and `last`
  RunLayout last;      // of the last Run, set before its first piece is reported
  std::mutex staging_mu;
  void* staging = nullptr;  // pinned (cudaHostAlloc), grown by HostStaging, freed with the prefill
  size_t staging_bytes = 0;
  ~Impl() {
    if (staging != nullptr) cudaFreeHost(staging);
  }

  // Grows `b` to at least `bytes` (contents not kept).
  absl::Status Reserve(std::unique_ptr<model::OpsBuffer>& b, size_t bytes) {
    if (b != nullptr && b->size() >= bytes) return absl::OkStatus();
    b.reset();
    FLUXION_ASSIGN_OR_RETURN(b, ops->Allocate(bytes));
    return absl::OkStatus();
  }

  absl::StatusOr<model::SparseState> Capture(const kernels::cuda::LayerPages& first_layer,
                                             size_t layer_bytes, int64_t tokens, int64_t rows,
                                             cudaStream_t stream);
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
  FLUXION_ASSIGN_OR_RETURN(impl->logits, ops->Allocate(config.vocab_size * sizeof(float)));
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
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  const model::ModelConfig& c = m.config;
  const int64_t n = static_cast<int64_t>(prompt.size());
  if (n < 1 || page_tokens < 1) {
    return absl::InvalidArgumentError("the device prefill needs a prompt and a page size");
  }
  FLUXION_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(m.device), "device"));
  model::DenseOps& ops = *m.ops;
  cudaStream_t stream = static_cast<cudaStream_t>(ops.native_stream());
  const int64_t hkv = c.num_kv_heads, d = c.head_dim, hq = c.num_heads;
  const int64_t pph = (n + page_tokens - 1) / page_tokens;
  const size_t page_bytes = static_cast<size_t>(2 * page_tokens * d) * 2;
  const size_t layer_bytes = static_cast<size_t>(hkv * pph) * page_bytes;
  const int64_t tail_rows = std::min<int64_t>(model::kPrefillTailRows, n);
  const int64_t tail0 = n - tail_rows;
  FLUXION_RETURN_IF_ERROR(m.Reserve(m.pages, layer_bytes * c.num_layers));
  FLUXION_RETURN_IF_ERROR(
      m.Reserve(m.tail_q, sizeof(float) * c.num_layers * tail_rows * hq * d));
  uint8_t* dev_pages = static_cast<uint8_t*>(m.pages->data());
  // The page records of a layer: (head, page) in the pages' order, 4 * head_dim bytes each.
  const size_t record_bytes = static_cast<size_t>(4 * d);
  const size_t meta_layer_bytes = static_cast<size_t>(hkv * pph) * record_bytes;
  uint8_t* dev_meta = nullptr;
  if (encode_meta) {
    FLUXION_RETURN_IF_ERROR(m.Reserve(m.meta, meta_layer_bytes * c.num_layers));
    dev_meta = static_cast<uint8_t*>(m.meta->data());
  }
  // Rows past the prompt's end in each head's last page go out as zeros.
  FLUXION_RETURN_IF_ERROR(CudaStatus(
      cudaMemsetAsync(dev_pages, 0, layer_bytes * c.num_layers, stream), "clear pages"));
  auto layer_pages = [&](int layer) {
    return kernels::cuda::LayerPages{dev_pages + layer * layer_bytes, hkv, d, page_tokens, pph};
  };

  const int64_t chunk = m.options.chunk_tokens;
  const int64_t chunks = (n + chunk - 1) / chunk;
  std::vector<Event> events(static_cast<size_t>(chunks * c.num_layers));
  for (Event& e : events) FLUXION_RETURN_IF_ERROR(e.Init());
  {
    std::lock_guard<std::mutex> copy_lock(m.copy_mu);
    m.last = RunLayout{pph, page_bytes, layer_bytes, record_bytes, meta_layer_bytes, encode_meta};
  }
  PieceReporter reporter(m.device, ready);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  float* tail_q = static_cast<float*>(m.tail_q->data());
  std::vector<int64_t> positions(chunk);
  absl::Status forward;
  for (int64_t ci = 0; ci < chunks && forward.ok(); ++ci) {
    const int64_t c0 = ci * chunk, rows = std::min(chunk, n - c0);
    for (int64_t i = 0; i < rows; ++i) positions[i] = c0 + i;
    model::EmbedRows(ops, m.params, c, m.buf, prompt.data() + c0, positions.data(), rows);
    absl::StatusOr<int64_t> left = model::RunLayers(
        ops, c, m.params, m.buf, rows, [&](int layer, int64_t r) -> absl::StatusOr<int64_t> {
          if (cancelled()) {
            return absl::CancelledError(absl::StrCat("prefill cancelled at layer ", layer + 1));
          }
          if (reporter.failed()) return absl::AbortedError("the copy thread failed");
          const kernels::cuda::LayerPages lp = layer_pages(layer);
          const int64_t kv_row = hkv * d;
          FLUXION_RETURN_IF_ERROR(CudaStatus(
              kernels::cuda::WriteLayerPages(lp, m.buf.k, m.buf.v, kv_row, c0, r, stream),
              "write pages"));
          if (dev_meta != nullptr) {  // the records of every page these rows touched
            FLUXION_RETURN_IF_ERROR(CudaStatus(
                kernels::cuda::EncodePageMeta(lp, n, c0 / page_tokens,
                                              (c0 + r + page_tokens - 1) / page_tokens,
                                              dev_meta + layer * meta_layer_bytes, stream),
                "page records"));
          }
          FLUXION_RETURN_IF_ERROR(CudaStatus(
              kernels::cuda::CausalPrefillAttention(lp, m.buf.q, c0, r, hq, scale, m.buf.attn,
                                                    stream),
              "attention"));
          const int64_t t_begin = std::max(c0, tail0), t_end = c0 + r;
          if (t_end > t_begin) {  // this chunk holds some of the tail rows: keep their queries
            FLUXION_RETURN_IF_ERROR(CudaStatus(
                cudaMemcpyAsync(tail_q + ((layer * tail_rows) + (t_begin - tail0)) * hq * d,
                                m.buf.q + (t_begin - c0) * hq * d,
                                sizeof(float) * (t_end - t_begin) * hq * d,
                                cudaMemcpyDeviceToDevice, stream),
                "tail queries"));
          }
          cudaEvent_t computed = events[ci * c.num_layers + layer].get();
          FLUXION_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(computed, stream), "event"));
          reporter.Push({layer, c0, c0 + r, computed});
          return r;
        });
    if (!left.ok()) forward = left.status();
    if (forward.ok() && ci == chunks - 1) {
      model::LmHead(ops, m.params, c, m.buf, m.buf.x + (rows - 1) * c.hidden_size, 1,
                    static_cast<float*>(m.logits->data()));
    }
  }
  DevicePrefillResult result;
  if (forward.ok()) {
    result.logits.resize(c.vocab_size);
    ops.CopyToHost(result.logits.data(), m.logits->data(), c.vocab_size * sizeof(float));
    forward = ops.Sync();
  } else {
    (void)ops.Sync();  // the reporter may still wait on what was queued
  }
  result.forward_end = Clock::now();
  absl::Status copied = reporter.Finish();
  result.copy_wait_seconds =
      std::chrono::duration<double>(Clock::now() - result.forward_end).count();
  // The copy thread's error first: a forward that stopped because of it says only that.
  FLUXION_RETURN_IF_ERROR(copied);
  FLUXION_RETURN_IF_ERROR(forward);
  if (capture_state) {
    FLUXION_ASSIGN_OR_RETURN(result.state,
                             m.Capture(layer_pages(0), layer_bytes, n, tail_rows, stream));
  }
  return result;
}

absl::Status DevicePrefill::CopyPages(int layer, int64_t first_page, int64_t end_page,
                                      uint8_t* pages, uint8_t* records) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.copy_mu);
  const RunLayout& r = m.last;
  if (layer < 0 || layer >= m.config.num_layers || first_page < 0 || end_page <= first_page ||
      end_page > r.pages_per_head) {
    return absl::InvalidArgumentError(
        absl::StrCat("device prefill: pages [", first_page, ", ", end_page, ") of layer ", layer,
                     " are not pages of the last prompt (", r.pages_per_head, " per head, ",
                     m.config.num_layers, " layers)"));
  }
  FLUXION_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(m.device), "device"));
  const cudaStream_t stream = m.copy_stream.get();
  const int64_t hkv = m.config.num_kv_heads, count = end_page - first_page;
  const auto* dev_pages = static_cast<const uint8_t*>(m.pages->data()) + layer * r.layer_bytes;
  for (int64_t h = 0; h < hkv; ++h) {
    const int64_t index = h * r.pages_per_head + first_page;  // (head, page) in the layer
    FLUXION_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(pages + h * count * r.page_bytes, dev_pages + index * r.page_bytes,
                        static_cast<size_t>(count) * r.page_bytes, cudaMemcpyDeviceToHost, stream),
        "pages to host"));
    if (records != nullptr && r.meta) {
      const auto* dev_meta =
          static_cast<const uint8_t*>(m.meta->data()) + layer * r.meta_layer_bytes;
      FLUXION_RETURN_IF_ERROR(CudaStatus(
          cudaMemcpyAsync(records + index * r.record_bytes, dev_meta + index * r.record_bytes,
                          static_cast<size_t>(count) * r.record_bytes, cudaMemcpyDeviceToHost,
                          stream),
          "page records to host"));
    }
  }
  return CudaStatus(cudaStreamSynchronize(stream), "pages to host");
}

absl::StatusOr<model::SparseState> DevicePrefill::Impl::Capture(
    const kernels::cuda::LayerPages& first_layer, size_t layer_bytes, int64_t tokens,
    int64_t rows, cudaStream_t stream) {
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
  const float* tail_q_base = static_cast<const float*>(tail_q->data());
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

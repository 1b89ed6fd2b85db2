#include "decode/device/hbm_full_attention.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "common/status_macros.h"
#include "kernels/cuda/decode_ops.h"
#include "kernels/cuda/page_spans.h"
#include "kernels/cuda/window_ring.h"

namespace fluxion::decode {
namespace {

size_t AlignUp(size_t n) { return (n + 255) / 256 * 256; }

}  // namespace

absl::StatusOr<std::unique_ptr<HbmFullAttention>> HbmFullAttention::Create(
    const HbmKvShape& shape, cudaStream_t stream, kernels::cuda::PagedKernel kernel) {
  if (shape.num_layers <= 0 || shape.num_kv_heads <= 0 || shape.head_dim <= 0 ||
      shape.max_requests <= 0 || shape.max_tokens <= 0 || shape.page_tokens <= 0 ||
      shape.num_heads % shape.num_kv_heads != 0 || !(shape.scale > 0)) {
    return absl::InvalidArgumentError("HBM KV: bad shape");
  }
  auto a = std::unique_ptr<HbmFullAttention>(new HbmFullAttention(shape, stream));
  FLUXION_ASSIGN_OR_RETURN(a->backend_, kernels::cuda::CudaAttentionBackend::Create(
                                            {stream, kernel, 0}));
  const size_t kv_bytes = shape.num_layers * shape.layer_bytes();
  if (cudaMalloc(&a->kv_, kv_bytes) != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat("HBM KV: cannot allocate ", kv_bytes >> 30, " GiB of device memory"));
  }
  const int64_t rows = shape.max_requests;
  const int64_t max_spans = rows * shape.num_kv_heads * shape.max_pages();
  a->step_bytes_ = AlignUp(rows * sizeof(int32_t)) + AlignUp(rows * sizeof(int64_t)) +
                   AlignUp((rows * shape.num_kv_heads + 1) * sizeof(int64_t)) +
                   AlignUp(max_spans * sizeof(kernels::PageSpan));
  FLUXION_RETURN_IF_ERROR(a->Check(cudaMalloc(&a->step_, a->step_bytes_), "step arrays"));
  // The spans are written on the device (FillPageSpans): staging holds the arrays before them.
  const size_t staged = a->step_bytes_ - AlignUp(max_spans * sizeof(kernels::PageSpan));
  FLUXION_RETURN_IF_ERROR(a->Check(cudaMallocHost(&a->staging_, staged), "staging"));
  FLUXION_RETURN_IF_ERROR(
      a->Check(cudaMalloc(&a->lse_, rows * shape.num_heads * sizeof(float)), "lse"));
  char* p = static_cast<char*>(a->step_);
  a->slots_dev_ = reinterpret_cast<int32_t*>(p);
  p += AlignUp(rows * sizeof(int32_t));
  a->positions_dev_ = reinterpret_cast<int64_t*>(p);
  p += AlignUp(rows * sizeof(int64_t));
  a->indptr_dev_ = reinterpret_cast<int64_t*>(p);
  p += AlignUp((rows * shape.num_kv_heads + 1) * sizeof(int64_t));
  a->spans_dev_ = reinterpret_cast<kernels::PageSpan*>(p);
  return a;
}

HbmFullAttention::~HbmFullAttention() {
  cudaStreamSynchronize(stream_);
  for (void* d : {kv_, lse_, step_, workspace_}) {
    if (d != nullptr) cudaFree(d);
  }
  if (staging_ != nullptr) cudaFreeHost(staging_);
}

absl::Status HbmFullAttention::Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  return absl::InternalError(absl::StrCat("HBM full attention: ", what, ": ",
                                          cudaGetErrorString(e)));
}

absl::Status HbmFullAttention::FillRandom(int slot, int64_t tokens, uint64_t seed) {
  if (slot < 0 || slot >= shape_.max_requests || tokens < 0 || tokens > shape_.max_tokens) {
    return absl::InvalidArgumentError("HBM KV: slot or tokens out of range");
  }
  // A slot's pages of one layer are contiguous: [kv_head][max_pages]; fill the used pages of
  // every head (the whole per-head range up to the last page: simpler, the same bytes read).
  const int64_t pages = (tokens + shape_.page_tokens - 1) / shape_.page_tokens;
  const size_t head_bytes = shape_.max_pages() * shape_.page_bytes();
  for (int64_t layer = 0; layer < shape_.num_layers; ++layer) {
    for (int64_t h = 0; h < shape_.num_kv_heads; ++h) {
      auto* base = reinterpret_cast<bf16*>(static_cast<char*>(kv_) + layer * shape_.layer_bytes() +
                                           (slot * shape_.num_kv_heads + h) * head_bytes);
      FLUXION_RETURN_IF_ERROR(Check(
          kernels::cuda::FillRandomBf16(base, pages * shape_.page_bytes() / sizeof(bf16),
                                        seed + layer * 1000 + h, 0.0f, 1.0f, stream_),
          "fill"));
    }
  }
  return Check(cudaStreamSynchronize(stream_), "fill (wait)");
}

absl::Status HbmFullAttention::LoadTokens(int slot, int layer, int64_t tokens, const float* k,
                                          const float* v) {
  if (slot < 0 || slot >= shape_.max_requests || layer < 0 || layer >= shape_.num_layers ||
      tokens < 0 || tokens > shape_.max_tokens) {
    return absl::InvalidArgumentError("HBM KV: slot, layer or tokens out of range");
  }
  const int64_t d = shape_.head_dim, pt = shape_.page_tokens, hkv = shape_.num_kv_heads;
  const int64_t pages = (tokens + pt - 1) / pt;
  std::vector<bf16> image(pages * 2 * pt * d);
  for (int64_t h = 0; h < hkv; ++h) {
    for (int64_t t = 0; t < tokens; ++t) {
      bf16* key = image.data() + (t / pt) * 2 * pt * d + (t % pt) * d;
      bf16* value = key + pt * d;
      for (int64_t j = 0; j < d; ++j) {
        key[j] = FloatToBf16(k[(t * hkv + h) * d + j]);
        value[j] = FloatToBf16(v[(t * hkv + h) * d + j]);
      }
    }
    char* dst = static_cast<char*>(kv_) + layer * shape_.layer_bytes() +
                (slot * hkv + h) * shape_.max_pages() * shape_.page_bytes();
    FLUXION_RETURN_IF_ERROR(Check(cudaMemcpy(dst, image.data(), image.size() * sizeof(bf16),
                                             cudaMemcpyHostToDevice),
                                  "load"));
  }
  return absl::OkStatus();
}

absl::Status HbmFullAttention::BeginStep(absl::Span<const int> slots,
                                         absl::Span<const int64_t> positions) {
  if (slots.size() != positions.size() ||
      static_cast<int64_t>(slots.size()) > shape_.max_requests) {
    return absl::InvalidArgumentError("HBM KV: too many rows or mismatched positions");
  }
  // The previous step's uploads have run: every step ends by copying its logits to the host.
  const int64_t rows = static_cast<int64_t>(slots.size()), hkv = shape_.num_kv_heads;
  const int64_t pt = shape_.page_tokens, max_pages = shape_.max_pages();
  char* base = static_cast<char*>(staging_);
  auto* slots_h = reinterpret_cast<int32_t*>(base);
  auto* positions_h = reinterpret_cast<int64_t*>(base + (reinterpret_cast<char*>(positions_dev_) -
                                                         static_cast<char*>(step_)));
  auto* indptr_h = reinterpret_cast<int64_t*>(base + (reinterpret_cast<char*>(indptr_dev_) -
                                                      static_cast<char*>(step_)));
  // Per (row, KV head) only the offsets of its spans; FillPageSpans writes the spans themselves on
  // the device, so this loop and the upload stay O(rows x KV heads) whatever the contexts.
  int64_t n = 0;
  indptr_h[0] = 0;
  for (int64_t i = 0; i < rows; ++i) {
    if (slots[i] < 0 || slots[i] >= shape_.max_requests || positions[i] < 0 ||
        positions[i] >= shape_.max_tokens) {
      return absl::InvalidArgumentError(absl::StrCat("HBM KV: row ", i, " out of range"));
    }
    slots_h[i] = slots[i];
    positions_h[i] = positions[i];
    const int64_t pages = (positions[i] + 1 + pt - 1) / pt;  // <= max_pages: position < max_tokens
    for (int64_t h = 0; h < hkv; ++h) {
      n += pages;
      indptr_h[i * hkv + h + 1] = n;
    }
  }
  rows_ = rows;
  num_spans_ = n;
  const size_t used = reinterpret_cast<char*>(indptr_h + rows * hkv + 1) - base;
  FLUXION_RETURN_IF_ERROR(
      Check(cudaMemcpyAsync(step_, staging_, used, cudaMemcpyHostToDevice, stream_), "upload"));
  FLUXION_RETURN_IF_ERROR(Check(kernels::cuda::FillPageSpans(slots_dev_, positions_dev_,
                                                             indptr_dev_, rows, hkv, max_pages, pt,
                                                             spans_dev_, stream_),
                                "spans"));
  // The workspace for this problem's size (grows only while the contexts do).
  kernels::PagedDecodeProblem p;
  p.kv = {static_cast<const uint8_t*>(kv_), shape_.page_bytes(), pt, shape_.head_dim};
  p.num_spans = n;
  p.num_requests = rows;
  p.num_qo_heads = shape_.num_heads;
  p.num_kv_heads = hkv;
  p.head_dim = shape_.head_dim;
  p.sm_scale = shape_.scale;
  const size_t need = backend_->WorkspaceBytes(p);
  if (need > workspace_bytes_) {
    if (workspace_ != nullptr) cudaFree(workspace_);
    workspace_ = nullptr;
    workspace_bytes_ = 0;
    FLUXION_RETURN_IF_ERROR(Check(cudaMalloc(&workspace_, need * 2), "workspace"));
    workspace_bytes_ = need * 2;
  }
  return absl::OkStatus();
}

absl::Status HbmFullAttention::Attend(const model::LayerAttentionIo& io) {
  if (io.host_memory || io.rows != rows_) {
    return absl::FailedPreconditionError(
        "HBM full attention needs the step's rows in device memory, as BeginStep set them");
  }
  auto* layer_base = reinterpret_cast<bf16*>(static_cast<char*>(kv_) +
                                             io.layer * shape_.layer_bytes());
  FLUXION_RETURN_IF_ERROR(Check(
      kernels::cuda::HbmPageAppend(layer_base, shape_.page_tokens, shape_.max_pages(),
                                   shape_.num_kv_heads, shape_.head_dim, io.k, io.v, slots_dev_,
                                   positions_dev_, rows_, stream_),
      "append"));
  kernels::PagedDecodeProblem p;
  p.q = io.q;
  p.kv = {reinterpret_cast<const uint8_t*>(layer_base), shape_.page_bytes(), shape_.page_tokens,
          shape_.head_dim};
  p.span_indptr = indptr_dev_;
  p.spans = spans_dev_;
  p.num_spans = num_spans_;
  p.out = io.out;
  p.lse = static_cast<float*>(lse_);
  p.num_requests = rows_;
  p.num_qo_heads = shape_.num_heads;
  p.num_kv_heads = shape_.num_kv_heads;
  p.head_dim = shape_.head_dim;
  p.sm_scale = shape_.scale;
  return backend_->Run(p, absl::MakeSpan(static_cast<std::byte*>(workspace_), workspace_bytes_));
}

}  // namespace fluxion::decode

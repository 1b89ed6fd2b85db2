#include "kernels/cuda/attention_backend_cuda.h"

#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/decode_ops.h"

namespace fluxion::kernels::cuda {
namespace {

constexpr int kPlanThreads = 1024;
constexpr size_t kAlign = 256;

size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Where each array of the workspace starts, for a problem with `max_chunks` chunks at most.
struct Layout {
  size_t chunk_begin = 0, items = 0, chunk_lse = 0, chunk_out = 0, total = 0;
};

Layout LayoutFor(int64_t pairs, int64_t max_chunks, int64_t group, int64_t head_dim) {
  Layout l;
  l.chunk_begin = 0;
  l.items = AlignUp(l.chunk_begin + sizeof(int32_t) * (pairs + 1));
  l.chunk_lse = AlignUp(l.items + sizeof(PagedItem) * max_chunks);
  l.chunk_out = AlignUp(l.chunk_lse + sizeof(float) * max_chunks * group);
  l.total = AlignUp(l.chunk_out + sizeof(float) * max_chunks * group * head_dim);
  return l;
}

// One block: chunk_begin[p] = sum over pairs q < p of ceil(spans of q / per_chunk), then one
// PagedItem per chunk, and padding items (out = nullptr, skipped by the kernel) up to max_chunks.
__global__ void __launch_bounds__(kPlanThreads)
    PlanChunksKernel(const int64_t* indptr, int pairs, int per_chunk, int max_chunks,
                     const float* q, int state_elems, int group, float* chunk_out,
                     float* chunk_lse, int32_t* chunk_begin, PagedItem* items) {
  using Scan = cub::BlockScan<int, kPlanThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int total_chunks;
  const int per_thread = (pairs + kPlanThreads - 1) / kPlanThreads;
  const int first = threadIdx.x * per_thread;
  const int last = min(pairs, first + per_thread);
  auto chunks_of = [&](int p) {
    const int64_t n = indptr[p + 1] - indptr[p];
    return static_cast<int>((n + per_chunk - 1) / per_chunk);
  };
  int mine = 0;
  for (int p = first; p < last; ++p) mine += chunks_of(p);
  int offset = 0, total = 0;
  Scan(scan_storage).ExclusiveSum(mine, offset, total);
  if (threadIdx.x == 0) total_chunks = total;
  for (int p = first; p < last; ++p) {
    chunk_begin[p] = offset;
    const int32_t s0 = static_cast<int32_t>(indptr[p]), s1 = static_cast<int32_t>(indptr[p + 1]);
    for (int32_t s = s0; s < s1; s += per_chunk, ++offset) {
      items[offset] = PagedItem{q + static_cast<int64_t>(p) * state_elems, s,
                                min(s1, s + per_chunk),
                                chunk_out + static_cast<int64_t>(offset) * state_elems,
                                chunk_lse + static_cast<int64_t>(offset) * group};
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) chunk_begin[pairs] = total_chunks;
  for (int c = total_chunks + threadIdx.x; c < max_chunks; c += kPlanThreads) {
    items[c] = PagedItem{};
  }
}

absl::Status CudaStatus(cudaError_t e, absl::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(e), " (",
                                          cudaGetErrorString(e), ")"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaAttentionBackend>> CudaAttentionBackend::Create(
    const CudaAttentionBackendOptions& options) {
  if (!DeviceAvailable()) {
    return absl::FailedPreconditionError("CUDA attention backend: no usable CUDA device");
  }
  CudaAttentionBackendOptions o = options;
  if (o.num_sms <= 0) {
    int device = 0, sms = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        sms <= 0) {
      return absl::FailedPreconditionError("CUDA attention backend: cannot read the SM count");
    }
    o.num_sms = sms;
  }
  return std::unique_ptr<CudaAttentionBackend>(new CudaAttentionBackend(o));
}

absl::string_view CudaAttentionBackend::name() const {
  switch (options_.kernel) {
    case PagedKernel::kV3:
      return "cuda-v3";
    case PagedKernel::kV5:
      return "cuda-v5";
  }
  return "cuda";
}

int64_t CudaAttentionBackend::BlockSlots() const {
  return static_cast<int64_t>(options_.num_sms) * PagedBlocksPerSm(options_.kernel);
}

absl::Status CudaAttentionBackend::Supports(const PagedDecodeProblem& p) const {
  if (absl::Status s = ValidatePagedDecodeProblem(p); !s.ok()) return s;
  auto lacks = [](auto... parts) { return absl::UnimplementedError(absl::StrCat(parts...)); };
  if (p.head_dim != 64 && p.head_dim != 128) {
    return lacks("CUDA attention: head_dim ", p.head_dim, " (kernels exist for 64 and 128)");
  }
  if (p.group() > kMaxPagedGroup) {
    return lacks("CUDA attention: GQA group ", p.group(), " above ", kMaxPagedGroup);
  }
  if (p.num_pairs() > INT32_MAX / 2 || p.num_spans > INT32_MAX / 2) {
    return lacks("CUDA attention: ", p.num_pairs(), " pairs / ", p.num_spans,
                 " spans exceed the int32 plan");
  }
  if (p.num_spans == 0) return absl::OkStatus();  // the arena is never read
  const int64_t pt = p.kv.page_tokens;
  const bool pt_ok =
      pt == 8 || pt == 16 || pt == 32 || (pt == 64 && options_.kernel != PagedKernel::kV3);
  if (!pt_ok) {
    return lacks("CUDA attention: page_tokens ", pt, " (", PagedKernelName(options_.kernel),
                 " supports 8, 16, 32", options_.kernel != PagedKernel::kV3 ? ", 64)" : ")");
  }
  if (p.kv.page_bytes % 16 != 0 || reinterpret_cast<uintptr_t>(p.kv.arena) % 16 != 0) {
    return lacks("CUDA attention: kv.page_bytes ", p.kv.page_bytes,
                 " and the arena must be 16-byte aligned (rows are read 16 bytes at a time)");
  }
  return absl::OkStatus();
}

int64_t CudaAttentionSpansPerChunk(const PagedDecodeProblem& p, int64_t block_slots) {
  // The same aim as ChoosePagedChunkRows, in spans.
  const int64_t pairs = std::max<int64_t>(1, p.num_pairs());
  const int64_t slots = std::max<int64_t>(1, block_slots);
  const int64_t per_pair = std::max<int64_t>(1, slots / pairs);
  const int64_t spans_per_pair = (p.num_spans + pairs - 1) / pairs;
  const int64_t min_spans =
      (kMinPagedChunkRows + std::max<int64_t>(1, p.kv.page_tokens) - 1) /
      std::max<int64_t>(1, p.kv.page_tokens);
  return std::max<int64_t>({1, min_spans, (spans_per_pair + per_pair - 1) / per_pair});
}

size_t CudaAttentionWorkspaceBytes(const PagedDecodeProblem& p, int64_t spans_per_chunk) {
  if (p.num_requests <= 0) return 0;
  const int64_t max_chunks = p.num_spans / std::max<int64_t>(1, spans_per_chunk) + p.num_pairs();
  return LayoutFor(p.num_pairs(), max_chunks, p.group(), p.head_dim).total;
}

size_t CudaAttentionBackend::WorkspaceBytes(const PagedDecodeProblem& p) const {
  return CudaAttentionWorkspaceBytes(p, CudaAttentionSpansPerChunk(p, BlockSlots()));
}

absl::Status CudaAttentionBackend::Run(const PagedDecodeProblem& p,
                                       absl::Span<std::byte> workspace) {
  if (p.num_requests == 0) return absl::OkStatus();
  const int64_t pairs = p.num_pairs(), group = p.group();
  const int64_t per_chunk = CudaAttentionSpansPerChunk(p, BlockSlots());
  const int64_t max_chunks = p.num_spans / per_chunk + pairs;
  const Layout l = LayoutFor(pairs, max_chunks, group, p.head_dim);
  if (workspace.size() < l.total) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA attention: workspace of ",
                                                   workspace.size(), " bytes, ", l.total,
                                                   " needed (WorkspaceBytes)"));
  }
  std::byte* base = workspace.data();
  if (reinterpret_cast<uintptr_t>(base) % alignof(PagedItem) != 0) {
    return absl::InvalidArgumentError("CUDA attention: workspace not 8-byte aligned");
  }
  auto* chunk_begin = reinterpret_cast<int32_t*>(base + l.chunk_begin);
  auto* items = reinterpret_cast<PagedItem*>(base + l.items);
  auto* chunk_lse = reinterpret_cast<float*>(base + l.chunk_lse);
  auto* chunk_out = reinterpret_cast<float*>(base + l.chunk_out);
  const cudaStream_t stream = options_.stream;
  PlanChunksKernel<<<1, kPlanThreads, 0, stream>>>(
      p.span_indptr, static_cast<int>(pairs), static_cast<int>(per_chunk),
      static_cast<int>(max_chunks), p.q, static_cast<int>(group * p.head_dim),
      static_cast<int>(group), chunk_out, chunk_lse, chunk_begin, items);
  if (absl::Status s = CudaStatus(cudaGetLastError(), "chunk plan"); !s.ok()) return s;
  if (p.num_spans > 0) {
    if (absl::Status s = CudaStatus(
            PagedDecodeAttention(p.kv.arena, p.kv.page_bytes, p.kv.page_tokens, p.head_dim,
                                 p.spans, items, max_chunks, group, p.sm_scale, stream,
                                 options_.kernel),
            "paged decode attention");
        !s.ok()) {
      return s;
    }
  }
  return CudaStatus(MergeChunks(chunk_out, chunk_lse, chunk_begin, pairs, group, p.head_dim,
                                p.out, p.lse, stream),
                    "merge chunks");
}

}  // namespace fluxion::kernels::cuda

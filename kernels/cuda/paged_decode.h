// Decode attention over paged K/V on the GPU: the same page layout and contracts as the CPU paged
// kernels (kernels/paged_attention.h: page `id` at arena + id * page_bytes, K then V, bf16
// [page_tokens][head_dim]), for many (request, KV head) items in one launch. The arena may be
// device memory (the KV resident in HBM) or pinned host memory mapped into the device's address
// space (cudaHostRegister with cudaHostRegisterMapped, or any pointer on a UVA system), in which
// case the kernel reads the selected rows straight over PCIe ("zero-copy"). Each row is read once
// per item for all `group` query heads, which matters most over PCIe.
//
// Long items are split into chunks of spans by the caller (SplitByRows), each chunk a partial
// state, and the chunks merged with MergeStates (kernels/cuda/decode_ops.h): flash-decoding.
//
// Thread-safe: launches on the caller's stream; nothing is allocated.
#ifndef FLUXION_KERNELS_CUDA_PAGED_DECODE_H_
#define FLUXION_KERNELS_CUDA_PAGED_DECODE_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/paged_attention.h"

namespace fluxion::kernels::cuda {

// Largest GQA group (query heads per KV head) the kernel is compiled for.
inline constexpr int64_t kMaxPagedGroup = 8;

// Which kernel runs (both compute the same thing; docs/GPU.md, "The paged kernels"):
//   kV3: one kernel for every group, block-wide tiles of 128 row slots; the best reader of pinned
//        host pages (90-95% of the H2D probe), so the zero-copy share uses it; page_tokens
//        8/16/32.
//   kV5: each warp streams its own 16-row units through a 3-stage cp.async ring in shared memory
//        (2 blocks per SM) with the math on the tensor cores (mma.sync, the GQA group packed into
//        the rows; paged_decode_mma.cu); the default for KV in HBM; page_tokens 8/16/32/64.
enum class PagedKernel { kV3, kV5 };
const char* PagedKernelName(PagedKernel kernel);  // "v3", "v5"
// The kernel PagedKernelName calls `name`; false for an unknown name.
bool PagedKernelFromName(const std::string& name, PagedKernel* kernel);
// The blocks per SM a kernel's chunking aims at (v3 4, v5 2).
int PagedBlocksPerSm(PagedKernel kernel);

// Smallest chunk ChoosePagedChunkRows gives v5 (four 16-row units per warp), and the smallest
// CudaAttentionBackend plans for either kernel.
inline constexpr int64_t kMinPagedChunkRows = 256;

// The `group` query heads of one (request, KV head) over the rows of spans[span_begin, span_end).
// q: [group][head_dim] fp32 post-RoPE, unscaled; out: [group][head_dim]; lse: [group] natural
// base of the scaled scores (-inf, out 0 when the spans hold no rows). An item with
// out == nullptr is skipped: a planner on the device may launch an upper bound of items.
struct PagedItem {
  const float* q = nullptr;
  int32_t span_begin = 0;
  int32_t span_end = 0;
  float* out = nullptr;
  float* lse = nullptr;
};

// All pointers are device-accessible: `arena` (device or mapped pinned host memory), `spans`
// [total spans], `items` [num_items]. head_dim: 64 or 128; 1 <= group <= kMaxPagedGroup;
// page_tokens 8, 16, 32 (and 64 for v5); arena and page_bytes 16-byte aligned and
// page_bytes >= 2 * page_tokens * head_dim * 2. cudaErrorInvalidValue otherwise. One block per
// item: split long items into chunks (SplitByRows) to fill the GPU.
cudaError_t PagedDecodeAttention(const uint8_t* arena, size_t page_bytes, int64_t page_tokens,
                                 int64_t head_dim, const PageSpan* spans, const PagedItem* items,
                                 int64_t num_items, int64_t group, float scale,
                                 cudaStream_t stream, PagedKernel kernel = PagedKernel::kV5);

// v3's chunking: rows per chunk so that `total_rows` (all items of a launch) make about four
// blocks per SM, a multiple of 128 rows (one tile of full 16-token pages), between 128 and 8192.
int64_t ChooseChunkRows(int64_t total_rows, int num_sms);

// Rows per chunk for `kernel` over `items` items of `total_rows` rows in all (about equal rows
// each). kV3: ChooseChunkRows. kV5: one wave of blocks (slots = PagedBlocksPerSm x num_sms),
// floor(slots / items) chunks per item (at least one), a multiple of 16, at least
// kMinPagedChunkRows.
int64_t ChoosePagedChunkRows(PagedKernel kernel, int64_t total_rows, int64_t items, int num_sms);

// Host-side planning for flash-decoding: cuts spans[begin, end) into consecutive chunks of at
// most `max_rows` rows each. A span is never cut, so a chunk holds more than max_rows rows only
// when one span alone does. Returns the chunk boundaries as span indices: {begin, b1, ..., end};
// {begin, end} when everything fits one chunk; {begin} when begin == end.
std::vector<int32_t> SplitByRows(const PageSpan* spans, int32_t begin, int32_t end,
                                 int64_t max_rows);

}  // namespace fluxion::kernels::cuda

#endif  // FLUXION_KERNELS_CUDA_PAGED_DECODE_H_

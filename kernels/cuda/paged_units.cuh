// The pieces of the warp-streaming paged decode kernel (v5, paged_decode_mma.cu): a warp's ring
// of 16-row "units" loaded with cp.async from the spans of one item, and the final merge of the
// block's four warp states.
//
// Unit u of an item covers slots [16u, 16u + 16) of the spans laid end to end with page_tokens
// slots each: slot t is row (t % page_tokens) of span t / page_tokens, valid when that row is
// below the span's `rows`. Invalid slots are zero-filled (never read from memory) and marked in
// the unit's valid mask.
#ifndef FLUXION_KERNELS_CUDA_PAGED_UNITS_CUH_
#define FLUXION_KERNELS_CUDA_PAGED_UNITS_CUH_

#include <cstdint>

#include "kernels/paged_attention.h"

namespace fluxion::kernels::cuda::paged_units {

// bf16 storage: the loader only moves bytes.
using bf16_t = uint16_t;

constexpr int kWarps = 4, kThreads = 32 * kWarps, kUnitRows = 16;

__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int src_bytes = valid ? 16 : 0;  // 0: write 16 zero bytes, read nothing
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// The spans one unit reads (rows = 0 past the item's end).
template <int kSpansPerUnit>
struct UnitSpans {
  PageSpan s[kSpansPerUnit];
};

// One warp's view of its item: which spans a unit reads and how its K and V rows are copied into
// a ring stage of shared memory laid out [K: 16 rows][V: 16 rows], each row kLd bf16 apart
// (kLd = kHeadDim, or padded so that ldmatrix reads are free of bank conflicts).
template <int kHeadDim, int kPageTokens, int kLd>
struct UnitLoader {
  static constexpr int kLanesPerRow = kHeadDim / 8;                         // 16-byte chunks
  static constexpr int kCopiesPerLane = kUnitRows * kLanesPerRow / 32;      // per matrix
  static constexpr int kSpansPerUnit = kPageTokens >= kUnitRows ? 1 : kUnitRows / kPageTokens;
  static constexpr int kMatrixElems = kUnitRows * kLd;  // bf16 per matrix per unit
  static constexpr int kStageElems = 2 * kMatrixElems;  // K then V
  static_assert(kPageTokens % kUnitRows == 0 || kUnitRows % kPageTokens == 0);
  static_assert(kLd % 8 == 0, "rows stay 16-byte aligned");
  using Spans = UnitSpans<kSpansPerUnit>;

  const uint8_t* arena;
  size_t page_bytes;
  const PageSpan* item_spans;
  int n_spans;
  int units;

  __device__ UnitLoader(const uint8_t* a, size_t pb, const PageSpan* spans, int count)
      : arena(a),
        page_bytes(pb),
        item_spans(spans),
        n_spans(count),
        units(static_cast<int>((static_cast<int64_t>(count) * kPageTokens + kUnitRows - 1) /
                               kUnitRows)) {}

  __device__ __forceinline__ Spans LoadSpans(int u) const {
    Spans us;
#pragma unroll
    for (int j = 0; j < kSpansPerUnit; ++j) {
      const int idx = kSpansPerUnit == 1 ? u * kUnitRows / kPageTokens : u * kSpansPerUnit + j;
      us.s[j] = u < units && idx < n_spans ? item_spans[idx] : PageSpan{0, 0, 0};
    }
    return us;
  }
  // Slot t of unit u: (span j of the unit, row r of that span).
  static __device__ __forceinline__ int SlotSpan(int t) {
    return kSpansPerUnit == 1 ? 0 : t / kPageTokens;
  }
  static __device__ __forceinline__ int SlotRow(int u, int t) {
    return kSpansPerUnit == 1 ? (u * kUnitRows) % kPageTokens + t : t % kPageTokens;
  }
  // Issues this lane's copies of unit u into `stage` and returns the unit's valid-slot mask
  // (the same on every lane). Nothing is issued past the last unit.
  __device__ __forceinline__ uint32_t Issue(int u, bf16_t* stage, const Spans& us,
                                            int lane) const {
    if (u >= units) return 0;
    constexpr int64_t kValueOffset = static_cast<int64_t>(kPageTokens) * kHeadDim;
#pragma unroll
    for (int c = 0; c < kCopiesPerLane; ++c) {
      const int chunk = lane + 32 * c;
      const int t = chunk / kLanesPerRow, col = chunk % kLanesPerRow;
      const PageSpan& sp = us.s[SlotSpan(t)];
      const int r = SlotRow(u, t);
      const bool valid = r < sp.rows;
      const bf16_t* row = reinterpret_cast<const bf16_t*>(
                              arena + (valid ? static_cast<size_t>(sp.page) * page_bytes : 0)) +
                          (valid ? static_cast<int64_t>(sp.first_row + r) * kHeadDim : 0) +
                          col * 8;
      CpAsync16(stage + t * kLd + col * 8, row, valid);
      CpAsync16(stage + kMatrixElems + t * kLd + col * 8, row + kValueOffset, valid);
    }
    // Valid slots: the first rows - row0 slots of each span's share of the unit.
    constexpr int kSlotsPerSpan = kUnitRows / kSpansPerUnit;
    uint32_t mask = 0;
#pragma unroll
    for (int j = 0; j < kSpansPerUnit; ++j) {
      const int n = min(max(us.s[j].rows - SlotRow(u, j * kSlotsPerSpan), 0), kSlotsPerSpan);
      mask |= ((1u << n) - 1u) << (j * kSlotsPerSpan);
    }
    return mask;
  }
};

// A warp's parked online-softmax state in shared memory: [kG] m (base 2), [kG] l,
// [kG][kHeadDim] unnormalised output. The block's kWarps states (warp w's at
// state_of(w)) merge into the item's output and natural-base log-sum-exp.
template <int kG, int kHeadDim, typename StateOf>
__device__ __forceinline__ void MergeWarpStates(StateOf state_of, int group, float* out,
                                                float* lse) {
  for (int idx = threadIdx.x; idx < group * kHeadDim; idx += kThreads) {
    const int h = idx / kHeadDim, d = idx % kHeadDim;
    float big = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) big = fmaxf(big, state_of(w)[h]);
    float total = 0.0f, o = 0.0f;
    if (big != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float* st = state_of(w);
        const float c = exp2f(st[h] - big);  // 0 for an empty warp
        total += st[kG + h] * c;
        o += st[2 * kG + h * kHeadDim + d] * c;
      }
    }
    out[idx] = total > 0.0f ? o / total : 0.0f;
    if (d == 0) lse[h] = total > 0.0f ? (big + log2f(total)) * 0.69314718055994531f : -INFINITY;
  }
}

}  // namespace fluxion::kernels::cuda::paged_units

#endif  // FLUXION_KERNELS_CUDA_PAGED_UNITS_CUH_

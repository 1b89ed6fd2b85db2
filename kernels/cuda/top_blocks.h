// The best blocks of each (row, KV head) by the Quest scores QuestBlockScores left on the device
// (kernels/cuda/block_scores.h), so the hybrid step's CPU receives a few block numbers per head
// instead of ranking every block's score itself (decode/step/resident_window.h, RankBlocks). At 8B
// shapes and 128K tokens that CPU ranking is ~2.6 ms of a 17.6 ms step
// (bench/results/decode-rank-{host,device}-8b-128k-h200-20261202.json): one (layer, KV head)
// ranks ~4,000 scores in a few microseconds here, with every head of the batch at once.
//
// The picks are exactly kernels::cpu::TopKIndices's over the same scores: the `want` largest,
// ties to the lower block number, NaN lowest; written in ascending block order.
//
// Thread-safe: launches on the caller's stream; nothing is allocated.
#ifndef FLUXION_KERNELS_CUDA_TOP_BLOCKS_H_
#define FLUXION_KERNELS_CUDA_TOP_BLOCKS_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace fluxion::kernels::cuda {

// Row i's ranking: blocks [first, end) of its scores, the `want` best (want <= 0: none).
struct TopBlocksRange {
  int64_t first = 0, end = 0, want = 0;
};

// For every row i with block_tokens[i] > 0, offsets[i] >= 0 and ranges[i].want > 0, and every KV
// head h: with nb = ceil((positions[i] + 1) / block_tokens[i]) (QuestBlockScores's layout), writes
// the chosen block numbers b (first <= b < end) of scores[offsets[i] + h * nb + b] to
// top[top_offsets[i] + h * want + j], j < want, ascending: the picks of a step lie together, so
// only they cross to the host. The caller clamps end to nb and want to end - first. The arrays
// are device memory; ranges and top_offsets [rows].
cudaError_t TopBlocks(const float* scores, const int32_t* block_tokens, const int64_t* positions,
                      const int64_t* offsets, const TopBlocksRange* ranges,
                      const int64_t* top_offsets, int64_t rows, int64_t num_kv_heads,
                      int32_t* top, cudaStream_t stream);

}  // namespace fluxion::kernels::cuda

#endif  // FLUXION_KERNELS_CUDA_TOP_BLOCKS_H_

// Scoring kernels for sparse selection over host KV pages (AVX2 or AVX-512, dispatched like
// paged_attention_cpu.h). Policies in decode/sparse call
// these on every decode step, so they are as much on the critical path as attention itself.
//
// Thread-safe: pure functions.
#ifndef FLUXION_KERNELS_CPU_SELECTION_H_
#define FLUXION_KERNELS_CPU_SELECTION_H_

#include <cstdint>

#include "kernels/paged_attention.h"

namespace fluxion::kernels::cpu {

// scores[i] = max over the group's heads of q_g . k_i for every row i of `spans`, in span order
// (unscaled logits). q: [group][head_dim]. REQUIRES: PagedAttentionSupported(head_dim, group, ..).
void MaxGroupScores(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans,
                    const float* q, int64_t group, float* scores);

// scores[i * group + g] = q_g . k_i for every row i of `spans` and head g of the group, in span
// order (unscaled logits): every head's scores from one walk over the keys, where calling
// MaxGroupScores once per head would read each row `group` times. Same requirements.
void GroupScores(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans, const float* q,
                 int64_t group, float* scores);

// GroupScores / MaxGroupScores split into chunks of about `rows_per_task` rows (whole spans) run
// as OpenMP tasks (RunAsTasks, cpu_pool.h): for one (request, KV head) task of a step's CPU phase
// that rescores tens of thousands of rows while other threads of the team are idle. The scores
// equal the one-walk functions' bit for bit (each row's dot products are computed the same way).
inline constexpr int64_t kScoreRowsPerTask = 2048;
void GroupScoresInTasks(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans,
                        const float* q, int64_t group, float* scores,
                        int64_t rows_per_task = kScoreRowsPerTask);
void MaxGroupScoresInTasks(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans,
                           const float* q, int64_t group, float* scores,
                           int64_t rows_per_task = kScoreRowsPerTask);

// Quest upper bounds of q.k over blocks of `pages_per_block` consecutive logical pages:
//   out[b] = max_g sum_d max(q_g[d] * min_d, q_g[d] * max_d),
// where min/max are taken over the block's pages. key_min/key_max: [pages][head_dim] fp32 page
// metadata; block b covers pages [(first_block + b) * pages_per_block, +pages_per_block).
void QuestBlockBounds(const float* key_min, const float* key_max, int64_t head_dim,
                      int64_t first_block, int64_t num_blocks, int64_t pages_per_block,
                      const float* q, int64_t group, float* out);

}  // namespace fluxion::kernels::cpu

#endif  // FLUXION_KERNELS_CPU_SELECTION_H_

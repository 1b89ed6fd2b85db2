// The state sparse decoding starts from, captured at the end of prefill from the prompt's last
// query rows (ALGORITHMS.md §1.3.3 for LFPS's tables; §2.4 for Fluxion's head features). The
// prefill node computes it (it has the rows and the keys in fast memory) and ships it with the KV
// (issue 6: over UCX into room the decode node reserved; gRPC carries only the summary); the
// decode node's policies load it instead of rescanning the context.
//
// Per (layer, KV head), over the tail rows i (positions p_i, the last at n - 1), with a_i(j) the
// full attention of query row i on key j, maxed over the GQA group:
//   vertical[j] = sum_i r^(n-1-p_i) a_i(j)          slash[d] = sum_i r^(n-1-p_i) a_i(p_i - d)
//   middle_share  max over rows of the mass between the sinks and the local window
//   need_fraction mean over rows of the fraction of middle keys holding 90% of the middle mass
//   sink_mass, local_mass, entropy (nats): means over rows and query heads
//
// Wire format v1 (docs/SPARSE_STATE.md): little-endian; header, then per (layer, kv head) in
// layer-major order: 5 float32 features, vertical [tokens] float32, slash [tokens] float32.
//
// Thread-safe: a value type.
#ifndef FLUXION_MODEL_SPARSE_STATE_H_
#define FLUXION_MODEL_SPARSE_STATE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "model/attention.h"
#include "model/dense_attention.h"

namespace fluxion::model {

inline constexpr uint32_t kSparseStateVersion = 1;

struct SparseStateParams {
  double decay = 0.95;        // r
  int64_t sink_tokens = 4;
  int64_t local_tokens = 64;
  double coverage = 0.9;      // need_fraction's share of the middle mass
};

struct HeadSparseState {
  float middle_share = 1.0f;
  float need_fraction = 1.0f;
  float sink_mass = 0.0f;
  float local_mass = 0.0f;
  float entropy = 0.0f;
  std::vector<float> vertical;  // [tokens], by key position
  std::vector<float> slash;     // [tokens], by distance back from the query
};

struct SparseState {
  int64_t num_layers = 0, num_kv_heads = 0, group = 0, tokens = 0, tail_rows = 0;
  SparseStateParams params;
  std::vector<HeadSparseState> heads;  // [layer * num_kv_heads + kv_head]

  const HeadSparseState& head(int layer, int kv_head) const {
    return heads[static_cast<size_t>(layer) * num_kv_heads + kv_head];
  }

  // Little-endian wire format v1.
  std::string Serialize() const;
  // InvalidArgument for a wrong magic, version or size: never trusts a length before checking it
  // against the buffer.
  static absl::StatusOr<SparseState> Parse(absl::string_view bytes);

  // InvalidArgument unless this state was captured for `shape` over a `tokens`-token prompt.
  // Parse() checks the buffer against its own header only; a consumer indexing head(layer, h) by
  // the model's shape must call this first (a peer's state for another model would be read out
  // of bounds).
  absl::Status CheckMatches(const AttentionShape& shape, int64_t tokens) const;
};

// From raw prefill data: keys[layer] = [tokens][num_kv_heads][head_dim] (post-RoPE, fp32);
// tail_q[layer] = [rows][num_heads][head_dim]; tail_positions[layer] = [rows] (< tokens).
// InvalidArgument for inconsistent sizes.
absl::StatusOr<SparseState> CaptureSparseState(const std::vector<const float*>& keys,
                                               int64_t tokens,
                                               const std::vector<std::vector<float>>& tail_q,
                                               const std::vector<std::vector<int64_t>>& tail_positions,
                                               const AttentionShape& shape,
                                               const SparseStateParams& params = {});

// From a prefilled DenseAttention that recorded its tail queries (RecordQueries).
absl::StatusOr<SparseState> CaptureSparseState(const DenseAttention& prefilled,
                                               const AttentionShape& shape,
                                               const SparseStateParams& params = {});

// A stand-in state for a prompt of `tokens` tokens of `shape` that no model prefilled (the decode
// bench: random weights and random KV), so that LFPS and Fluxion can run their decode mechanics
// there. Only meaningful under a decision profile (decode/sparse/decision_profile.h): the profile,
// not these contents, decides which heads stream, bypass, and at which budget and block. What the
// contents still shape is how much work LFPS's candidate selection does, through how many table
// entries there are and how many pass its threshold; so both tables are dense (an entry at every
// position, about half of them above the 1e-4 floor LFPS keeps) and heavy-tailed (log-normal, sigma
// 2): few entries pass the kurtosis threshold and the selection takes its floor of the 2k largest
// entries per table, the middle of its range (the cap is 0.1 of the context), after scanning half
// the context's entries per step, as on the trained model's diffuse heads (docs/SPARSE.md: the scan
// covers most of the context there). Features: middle share and need fraction 1 (no evidence for
// streaming or a small need; replay ignores them anyway). Deterministic in `seed`. InvalidArgument
// for tokens < 1.
absl::StatusOr<SparseState> SynthesizeSparseState(const AttentionShape& shape, int64_t tokens,
                                                   uint64_t seed = 1,
                                                   const SparseStateParams& params = {});

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_SPARSE_STATE_H_

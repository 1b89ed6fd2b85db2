// Synthetic attention heads with the structure real long-context heads show, for benchmarks and
// attention-level quality evaluation of sparse policies (never zeros or i.i.d. noise alone):
//   sinks     the first tokens draw attention from every query; their values have a small norm
//   local     the most recent tokens are favoured (a recency bias)
//   vertical  a few columns every query attends (persistent key directions)
//   slash     a target that advances one position per decode step (a copy head)
//   needle    a few keys sharply aligned with the query (retrieval)
//   diffuse   no structure beyond noise
// Queries drift across decode steps (a small random walk around a base direction).
#ifndef FLUXION_BENCH_SYNTHETIC_HEADS_H_
#define FLUXION_BENCH_SYNTHETIC_HEADS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace fluxion::bench {

enum class HeadKind { kRetrieval, kCopy, kStreaming, kDiffuse };
const char* HeadKindName(HeadKind kind);
std::vector<HeadKind> AllHeadKinds();
// The kind HeadKindName names; nullopt for any other name.
std::optional<HeadKind> HeadKindFromName(const std::string& name);

struct SyntheticHead {
  int64_t tokens = 0, head_dim = 0, group = 0;
  std::vector<float> keys;     // [tokens][head_dim]
  std::vector<float> values;   // [tokens][head_dim]
  std::vector<float> queries;  // [steps][group][head_dim]; step s attends keys [0, tokens - steps + s]
  int64_t steps = 0;
};

// Builds one KV head of `kind` with `tokens` keys and `steps` decode queries for `group` heads.
SyntheticHead MakeSyntheticHead(HeadKind kind, int64_t tokens, int64_t head_dim, int64_t group,
                                int64_t steps, uint64_t seed);

}  // namespace fluxion::bench

#endif  // FLUXION_BENCH_SYNTHETIC_HEADS_H_

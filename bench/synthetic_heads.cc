#include "bench/synthetic_heads.h"

#include <cmath>
#include <random>

namespace fluxion::bench {
namespace {

void AddScaled(float* dst, const std::vector<float>& dir, float scale) {
  for (size_t i = 0; i < dir.size(); ++i) dst[i] += scale * dir[i];
}

std::vector<float> UnitVector(int64_t d, std::mt19937_64* rng) {
  std::normal_distribution<float> normal(0, 1);
  std::vector<float> v(d);
  double norm = 0;
  for (float& x : v) {
    x = normal(*rng);
    norm += x * x;
  }
  for (float& x : v) x /= static_cast<float>(std::sqrt(norm));
  return v;
}

}  // namespace

const char* HeadKindName(HeadKind kind) {
  switch (kind) {
    case HeadKind::kRetrieval:
      return "retrieval";
    case HeadKind::kCopy:
      return "copy";
    case HeadKind::kStreaming:
      return "streaming";
    case HeadKind::kDiffuse:
      return "diffuse";
  }
  return "?";
}

std::vector<HeadKind> AllHeadKinds() {
  return {HeadKind::kRetrieval, HeadKind::kCopy, HeadKind::kStreaming, HeadKind::kDiffuse};
}

std::optional<HeadKind> HeadKindFromName(const std::string& name) {
  for (HeadKind kind : AllHeadKinds()) {
    if (name == HeadKindName(kind)) return kind;
  }
  return std::nullopt;
}

SyntheticHead MakeSyntheticHead(HeadKind kind, int64_t tokens, int64_t d, int64_t group,
                                int64_t steps, uint64_t seed) {
  SyntheticHead h;
  h.tokens = tokens;
  h.head_dim = d;
  h.group = group;
  h.steps = steps;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0, 1);
  h.keys.resize(tokens * d);
  h.values.resize(tokens * d);
  for (float& x : h.keys) x = normal(rng);
  for (float& x : h.values) x = normal(rng);
  // Logits are q.k / sqrt(d); with |q| ~ sqrt(d) a key component of `a` along q's direction
  // adds about `a` to the logit. Noise logits have standard deviation ~1, so over T tokens the
  // background holds ~T * e^0.5 of unnormalised mass: structure must reach logits of 10-14 to
  // dominate at 4K-128K, as it does in trained heads.
  const float sqrt_d = std::sqrt(static_cast<float>(d));
  const std::vector<float> base = UnitVector(d, &rng);  // every query's shared direction
  const std::vector<float> sink_dir = base;
  const bool sinks = kind != HeadKind::kDiffuse;
  if (sinks) {
    for (int64_t t = 0; t < std::min<int64_t>(4, tokens); ++t) {
      AddScaled(&h.keys[t * d], sink_dir, 12.0f);
      for (int64_t j = 0; j < d; ++j) h.values[t * d + j] *= 0.1f;  // sinks carry little value
    }
  }
  // Needles and vertical columns: keys aligned with the shared direction or each query group's.
  std::vector<int64_t> needles;
  if (kind == HeadKind::kRetrieval) {
    for (int i = 0; i < 8; ++i) {
      const int64_t t = 4 + static_cast<int64_t>(rng() % (tokens - 4));
      AddScaled(&h.keys[t * d], base, i < 3 ? 14.0f : 10.0f);  // 3 needles, 5 weaker columns
    }
  }
  // Queries: base direction (scaled so it meets the aligned keys) plus drift and noise.
  h.queries.resize(steps * group * d);
  std::vector<float> drift(d, 0.0f);
  const int64_t copy_start = tokens / 3;
  for (int64_t s = 0; s < steps; ++s) {
    for (int64_t j = 0; j < d; ++j) drift[j] += 0.05f * normal(rng);
    const int64_t pos = tokens - steps + s;  // this step's position: keys [0, pos] visible
    for (int64_t g = 0; g < group; ++g) {
      float* q = &h.queries[(s * group + g) * d];
      for (int64_t j = 0; j < d; ++j) q[j] = 0.5f * normal(rng) + drift[j];
      if (kind != HeadKind::kDiffuse) AddScaled(q, base, sqrt_d);
      if (kind == HeadKind::kCopy) {
        // Slash: the step-s query points at the key copy_start + s (one position per step).
        const int64_t target = std::min(copy_start + s, pos);
        std::vector<float> kt(h.keys.begin() + target * d, h.keys.begin() + (target + 1) * d);
        AddScaled(q, kt, 12.0f / sqrt_d);  // logit of the target ~ +12
      }
    }
  }
  if (kind == HeadKind::kStreaming || kind == HeadKind::kCopy) {
    // Recency: the newest keys lean toward the shared direction, up to a logit of ~11 for the
    // last one, fading over the window plus the decode steps.
    const int64_t span = 64 + steps;
    for (int64_t t = std::max<int64_t>(4, tokens - span); t < tokens; ++t) {
      AddScaled(&h.keys[t * d], base, 11.0f * (1.0f - float(tokens - 1 - t) / span));
    }
  }
  return h;
}

}  // namespace fluxion::bench

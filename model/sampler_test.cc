#include "model/sampler.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>

#include "gtest/gtest.h"

namespace fluxion::model {
namespace {

TEST(SamplerTest, GreedyPicksArgmaxAndLowestIdOnTies) {
  Sampler s(SamplingParams{});
  EXPECT_EQ(s.Sample(std::vector<float>{0.1f, 3.0f, -1.0f, 2.9f}), 1);
  EXPECT_EQ(s.Sample(std::vector<float>{5.0f, 1.0f, 5.0f}), 0);
}

TEST(SamplerTest, SameSeedGivesSameStream) {
  std::vector<float> logits = {1.0f, 1.2f, 0.8f, 1.1f, 0.9f};
  SamplingParams p{1.0, 0, 1.0, 42};
  Sampler a(p), b(p);
  std::vector<int32_t> sa, sb;
  for (int i = 0; i < 50; ++i) {
    sa.push_back(a.Sample(logits));
    sb.push_back(b.Sample(logits));
  }
  EXPECT_EQ(sa, sb);
  Sampler c(SamplingParams{1.0, 0, 1.0, 43});
  std::vector<int32_t> sc;
  for (int i = 0; i < 50; ++i) sc.push_back(c.Sample(logits));
  EXPECT_NE(sa, sc);
}

TEST(SamplerTest, TemperatureSamplingFollowsSoftmax) {
  std::vector<float> logits = {0.0f, std::log(2.0f), std::log(7.0f)};  // probs 0.1, 0.2, 0.7
  Sampler s(SamplingParams{1.0, 0, 1.0, 7});
  std::map<int32_t, int> counts;
  const int n = 20000;
  for (int i = 0; i < n; ++i) ++counts[s.Sample(logits)];
  EXPECT_NEAR(counts[0] / double(n), 0.1, 0.015);
  EXPECT_NEAR(counts[1] / double(n), 0.2, 0.015);
  EXPECT_NEAR(counts[2] / double(n), 0.7, 0.015);
}

TEST(SamplerTest, TopKAndTopPExcludeTheTail) {
  std::vector<float> logits = {0.0f, std::log(2.0f), std::log(7.0f)};
  Sampler top_k(SamplingParams{1.0, 2, 1.0, 1});
  Sampler top_p(SamplingParams{1.0, 0, 0.75, 1});  // 0.7 < 0.75 <= 0.9: keeps ids 2 and 1
  for (int i = 0; i < 2000; ++i) {
    EXPECT_NE(top_k.Sample(logits), 0);
    EXPECT_NE(top_p.Sample(logits), 0);
  }
  Sampler nucleus_of_one(SamplingParams{1.0, 0, 0.5, 1});
  for (int i = 0; i < 100; ++i) EXPECT_EQ(nucleus_of_one.Sample(logits), 2);
}

TEST(SamplerTest, InvalidParametersAreRejectedByName) {
  EXPECT_NE(ValidateSamplingParams({-1.0, 0, 1.0, 0}).message().find("temperature"),
            std::string::npos);
  EXPECT_NE(ValidateSamplingParams({1.0, -2, 1.0, 0}).message().find("top_k"), std::string::npos);
  EXPECT_NE(ValidateSamplingParams({1.0, 0, 0.0, 0}).message().find("top_p"), std::string::npos);
  EXPECT_NE(ValidateSamplingParams({1.0, 0, 1.5, 0}).message().find("top_p"), std::string::npos);
  EXPECT_TRUE(ValidateSamplingParams({0.7, 40, 0.9, 3}).ok());
}

// The draw as Sample did it before the candidate path (the sampler of the previous release), to
// check that the refactor gives the same tokens from the same seeds.
class LegacySampler {
 public:
  explicit LegacySampler(const SamplingParams& p) : params_(p), rng_(p.seed) {}
  int32_t Sample(absl::Span<const float> logits) {
    if (params_.temperature <= 0.0 || params_.top_k == 1) return ArgMax(logits);
    const int64_t vocab = static_cast<int64_t>(logits.size());
    const int64_t k = params_.top_k > 0 ? std::min(params_.top_k, vocab) : vocab;
    std::vector<int32_t> order(vocab);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    std::vector<double> probs(k);
    const double max_logit = logits[order[0]];
    double total = 0.0;
    for (int64_t i = 0; i < k; ++i) {
      probs[i] = std::exp((logits[order[i]] - max_logit) / params_.temperature);
      total += probs[i];
    }
    int64_t keep = k;
    if (params_.top_p < 1.0) {
      double cumulative = 0.0;
      for (int64_t i = 0; i < k; ++i) {
        cumulative += probs[i] / total;
        if (cumulative >= params_.top_p) {
          keep = i + 1;
          break;
        }
      }
    }
    const double kept_total = std::accumulate(probs.begin(), probs.begin() + keep, 0.0);
    const double r = std::uniform_real_distribution<double>(0.0, kept_total)(rng_);
    double cumulative = 0.0;
    for (int64_t i = 0; i < keep; ++i) {
      cumulative += probs[i];
      if (r < cumulative) return order[i];
    }
    return order[keep - 1];
  }

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
};

// A row's first `m` tokens in the sampler's order, and its normaliser summed in id order (as the
// device sums it: another order than the host's sorted one).
struct HostCandidates {
  std::vector<int32_t> ids;
  std::vector<float> logits;
  double normaliser = 0;
  Candidates view(int64_t vocab) const {
    Candidates c;
    c.ids = ids;
    c.logits = logits;
    c.vocab = vocab;
    c.normaliser = normaliser;
    return c;
  }
};
HostCandidates TopOf(const std::vector<float>& x, int64_t m, double temperature) {
  std::vector<int32_t> order(x.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return x[a] > x[b]; });
  HostCandidates c;
  m = std::min<int64_t>(m, x.size());
  c.ids.assign(order.begin(), order.begin() + m);
  for (int32_t id : c.ids) c.logits.push_back(x[id]);
  if (temperature > 0) {
    for (float v : x) c.normaliser += std::exp((double{v} - double{c.logits[0]}) / temperature);
  }
  return c;
}

// Logits with ties (values on a coarse grid) and a few -inf, as an LM head's can hold.
std::vector<float> RandomLogits(std::mt19937_64& rng, int64_t vocab, double scale) {
  std::normal_distribution<float> normal(0.0f, static_cast<float>(scale));
  std::vector<float> x(vocab);
  for (float& v : x) v = std::round(normal(rng) * 8.0f) / 8.0f;
  for (int i = 0; i < 3; ++i) x[rng() % vocab] = -std::numeric_limits<float>::infinity();
  return x;
}

std::vector<SamplingParams> ParamGrid(uint64_t seed) {
  std::vector<SamplingParams> grid;
  for (double t : {0.0, 0.3, 0.7, 1.0, 1.6}) {
    for (int64_t top_k : {int64_t{0}, int64_t{1}, int64_t{5}, int64_t{40}, int64_t{300}}) {
      for (double top_p : {1.0, 0.5, 0.9, 0.95}) grid.push_back({t, top_k, top_p, seed++});
    }
  }
  return grid;
}

TEST(SamplerTest, TheRefactoredDrawGivesTheLegacyTokensFromTheSameSeeds) {
  std::mt19937_64 rng(11);
  for (const SamplingParams& p : ParamGrid(100)) {
    Sampler now(p);
    LegacySampler before(p);
    for (int step = 0; step < 20; ++step) {
      const std::vector<float> x = RandomLogits(rng, 500, step % 2 ? 1.0 : 3.0);
      ASSERT_EQ(now.Sample(x), before.Sample(x))
          << "t=" << p.temperature << " k=" << p.top_k << " p=" << p.top_p << " step " << step;
    }
  }
}

TEST(SamplerTest, CandidatesGiveTheFullRowsTokenAndAdvanceTheStreamAlike) {
  constexpr int64_t kVocab = 3000, kMax = 256;
  std::mt19937_64 rng(5);
  int64_t from_candidates = 0, top_p_from_candidates = 0;
  for (const SamplingParams& p : ParamGrid(7)) {
    Sampler full(p), partial(p);
    const int64_t needed = CandidatesNeeded(p, kVocab, kMax);
    for (int step = 0; step < 30; ++step) {
      // Sharp rows (scale 6) put top-p's mass in few tokens; flat ones (0.5) need many.
      const std::vector<float> x = RandomLogits(rng, kVocab, step % 3 == 0 ? 0.5 : 6.0);
      const int32_t want = full.Sample(x);
      std::optional<int32_t> got;
      if (needed > 0) {
        const HostCandidates c = TopOf(x, needed, NeedsNormaliser(p) ? p.temperature : 0);
        got = partial.SampleCandidates(c.view(kVocab));
      }
      if (got.has_value()) {
        ++from_candidates;
        top_p_from_candidates += NeedsNormaliser(p);
      } else {
        got = partial.Sample(x);  // the caller's fallback: the stream has not advanced
      }
      ASSERT_EQ(*got, want) << "t=" << p.temperature << " k=" << p.top_k << " p=" << p.top_p
                            << " step " << step;
    }
  }
  // Declined: temperature alone, top_k 300 > kMax, and top-p over flat rows (the candidates' mass
  // is below top_p). Top-p over sharp rows (2 in 3 of its 360 draws) is served from candidates.
  EXPECT_GT(from_candidates, 2000);
  EXPECT_GT(top_p_from_candidates, 200);
}

TEST(SamplerTest, CandidatesThatDoNotSufficeAreDeclinedWithoutDrawing) {
  const std::vector<float> x = {0.0f, 0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.6f, 0.7f};
  const int64_t vocab = static_cast<int64_t>(x.size());
  // Temperature alone needs every token.
  {
    Sampler s(SamplingParams{1.0, 0, 1.0, 3});
    EXPECT_FALSE(s.SampleCandidates(TopOf(x, 4, 0).view(vocab)).has_value());
    EXPECT_EQ(CandidatesNeeded(s.params(), vocab, 4), 0);
    EXPECT_EQ(CandidatesNeeded(s.params(), vocab, 8), 8);  // the whole row is within reach
  }
  // top_k 5 from 4 candidates.
  {
    Sampler s(SamplingParams{1.0, 5, 1.0, 3});
    EXPECT_FALSE(s.SampleCandidates(TopOf(x, 4, 0).view(vocab)).has_value());
  }
  // Top-p 0.9 over a nearly flat row: 2 candidates hold ~27% of the mass; and no normaliser.
  {
    Sampler s(SamplingParams{1.0, 0, 0.9, 3});
    EXPECT_FALSE(s.SampleCandidates(TopOf(x, 2, 1.0).view(vocab)).has_value());
    EXPECT_FALSE(s.SampleCandidates(TopOf(x, 8, 0).view(vocab + 1)).has_value());
  }
  // Declining never drew: the stream still matches a fresh sampler's.
  SamplingParams p{1.0, 0, 0.9, 9};
  Sampler declined(p), fresh(p);
  EXPECT_FALSE(declined.SampleCandidates(TopOf(x, 2, 1.0).view(vocab)).has_value());
  for (int i = 0; i < 20; ++i) EXPECT_EQ(declined.Sample(x), fresh.Sample(x));
}

TEST(SamplerTest, ATopPCutWithinTheBandOfTheNormaliserIsDeclined) {
  // Two tokens of equal mass among four (probabilities 0.25 each): top_p 0.5 cuts exactly at the
  // second token, where another summation order could move the cut.
  const std::vector<float> x = {1.0f, 1.0f, 1.0f, 1.0f};
  Sampler s(SamplingParams{1.0, 0, 0.5, 1});
  HostCandidates c = TopOf(x, 3, 1.0);
  EXPECT_FALSE(s.SampleCandidates(c.view(4)).has_value());
  c.normaliser = 4.0 * (1 + 1e-6);  // far enough from the cut: the candidates decide
  EXPECT_TRUE(s.SampleCandidates(c.view(4)).has_value());
}

TEST(SamplerTest, GreedyNeedsOneCandidate) {
  const std::vector<float> x = {0.1f, 3.0f, -1.0f, 3.0f};
  Sampler s(SamplingParams{});
  EXPECT_EQ(CandidatesNeeded(s.params(), 4, 1024), 1);
  EXPECT_EQ(s.SampleCandidates(TopOf(x, 1, 0).view(4)), std::optional<int32_t>(1));
  Sampler k1(SamplingParams{0.8, 1, 0.9, 4});
  EXPECT_EQ(k1.SampleCandidates(TopOf(x, 1, 0).view(4)), std::optional<int32_t>(1));
}

TEST(SamplerTest, LogprobsFromCandidatesEqualTheFullRowsAndNeverChangeTheDraw) {
  constexpr int64_t kVocab = 2000, kMax = 256;
  std::mt19937_64 rng(17);
  int64_t from_candidates = 0;
  for (SamplingParams p : ParamGrid(3)) {
    SamplingParams plain = p;
    p.logprobs = static_cast<int32_t>(rng() % (kMaxTopLogprobs + 1));
    Sampler full(p), partial(p), without(plain);
    const int64_t needed = CandidatesNeeded(p, kVocab, kMax);
    for (int step = 0; step < 12; ++step) {
      const std::vector<float> x = RandomLogits(rng, kVocab, step % 3 == 0 ? 0.5 : 6.0);
      const int32_t want = full.Sample(x);
      ASSERT_EQ(without.Sample(x), want);  // asking for logprobs draws the same tokens
      ASSERT_TRUE(full.last_logprobs().has_value());
      const TokenLogprobs& w = *full.last_logprobs();
      ASSERT_EQ(w.token, want);
      ASSERT_EQ(w.top_ids.size(), static_cast<size_t>(p.logprobs));
      std::optional<int32_t> got;
      if (needed > 0) {
        got = partial.SampleCandidates(TopOf(x, needed, NormaliserTemperature(p)).view(kVocab));
      }
      if (got.has_value()) {
        ++from_candidates;
        ASSERT_TRUE(partial.last_logprobs().has_value());
        const TokenLogprobs& g = *partial.last_logprobs();
        EXPECT_EQ(g.top_ids, w.top_ids);
        EXPECT_NEAR(g.logprob, w.logprob, 1e-4);
        for (size_t i = 0; i < g.top_logprobs.size(); ++i) {
          EXPECT_NEAR(g.top_logprobs[i], w.top_logprobs[i], 1e-4);
        }
      } else {
        got = partial.Sample(x);
      }
      ASSERT_EQ(*got, want) << "t=" << p.temperature << " k=" << p.top_k << " p=" << p.top_p;
    }
  }
  EXPECT_GT(from_candidates, 500);
}

TEST(SamplerTest, LogprobsBesideTopPAtAnotherTemperatureNeedTheFullRow) {
  SamplingParams p{0.7, 0, 0.9, 1};
  p.logprobs = 2;
  EXPECT_EQ(CandidatesNeeded(p, 100, 64), 0);
  const std::vector<float> x = {0.0f, 3.0f, 2.0f, 1.0f};
  Sampler s(p), fresh(p);
  EXPECT_FALSE(s.SampleCandidates(TopOf(x, 4, 1.0).view(4)).has_value());
  EXPECT_EQ(s.Sample(x), fresh.Sample(x));  // declining did not draw
  // At temperature 1 one normaliser serves both; greedy needs max(1, logprobs) candidates.
  p.temperature = 1.0;
  EXPECT_EQ(CandidatesNeeded(p, 100, 64), 64);
  EXPECT_EQ(NormaliserTemperature(p), 1.0);
  SamplingParams greedy;
  greedy.logprobs = 5;
  EXPECT_EQ(CandidatesNeeded(greedy, 100, 64), 5);
  EXPECT_EQ(NormaliserTemperature(greedy), 1.0);
  greedy.logprobs = 21;
  EXPECT_NE(ValidateSamplingParams(greedy).message().find("logprobs"), std::string::npos);
}

}  // namespace
}  // namespace fluxion::model

#include "model/sparse_state.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <utility>

#include "gtest/gtest.h"

namespace fluxion::model {
namespace {

constexpr AttentionShape kShape{2, 4, 2, 16, 0.25f};

DenseAttention Prefilled(int64_t tokens, int64_t tail, uint32_t seed) {
  DenseAttention dense(kShape);
  dense.RecordQueries(tokens - tail, tokens);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0, 1);
  std::vector<float> q(tokens * 4 * 16), k(tokens * 2 * 16), v(tokens * 2 * 16), out(q.size());
  for (int l = 0; l < 2; ++l) {
    for (auto* vec : {&q, &k, &v})
      for (float& x : *vec) x = normal(rng);
    EXPECT_TRUE(dense.Forward(l, 0, tokens, q.data(), k.data(), v.data(), out.data()).ok());
  }
  return dense;
}

TEST(SparseStateTest, CaptureFromTheRecordedTailHasConsistentTablesAndFeatures) {
  const int64_t tokens = 300;
  DenseAttention dense = Prefilled(tokens, 8, 1);
  ASSERT_EQ(dense.recorded_positions(0).size(), 8u);
  auto st = CaptureSparseState(dense, kShape);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->tokens, tokens);
  EXPECT_EQ(st->tail_rows, 8);
  ASSERT_EQ(st->heads.size(), 4u);
  for (const HeadSparseState& h : st->heads) {
    // Each row's weights (max over a group of probability rows) sum to between 1 and group = 2;
    // with decay 0.95 over 8 rows the tables hold between sum(0.95^i) and twice that.
    double vsum = 0, ssum = 0;
    for (float x : h.vertical) vsum += x;
    for (float x : h.slash) ssum += x;
    double decayed = 0;
    for (int i = 0; i < 8; ++i) decayed += std::pow(0.95, i);
    EXPECT_GE(vsum, decayed - 1e-3);
    EXPECT_LE(vsum, 2 * decayed + 1e-3);
    EXPECT_NEAR(vsum, ssum, 1e-3);  // the same weights, indexed two ways
    EXPECT_GT(h.middle_share, 0.0f);
    EXPECT_LE(h.middle_share, 1.0f);
    EXPECT_GT(h.need_fraction, 0.0f);
    EXPECT_LE(h.need_fraction, 1.0f);
    EXPECT_GT(h.entropy, 0.0f);
  }
}

TEST(SparseStateTest, SerializeParseRoundTripsExactly) {
  DenseAttention dense = Prefilled(100, 4, 2);
  auto st = *CaptureSparseState(dense, kShape);
  const std::string bytes = st.Serialize();
  auto back = SparseState::Parse(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->tokens, st.tokens);
  EXPECT_EQ(back->num_kv_heads, st.num_kv_heads);
  ASSERT_EQ(back->heads.size(), st.heads.size());
  for (size_t i = 0; i < st.heads.size(); ++i) {
    EXPECT_EQ(back->heads[i].vertical, st.heads[i].vertical);
    EXPECT_EQ(back->heads[i].slash, st.heads[i].slash);
    EXPECT_EQ(back->heads[i].need_fraction, st.heads[i].need_fraction);
  }
}

TEST(SparseStateTest, ParseRejectsTruncatedForeignAndFutureBuffers) {
  DenseAttention dense = Prefilled(50, 4, 3);
  std::string bytes = CaptureSparseState(dense, kShape)->Serialize();
  EXPECT_FALSE(SparseState::Parse(bytes.substr(0, bytes.size() - 1)).ok());
  EXPECT_FALSE(SparseState::Parse(bytes.substr(0, 10)).ok());
  std::string foreign = bytes;
  foreign[0] = 'X';
  EXPECT_FALSE(SparseState::Parse(foreign).ok());
  std::string future = bytes;
  future[4] = 2;  // version 2
  auto s = SparseState::Parse(future);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("version"), std::string::npos);
}

// Header offsets of the wire format (docs/SPARSE_STATE.md): group at 16, tail_rows at 32, decay
// at 40, coverage at 64; the first feature float right after the 72-byte header.
template <typename T>
std::string WithField(std::string bytes, size_t offset, T value) {
  std::memcpy(&bytes[offset], &value, sizeof(value));
  return bytes;
}

TEST(SparseStateTest, ParseRejectsHeaderFieldsCaptureCannotProduce) {
  DenseAttention dense = Prefilled(50, 4, 3);
  const std::string bytes = CaptureSparseState(dense, kShape)->Serialize();
  ASSERT_TRUE(SparseState::Parse(bytes).ok());
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"group 0", WithField<uint32_t>(bytes, 16, 0)},
      {"tail_rows > tokens", WithField<uint64_t>(bytes, 32, 51)},
      {"NaN decay", WithField<double>(bytes, 40, std::nan(""))},
      {"decay > 1", WithField<double>(bytes, 40, 2.0)},
      {"huge sink_tokens", WithField<uint64_t>(bytes, 48, ~uint64_t{0})},
      {"NaN coverage", WithField<double>(bytes, 64, std::nan(""))},
      {"NaN feature", WithField<float>(bytes, 72, std::nanf(""))},
      {"infinite table entry", WithField<float>(bytes, bytes.size() - 4, INFINITY)},
  };
  for (const auto& [what, bad] : cases) {
    absl::StatusOr<SparseState> s = SparseState::Parse(bad);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << what;
  }
}

// Found by sparse_state_fuzz (UBSan): a state over 0 tokens memcpy'd into a null data().
TEST(SparseStateTest, StateOverZeroTokensRoundTrips) {
  SparseState st;
  st.num_layers = 1;
  st.num_kv_heads = 1;
  st.group = 1;
  st.heads.resize(1);
  absl::StatusOr<SparseState> back = SparseState::Parse(st.Serialize());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->tokens, 0);
  EXPECT_TRUE(back->heads[0].vertical.empty());
}

TEST(SparseStateTest, CheckMatchesComparesShapeAndPromptLength) {
  DenseAttention dense = Prefilled(50, 4, 3);
  const SparseState st = *CaptureSparseState(dense, kShape);
  EXPECT_TRUE(st.CheckMatches(kShape, 50).ok());
  EXPECT_EQ(st.CheckMatches(kShape, 49).code(), absl::StatusCode::kInvalidArgument);
  AttentionShape more_layers = kShape;
  more_layers.num_layers = 3;
  EXPECT_EQ(st.CheckMatches(more_layers, 50).code(), absl::StatusCode::kInvalidArgument);
}

// The bench's stand-in state (decision profiles): the model's shape, dense heavy-tailed tables
// with about half the entries above LFPS's 1e-4 floor, through the wire format unchanged, the same
// for the same seed.
TEST(SparseStateTest, SynthesizedStateMatchesTheShapeAndIsDenseAndHeavyTailed) {
  absl::StatusOr<SparseState> st = SynthesizeSparseState(kShape, 1000, 3);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_TRUE(st->CheckMatches(kShape, 1000).ok());
  int64_t above = 0, total = 0;
  float largest = 0;
  for (const HeadSparseState& h : st->heads) {
    ASSERT_EQ(h.vertical.size(), 1000u);
    ASSERT_EQ(h.slash.size(), 1000u);
    for (float x : h.vertical) {
      above += x >= 1e-4f;
      ++total;
      largest = std::max(largest, x);
    }
  }
  EXPECT_NEAR(static_cast<double>(above) / total, 0.5, 0.05);
  EXPECT_GT(largest, 1e-2f);  // a heavy tail: exp(2 sigma x 3) over the median
  absl::StatusOr<SparseState> back = SparseState::Parse(st->Serialize());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->heads[1].vertical, st->heads[1].vertical);
  EXPECT_EQ(SynthesizeSparseState(kShape, 1000, 3)->heads[0].slash, st->heads[0].slash);
  EXPECT_EQ(SynthesizeSparseState(kShape, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(DenseAttentionTest, RecordsOnlyTheRequestedRange) {
  DenseAttention dense(kShape);
  dense.RecordQueries(5, 8);
  std::vector<float> q(10 * 4 * 16, 1.0f), kv(10 * 2 * 16, 0.5f), out(q.size());
  ASSERT_TRUE(dense.Forward(0, 0, 10, q.data(), kv.data(), kv.data(), out.data()).ok());
  EXPECT_EQ(dense.recorded_positions(0), (std::vector<int64_t>{5, 6, 7}));
  EXPECT_EQ(dense.recorded_queries(0).size(), 3u * 4 * 16);
}

}  // namespace
}  // namespace fluxion::model

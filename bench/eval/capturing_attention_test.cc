#include "bench/eval/capturing_attention.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "bench/eval/npy.h"
#include "common/test_temp_dir.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/dense_attention.h"

namespace fluxion::eval {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

const model::AttentionShape kShape = {/*num_layers=*/2, /*num_heads=*/4, /*num_kv_heads=*/2,
                                      /*head_dim=*/8, /*scale=*/1.0f / std::sqrt(8.0f)};

std::vector<float> Random(int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

// Feeds the same chunks to both attentions, layer by layer; returns whether every output matched
// bit for bit.
bool SameOutputs(model::SequenceAttention& a, model::SequenceAttention& b,
                 const std::vector<int64_t>& chunks, std::mt19937& rng, int64_t pos0 = 0) {
  const int64_t qr = kShape.num_heads * kShape.head_dim, kr = kShape.num_kv_heads * kShape.head_dim;
  bool same = true;
  for (int64_t n : chunks) {
    for (int layer = 0; layer < kShape.num_layers; ++layer) {
      std::vector<float> q = Random(n * qr, rng), k = Random(n * kr, rng), v = Random(n * kr, rng);
      std::vector<float> out_a(n * qr, -1.0f), out_b(n * qr, -2.0f);
      EXPECT_TRUE(a.Forward(layer, pos0, n, q.data(), k.data(), v.data(), out_a.data()).ok());
      EXPECT_TRUE(b.Forward(layer, pos0, n, q.data(), k.data(), v.data(), out_b.data()).ok());
      same = same && out_a == out_b;
    }
    pos0 += n;
  }
  return same;
}

TEST(CapturingAttentionTest, PassesOutputsThroughUnchanged) {
  std::mt19937 rng(1);
  model::DenseAttention plain(kShape);
  CapturingAttention captured(std::make_unique<model::DenseAttention>(kShape), kShape, {});
  EXPECT_TRUE(SameOutputs(plain, captured, {37, 1, 1, 20}, rng));
}

TEST(CapturingAttentionTest, RecordsQueryRowsFromTheFirstCapturedPosition) {
  std::mt19937 rng(2);
  CaptureOptions options;
  options.capture_from = 30;
  CapturingAttention captured(std::make_unique<model::DenseAttention>(kShape), kShape, options);
  const int64_t qr = kShape.num_heads * kShape.head_dim, kr = kShape.num_kv_heads * kShape.head_dim;
  std::vector<float> last_q;
  int64_t pos0 = 0;
  for (int64_t n : {25, 7, 1}) {
    std::vector<float> q = Random(n * qr, rng), k = Random(n * kr, rng), v = Random(n * kr, rng);
    std::vector<float> out(n * qr);
    ASSERT_TRUE(captured.Forward(0, pos0, n, q.data(), k.data(), v.data(), out.data()).ok());
    pos0 += n;
    last_q = q;
  }
  const CapturedRows& rows = captured.rows(0);
  EXPECT_THAT(rows.positions, ElementsAre(30, 31, 32));
  ASSERT_EQ(rows.q.size(), 3 * qr);
  EXPECT_TRUE(std::equal(last_q.begin(), last_q.end(), rows.q.end() - qr));
  EXPECT_EQ(rows.stats.size(), 3 * kShape.num_heads * kNumRowStats);
  for (size_t r = 0; r < 3; ++r) {
    for (int64_t h = 0; h < kShape.num_heads; ++h) {
      const float* s = rows.stats.data() + (r * kShape.num_heads + h) * kNumRowStats;
      EXPECT_GT(s[kSinkMass], 0.0f);
      EXPECT_LE(s[kSinkMass], 1.0f);
      EXPECT_GT(s[kLocalMass], 0.99f) << "the window of 64 covers all 31-33 keys";
      EXPECT_GT(s[kEntropy], 0.0f);
      EXPECT_LE(s[kEntropy], std::log(33.0f) + 1e-4f);
    }
  }
  EXPECT_TRUE(captured.rows(1).positions.empty());
}

TEST(CapturingAttentionTest, StatisticsOfAUniformDistributionAreItsShares) {
  // Zero query: every key scores 0, so p = 1/n for n = position + 1 keys.
  const int64_t position = 199;
  const int64_t kr = kShape.num_kv_heads * kShape.head_dim;
  std::mt19937 rng(3);
  std::vector<float> keys = Random((position + 1) * kr, rng);
  std::vector<float> q(kShape.num_heads * kShape.head_dim, 0.0f);
  std::vector<float> stats(kShape.num_heads * kNumRowStats);
  ComputeRowStats(kShape, CaptureOptions{}, q.data(), keys.data(), position, stats.data());
  for (int64_t h = 0; h < kShape.num_heads; ++h) {
    EXPECT_NEAR(stats[h * kNumRowStats + kSinkMass], 4.0 / 200, 1e-6);
    EXPECT_NEAR(stats[h * kNumRowStats + kLocalMass], 64.0 / 200, 1e-6);
    EXPECT_NEAR(stats[h * kNumRowStats + kEntropy], std::log(200.0), 1e-5);
  }
}

TEST(CapturingAttentionTest, StatisticsOfAPeakedHeadPutItsMassOnTheSink) {
  const int64_t position = 99, d = kShape.head_dim;
  const int64_t kr = kShape.num_kv_heads * d;
  std::vector<float> keys((position + 1) * kr, 0.0f);
  std::vector<float> q(kShape.num_heads * d, 0.0f);
  for (int64_t kv = 0; kv < kShape.num_kv_heads; ++kv) keys[kv * d] = 100.0f;  // key 0
  for (int64_t h = 0; h < kShape.num_heads; ++h) q[h * d] = 100.0f;
  std::vector<float> stats(kShape.num_heads * kNumRowStats);
  ComputeRowStats(kShape, CaptureOptions{}, q.data(), keys.data(), position, stats.data());
  for (int64_t h = 0; h < kShape.num_heads; ++h) {
    EXPECT_NEAR(stats[h * kNumRowStats + kSinkMass], 1.0, 1e-6);
    EXPECT_NEAR(stats[h * kNumRowStats + kLocalMass], 0.0, 1e-6);
    EXPECT_NEAR(stats[h * kNumRowStats + kEntropy], 0.0, 1e-4);
  }
}

TEST(CapturingAttentionTest, ContinuesFromACopiedPrefillWithTheSameRowsAndStatistics) {
  std::mt19937 rng(4);
  CaptureOptions options;
  options.capture_from = 38;
  // One decorator sees every token; the other starts from a copy of a prefill, as decode does.
  CapturingAttention whole(std::make_unique<model::DenseAttention>(kShape), kShape, options);
  model::DenseAttention prefill(kShape);
  EXPECT_TRUE(SameOutputs(whole, prefill, {40}, rng));
  CapturingAttention resumed(std::make_unique<model::DenseAttention>(prefill), kShape, options,
                             &prefill);
  EXPECT_TRUE(SameOutputs(whole, resumed, {1, 1, 1}, rng, /*pos0=*/40));
  for (int l = 0; l < kShape.num_layers; ++l) {
    EXPECT_THAT(whole.rows(l).positions, ElementsAre(38, 39, 40, 41, 42));
    EXPECT_THAT(resumed.rows(l).positions, ElementsAre(40, 41, 42));
    const size_t skip = 2 * kShape.num_heads * kNumRowStats;
    EXPECT_EQ(std::vector<float>(whole.rows(l).stats.begin() + skip, whole.rows(l).stats.end()),
              resumed.rows(l).stats);
  }
}

TEST(CapturingAttentionTest, RefusesTokensThatSkipKeysItNeverSaw) {
  model::DenseAttention prefill(kShape);
  std::mt19937 rng(6);
  model::DenseAttention other(kShape);
  EXPECT_TRUE(SameOutputs(prefill, other, {10}, rng));
  CapturingAttention no_prefix(std::make_unique<model::DenseAttention>(prefill), kShape, {});
  std::vector<float> q(kShape.num_heads * kShape.head_dim),
      kv(kShape.num_kv_heads * kShape.head_dim), out(q.size());
  absl::Status s = no_prefix.Forward(0, 10, 1, q.data(), kv.data(), kv.data(), out.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("prefix"));
}

TEST(CapturingAttentionTest, ReturnsTheWrappedAttentionsErrorsAsTheyAre) {
  CapturingAttention captured(std::make_unique<model::DenseAttention>(kShape, /*max_tokens=*/4),
                              kShape, {});
  std::vector<float> q(5 * kShape.num_heads * kShape.head_dim),
      kv(5 * kShape.num_kv_heads * kShape.head_dim), out(q.size());
  absl::Status s = captured.Forward(0, 0, 5, q.data(), kv.data(), kv.data(), out.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(captured.rows(0).positions.empty());
}

TEST(NpyTest, HeaderIsVersionOneAlignedTo64WithAPythonShapeTuple) {
  const std::string h = NpyHeader("<f4", {3, 4, 5});
  EXPECT_EQ(h.size() % 64, 0u);
  EXPECT_EQ(h.substr(0, 8), std::string("\x93NUMPY\x01\x00", 8));
  const size_t dict_len = static_cast<unsigned char>(h[8]) | static_cast<unsigned char>(h[9]) << 8;
  EXPECT_EQ(dict_len + 10, h.size());
  EXPECT_THAT(h, HasSubstr("{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4, 5), }"));
  EXPECT_EQ(h.back(), '\n');
  EXPECT_THAT(NpyHeader("<i8", {7}), HasSubstr("'shape': (7,)"));
}

TEST(NpyTest, ReaderRoundTripsWhatTheWriterWrote) {
  const std::string path = ::testing::TempDir() + "/npy_roundtrip_" + std::to_string(getpid());
  const std::vector<float> data = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f, -0.5f};
  ASSERT_TRUE(WriteNpy(path + ".f.npy", {3, 2}, data).ok());
  auto f = ReadNpyFloat(path + ".f.npy");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->shape, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(f->data, data);
  const std::vector<int64_t> ids = {256, 84, 104};
  ASSERT_TRUE(WriteNpy(path + ".i.npy", {3}, ids).ok());
  auto i = ReadNpyInt64(path + ".i.npy");
  ASSERT_TRUE(i.ok()) << i.status();
  EXPECT_EQ(i->data, ids);
  // Asking for the wrong dtype, or a missing file, is an error naming the file.
  EXPECT_EQ(ReadNpyFloat(path + ".i.npy").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ReadNpyFloat(path + ".missing.npy").status().code(), absl::StatusCode::kNotFound);
  std::remove((path + ".f.npy").c_str());
  std::remove((path + ".i.npy").c_str());
}

TEST(NpyTest, WritesHeaderThenLittleEndianData) {
  ScopedTestTempDir temp;
  const std::string path = temp.File("npy_test.npy");
  const std::vector<float> data = {1.0f, -2.5f, 3.0f, 0.0f, 5.0f, 6.0f};
  ASSERT_TRUE(WriteNpy(path, {2, 3}, data).ok());
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string header = NpyHeader("<f4", {2, 3});
  ASSERT_EQ(bytes.size(), header.size() + data.size() * sizeof(float));
  EXPECT_EQ(bytes.substr(0, header.size()), header);
  std::vector<float> back(data.size());
  std::memcpy(back.data(), bytes.data() + header.size(), data.size() * sizeof(float));
  EXPECT_EQ(back, data);
  EXPECT_EQ(WriteNpy(path, {4}, data).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace fluxion::eval

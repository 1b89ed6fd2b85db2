// CompactKeysAppend and CompactTopK (kernels/cuda/compact_select.h) against the CPU reference of
// kernels/cpu/compact_topk.h on the same data: the appended rows and scales must be identical bit
// for bit, and the picks identical vectors, for spans that fit the select's shared-memory cache
// and spans that don't, scratch rows that are and aren't 16-byte aligned, k of 0, 1, the span
// and more, duplicated key rows (equal scores straddling the threshold) and zero scores (queries
// so small that every q_scale * k_scale underflows: a zero of either sign is one score).
#include "kernels/cuda/compact_select.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "common/half.h"
#include "gtest/gtest.h"
#include "kernels/compact_keys.h"
#include "kernels/cpu/compact_topk.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/device_buffers_testing.h"

namespace fluxion::kernels::cuda {
namespace {

// The index of the first element where a and b differ bitwise (floats by their bits), or -1.
template <typename T>
int64_t FirstDifference(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return static_cast<int64_t>(std::min(a.size(), b.size()));
  for (size_t j = 0; j < a.size(); ++j) {
    if (std::memcmp(&a[j], &b[j], sizeof(T)) != 0) return static_cast<int64_t>(j);
  }
  return -1;
}

// A compact-keys store on the host, in the device layout.
struct HostKeys {
  CompactKeysLayout shape;  // pointers unset
  std::vector<int8_t> values;
  std::vector<float> scales;

  HostKeys(const CompactKeysLayout& s, int64_t slots)
      : shape(s),
        values(slots * s.num_layers * s.num_kv_heads * s.max_tokens * s.head_dim),
        scales(slots * s.num_layers * s.num_kv_heads * s.max_tokens) {}

  int64_t Row(int64_t slot, int64_t layer, int64_t head, int64_t t) const {
    return shape.RowOffset(slot, layer, head) + t;
  }
  int8_t* Values(int64_t row) { return values.data() + row * shape.head_dim; }
  const int8_t* Values(int64_t row) const { return values.data() + row * shape.head_dim; }

  // A device copy of the store.
  CompactKeysLayout ToDevice(DeviceBuffers* dev) const {
    CompactKeysLayout layout = shape;
    layout.values = dev->ToDevice(values);
    layout.scales = dev->ToDevice(scales);
    return layout;
  }
};

// An fp32 value halfway between two adjacent bf16 values (either parity), so its bf16 rounding
// is a tie to even.
float Bf16Tie(float x) {
  const uint32_t u = (static_cast<uint32_t>(FloatToBf16(x).bits) << 16) | 0x8000u;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Appends `k` ([rows][num_kv_heads][head_dim]) on the device into a store that starts as
// `before`, and expects it to become `before` with the CPU's rows written where they belong.
void ExpectAppendMatchesCpu(const HostKeys& before, int layer, const std::vector<float>& k,
                            const std::vector<int32_t>& slots,
                            const std::vector<int64_t>& positions) {
  DeviceBuffers dev;
  const CompactKeysLayout layout = before.ToDevice(&dev);
  const int64_t rows = static_cast<int64_t>(slots.size());
  ASSERT_EQ(CompactKeysAppend(layout, layer, dev.ToDevice(k), dev.ToDevice(slots),
                              dev.ToDevice(positions), rows, nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  HostKeys expected = before;
  const CompactKeysLayout& s = before.shape;
  for (int64_t i = 0; i < rows; ++i) {
    if (slots[i] < 0 || positions[i] < 0 || positions[i] >= s.max_tokens) continue;
    for (int64_t h = 0; h < s.num_kv_heads; ++h) {
      const int64_t row = expected.Row(slots[i], layer, h, positions[i]);
      expected.scales[row] = cpu::CompactKeyRowFromFloat(
          k.data() + (i * s.num_kv_heads + h) * s.head_dim, s.head_dim, expected.Values(row));
    }
  }
  EXPECT_EQ(
      FirstDifference(DeviceBuffers::ToHost(layout.values, before.values.size()), expected.values),
      -1)
      << "head_dim " << s.head_dim;
  EXPECT_EQ(
      FirstDifference(DeviceBuffers::ToHost(layout.scales, before.scales.size()), expected.scales),
      -1)
      << "head_dim " << s.head_dim;
}

// A store of `slots` slots whose every entry holds a marker, so entries written by mistake show.
HostKeys MarkedStore(const CompactKeysLayout& shape, int64_t slots) {
  HostKeys keys(shape, slots);
  std::fill(keys.values.begin(), keys.values.end(), int8_t{85});
  std::fill(keys.scales.begin(), keys.scales.end(), -1.0f);
  return keys;
}

TEST(CompactKeysAppendTest, StoresWhatTheCpuQuantizes) {
  if (!DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (const int64_t head_dim : {128, 40}) {
    CompactKeysLayout shape;
    shape.num_layers = 2;
    shape.num_kv_heads = 3;
    shape.head_dim = head_dim;
    shape.max_tokens = 50;
    const std::vector<int32_t> slots = {1, 0, 1, 0, 1, 0};
    const std::vector<int64_t> positions = {49, 0, 17, 33, 3, 48};
    const int64_t rows = static_cast<int64_t>(slots.size());
    std::vector<float> k(rows * shape.num_kv_heads * head_dim);
    for (float& x : k) x = normal(rng);
    auto at = [&](int64_t i, int64_t h) {
      return k.data() + (i * shape.num_kv_heads + h) * head_dim;
    };
    std::fill(at(0, 0), at(0, 1), 0.0f);                // an all-zero row: scale 0, values 0
    for (int64_t h = 0; h < shape.num_kv_heads; ++h) {  // row 1: every value a bf16 tie
      for (int64_t d = 0; d < head_dim; ++d) at(1, h)[d] = Bf16Tie(normal(rng));
    }
    at(2, 1)[7] = Bf16Tie(40.0f);  // the largest magnitude a tie: its rounding sets the scale
    at(3, 2)[0] = -Bf16Tie(40.0f);
    ExpectAppendMatchesCpu(MarkedStore(shape, 2), 1, k, slots, positions);
  }
}

TEST(CompactKeysAppendTest, SkipsRowsWithoutASlotOrAPlace) {
  if (!DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(6);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  CompactKeysLayout shape;
  shape.num_layers = 1;
  shape.num_kv_heads = 2;
  shape.head_dim = 64;
  shape.max_tokens = 50;
  // Only the last row has a slot and a position inside the store.
  const std::vector<int32_t> slots = {-1, 0, 1, 1};
  const std::vector<int64_t> positions = {3, 50, 1000, 7};
  std::vector<float> k(slots.size() * shape.num_kv_heads * shape.head_dim);
  for (float& x : k) x = normal(rng);
  ExpectAppendMatchesCpu(MarkedStore(shape, 2), 0, k, slots, positions);
}

// A slot's keys: `context` rows of K drawn at `key_scale`; with `distinct` > 0 the rows past the
// first `distinct` repeat earlier ones, so equal scores straddle the thresholds.
struct SlotSpec {
  int64_t context;
  float key_scale;
  int64_t distinct;
};
// One (row, KV head)'s range and k; with one_in > 0 only candidates compete (CompactPick::mask):
// each row of the range one time in `one_in`, drawn, and k at most their count.
struct PickSpec {
  int32_t begin, end, k;
  int one_in = 0;
};
// A batch row: its slot (-1: not selected), its queries' scale, and its picks: head h takes
// picks[h % picks.size()].
struct RowSpec {
  int32_t slot;
  float q_scale;
  std::vector<PickSpec> picks;
};
struct SelectShape {
  int64_t head_dim, group, num_kv_heads, num_layers, layer;  // the layer selected from
};
struct SelectCase {
  SelectShape shape;
  std::vector<SlotSpec> slots;
  std::vector<RowSpec> rows;
};

HostKeys FillKeys(const SelectCase& c, std::mt19937* rng) {
  CompactKeysLayout shape;
  shape.num_layers = c.shape.num_layers;
  shape.num_kv_heads = c.shape.num_kv_heads;
  shape.head_dim = c.shape.head_dim;
  for (const SlotSpec& s : c.slots) shape.max_tokens = std::max(shape.max_tokens, s.context);
  HostKeys keys(shape, static_cast<int64_t>(c.slots.size()));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> k(c.shape.head_dim);
  for (size_t slot = 0; slot < c.slots.size(); ++slot) {
    const SlotSpec& s = c.slots[slot];
    for (int64_t h = 0; h < c.shape.num_kv_heads; ++h) {
      for (int64_t t = 0; t < s.context; ++t) {
        const int64_t row = keys.Row(slot, c.shape.layer, h, t);
        if (s.distinct > 0 && t >= s.distinct) {
          const int64_t from = keys.Row(slot, c.shape.layer, h, (*rng)() % s.distinct);
          std::copy(keys.Values(from), keys.Values(from) + c.shape.head_dim, keys.Values(row));
          keys.scales[row] = keys.scales[from];
          continue;
        }
        for (float& x : k) x = normal(*rng) * s.key_scale;
        keys.scales[row] =
            cpu::CompactKeyRowFromFloat(k.data(), c.shape.head_dim, keys.Values(row));
      }
    }
  }
  return keys;
}

// What the test learned about the CPU's scores, to check that it exercised the hard cases.
struct Coverage {
  int tied_thresholds = 0;  // the k-th and (k+1)-th largest scores equal
  int zero_thresholds = 0;  // and zero
};

// The CPU's picks for query group q_group ([group][head_dim]) over rows [begin, end) of
// (slot, layer, head).
// (slot, layer, head), among the candidates of `pick` (its mask's words in `masks`).
std::vector<int32_t> CpuPicks(const HostKeys& keys, const SelectCase& c, const float* q_group,
                              int32_t slot, int64_t head, const CompactPick& p,
                              const std::vector<uint64_t>& masks, Coverage* coverage) {
  cpu::CompactQuery query;
  cpu::CompactQueryGroup(q_group, c.shape.group, c.shape.head_dim, &query);
  const int64_t n = p.end - p.begin;
  std::vector<float> scores(n);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t row = keys.Row(slot, c.shape.layer, head, p.begin + j);
    scores[j] = CompactCandidate(p, masks.data(), j)
                    ? cpu::CompactGroupScore(query, keys.Values(row), keys.scales[row])
                    : -INFINITY;
  }
  std::vector<int32_t> picks;
  cpu::CompactTopKPositions(scores.data(), n, p.k, p.begin, &picks);

  std::vector<float> sorted = scores;
  std::sort(sorted.begin(), sorted.end(), std::greater<float>());
  if (p.k < n && sorted[p.k - 1] == sorted[p.k]) {
    ++coverage->tied_thresholds;
    if (sorted[p.k] == 0.0f) ++coverage->zero_thresholds;
  }
  return picks;
}

bool Selects(const RowSpec& r, const PickSpec& p) {
  return r.slot >= 0 && p.k > 0 && p.begin < p.end;
}

void ExpectSelectMatchesCpu(const SelectCase& c, std::mt19937* rng, Coverage* coverage) {
  const HostKeys keys = FillKeys(c, rng);
  const int64_t rows = static_cast<int64_t>(c.rows.size());
  const int64_t num_heads = c.shape.num_kv_heads * c.shape.group;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> q(rows * num_heads * c.shape.head_dim);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t e = 0; e < num_heads * c.shape.head_dim; ++e) {
      q[i * num_heads * c.shape.head_dim + e] = normal(*rng) * c.rows[i].q_scale;
    }
  }

  // The picks side by side (room for skipped rows' too: nothing may be written there), and the
  // expected output.
  std::vector<int32_t> slots;
  std::vector<CompactPick> picks;
  std::vector<uint64_t> masks;
  std::vector<int32_t> expected;
  int64_t max_n = 0;
  for (int64_t i = 0; i < rows; ++i) {
    const RowSpec& r = c.rows[i];
    slots.push_back(r.slot);
    for (int64_t h = 0; h < c.shape.num_kv_heads; ++h) {
      PickSpec p = r.picks[h % r.picks.size()];
      const int64_t n = p.end - p.begin;
      CompactPick pick{p.begin, p.end, p.k, -1, static_cast<int64_t>(expected.size())};
      if (p.one_in > 0 && n > 0) {
        pick.mask = static_cast<int32_t>(masks.size());
        masks.resize(masks.size() + (n + 63) / 64, 0);
        int32_t candidates = 0;
        for (int64_t j = 0; j < n; ++j) {
          if ((*rng)() % p.one_in != 0) continue;
          masks[pick.mask + j / 64] |= uint64_t{1} << (j % 64);
          ++candidates;
        }
        pick.k = p.k = std::min(p.k, candidates);
      }
      picks.push_back(pick);
      max_n = std::max(max_n, n);
      if (p.k <= 0 || n <= 0) continue;
      if (!Selects(r, p)) {
        expected.insert(expected.end(), std::min<int64_t>(p.k, n), -7);
        continue;
      }
      const std::vector<int32_t> cpu_picks =
          CpuPicks(keys, c, q.data() + (i * num_heads + h * c.shape.group) * c.shape.head_dim,
                   r.slot, h, pick, masks, coverage);
      expected.insert(expected.end(), cpu_picks.begin(), cpu_picks.end());
    }
  }
  expected.push_back(-7);  // nothing written past the picks

  DeviceBuffers dev;
  const CompactKeysLayout layout = keys.ToDevice(&dev);
  const float* q_dev = dev.ToDevice(q);
  const int32_t* slots_dev = dev.ToDevice(slots);
  const CompactPick* picks_dev = dev.ToDevice(picks);
  const uint64_t* masks_dev = masks.empty() ? nullptr : dev.ToDevice(masks);
  // Scratch rows 16-byte aligned, and not.
  const int64_t aligned_span = (max_n + 3) / 4 * 4;
  for (const int64_t max_span : {aligned_span, aligned_span + 1}) {
    float* scores = dev.ToDevice(std::vector<float>(rows * c.shape.num_kv_heads * max_span, NAN));
    int32_t* out = dev.ToDevice(std::vector<int32_t>(expected.size(), -7));
    ASSERT_EQ(CompactTopK(layout, static_cast<int>(c.shape.layer), q_dev, num_heads, slots_dev,
                          picks_dev, masks_dev, rows, max_span, scores, out, nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<int32_t> got = DeviceBuffers::ToHost(out, expected.size());
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t h = 0; h < c.shape.num_kv_heads; ++h) {
        const CompactPick& p = picks[i * c.shape.num_kv_heads + h];
        const size_t at = static_cast<size_t>(p.offset);
        const size_t end = i * c.shape.num_kv_heads + h + 1 < static_cast<int64_t>(picks.size())
                               ? static_cast<size_t>(picks[i * c.shape.num_kv_heads + h + 1].offset)
                               : expected.size() - 1;
        const std::vector<int32_t> want(expected.begin() + at, expected.begin() + end);
        const std::vector<int32_t> gpu(got.begin() + at, got.begin() + end);
        EXPECT_EQ(FirstDifference(gpu, want), -1)
            << "head_dim " << c.shape.head_dim << " max_span " << max_span << " row " << i
            << " head " << h << " [" << p.begin << ", " << p.end << ") k " << p.k;
      }
    }
    EXPECT_EQ(got.back(), -7) << "nothing written past the picks";
  }
}

TEST(CompactTopKTest, PicksWhatTheCpuSelectionPicks) {
  if (!DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(7);
  const std::vector<SelectCase> cases = {
      // Llama-3.1-8B's head shape; spans past the select's cache (8,192) and within it.
      {{128, 4, 2, 1, 0},
       {{70000, 1.0f, 0}, {1000, 1.0f, 40}, {37, 1.0f, 0}},
       {{0, 1.0f, {{0, 70000, 3500}, {16, 69000, 700}}},
        {1, 1.0f, {{0, 1000, 100}, {3, 997, 1}}},
        {2, 1.0f, {{0, 37, 5}, {0, 37, 37}}},
        {0, 1.0f, {{100, 5000, 0}, {200, 300, 500}}},  // k = 0; k > span
        {1, 1.0f, {{500, 500, 5}, {10, 900, 889}}},    // an empty range; k = span - 1
        // Candidates only (LFPS's table picks): past the cache and within it; k above their
        // count (clamped to it); one in one (every row a candidate, as without a mask).
        {0, 1.0f, {{64, 60000, 2000, 8}, {10, 70000, 100000, 9}}},
        {1, 1.0f, {{3, 1000, 40, 3}, {0, 1000, 300, 1}}}}},
      // A layer past the first; a row without a slot; an all-zero query (every score +0.0).
      {{32, 2, 4, 3, 2},
       {{1000, 1.0f, 0}, {37, 1.0f, 3}},
       {{0, 1.0f, {{0, 1000, 50}, {0, 1000, 1}, {999, 1000, 1}, {1, 1000, 998}}},
        {1, 1.0f, {{0, 37, 4}, {2, 30, 10}, {0, 37, 36}, {0, 37, 0}}},
        {-1, 1.0f, {{0, 37, 5}}},
        {0, 0.0f, {{0, 1000, 10}, {7, 900, 450}}}}},
      // Many duplicated rows over a long span; spans of exactly the cache and one more; queries
      // so small that q_scale * k_scale underflows: every score is zero (on the device -0.0 where
      // the dot product is negative).
      {{64, 1, 3, 1, 0},
       {{70000, 1.0f, 5000}, {1000, 1e-20f, 0}},
       {{0, 1.0f, {{0, 70000, 7000}, {35000, 70000, 1}, {0, 65536, 4096}}},
        {1, 1e-25f, {{0, 1000, 100}, {0, 1000, 999}, {5, 600, 300}}},
        {0, 1.0f, {{0, 70000, 69999}, {1, 8194, 8000}, {0, 8192, 8191}}}}},
  };
  Coverage coverage;
  for (const SelectCase& c : cases) ExpectSelectMatchesCpu(c, &rng, &coverage);
  EXPECT_GT(coverage.tied_thresholds, 3) << "the duplicated rows should tie at thresholds";
  EXPECT_GT(coverage.zero_thresholds, 1) << "the tiny and zero queries should tie at zero";
}

TEST(CompactTopKTest, RejectsUnsupportedShapes) {
  // No launch happens: this runs without a device too.
  CompactKeysLayout layout;
  layout.num_layers = 1;
  layout.num_kv_heads = 2;
  layout.max_tokens = 16;
  auto top_k = [&](int64_t head_dim, int64_t num_heads, int layer) {
    layout.head_dim = head_dim;
    return CompactTopK(layout, layer, nullptr, num_heads, nullptr, nullptr, nullptr, 1, 16,
                       nullptr, nullptr, nullptr);
  };
  EXPECT_EQ(top_k(48, 8, 0), cudaErrorInvalidValue);    // head_dim
  EXPECT_EQ(top_k(128, 18, 0), cudaErrorInvalidValue);  // a group of 9
  EXPECT_EQ(top_k(128, 5, 0), cudaErrorInvalidValue);   // heads not a multiple of KV heads
  EXPECT_EQ(top_k(128, 8, 1), cudaErrorInvalidValue);   // layer
  EXPECT_EQ(CompactKeysAppend(layout, -1, nullptr, nullptr, nullptr, 1, nullptr),
            cudaErrorInvalidValue);
}

}  // namespace
}  // namespace fluxion::kernels::cuda

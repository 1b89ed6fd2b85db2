#include "model/sparse_state.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace fluxion::model {
namespace {

constexpr char kMagic[4] = {'F', 'X', 'S', 'S'};

struct Header {
  char magic[4];
  uint32_t version;
  uint32_t num_layers, num_kv_heads, group, reserved;
  uint64_t tokens, tail_rows;
  double decay;
  uint64_t sink_tokens, local_tokens;
  double coverage;
};
static_assert(sizeof(Header) == 72, "wire header layout");
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the wire format is little-endian");

constexpr int kFeatures = 5;
// The counts a consumer uses as int64 loop bounds and window sizes; 2^32 is far above any context.
constexpr uint64_t kMaxCount = uint64_t{1} << 32;

// The fields the size check does not cover. Policies use them as window sizes, weights and
// divisors, so each must be in the range Capture could have produced.
absl::Status ValidateHeaderFields(const Header& h) {
  if (h.group < 1 || h.group > 4096) {
    return absl::InvalidArgumentError(absl::StrCat("sparse state group ", h.group,
                                                   " is outside [1, 4096]"));
  }
  if (h.tail_rows > h.tokens) {
    return absl::InvalidArgumentError(absl::StrCat("sparse state tail_rows ", h.tail_rows,
                                                   " exceeds its ", h.tokens, " tokens"));
  }
  if (h.sink_tokens > kMaxCount || h.local_tokens > kMaxCount) {
    return absl::InvalidArgumentError("sparse state sink/local token counts are implausible");
  }
  if (!(h.decay > 0 && h.decay <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("sparse state decay ", h.decay,
                                                   " is outside (0, 1]"));
  }
  if (!(h.coverage >= 0 && h.coverage <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("sparse state coverage ", h.coverage,
                                                   " is outside [0, 1]"));
  }
  return absl::OkStatus();
}

// NaN breaks the strict weak ordering the policies' sorts and top-k selections rely on (undefined
// behaviour, out-of-bounds reads in practice), so every value must be finite.
bool AllFinite(const char* p, uint64_t count) {
  for (uint64_t i = 0; i < count; ++i) {
    float v;
    std::memcpy(&v, p + i * sizeof(float), sizeof(float));
    if (!std::isfinite(v)) return false;
  }
  return true;
}

}  // namespace

std::string SparseState::Serialize() const {
  Header h;
  std::memcpy(h.magic, kMagic, 4);
  h.version = kSparseStateVersion;
  h.num_layers = static_cast<uint32_t>(num_layers);
  h.num_kv_heads = static_cast<uint32_t>(num_kv_heads);
  h.group = static_cast<uint32_t>(group);
  h.reserved = 0;
  h.tokens = static_cast<uint64_t>(tokens);
  h.tail_rows = static_cast<uint64_t>(tail_rows);
  h.decay = params.decay;
  h.sink_tokens = static_cast<uint64_t>(params.sink_tokens);
  h.local_tokens = static_cast<uint64_t>(params.local_tokens);
  h.coverage = params.coverage;
  std::string out(reinterpret_cast<const char*>(&h), sizeof(h));
  for (const HeadSparseState& s : heads) {
    const float f[kFeatures] = {s.middle_share, s.need_fraction, s.sink_mass, s.local_mass,
                                s.entropy};
    out.append(reinterpret_cast<const char*>(f), sizeof(f));
    out.append(reinterpret_cast<const char*>(s.vertical.data()), tokens * sizeof(float));
    out.append(reinterpret_cast<const char*>(s.slash.data()), tokens * sizeof(float));
  }
  return out;
}

absl::StatusOr<SparseState> SparseState::Parse(absl::string_view bytes) {
  if (bytes.size() < sizeof(Header)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sparse state of ", bytes.size(), " bytes is shorter than its header"));
  }
  Header h;
  std::memcpy(&h, bytes.data(), sizeof(h));
  if (std::memcmp(h.magic, kMagic, 4) != 0) {
    return absl::InvalidArgumentError("not a sparse state (bad magic)");
  }
  if (h.version != kSparseStateVersion) {
    return absl::InvalidArgumentError(absl::StrCat("sparse state version ", h.version,
                                                   " is not supported (expected ",
                                                   kSparseStateVersion, ")"));
  }
  const uint64_t heads = uint64_t{h.num_layers} * h.num_kv_heads;
  // Bound every factor before multiplying, so a hostile header cannot overflow the size check.
  if (h.num_layers > 4096 || h.num_kv_heads > 4096 || h.tokens > (uint64_t{1} << 32)) {
    return absl::InvalidArgumentError("sparse state header has implausible sizes");
  }
  FLUXION_RETURN_IF_ERROR(ValidateHeaderFields(h));
  const uint64_t per_head = kFeatures * sizeof(float) + 2 * h.tokens * sizeof(float);
  if (bytes.size() != sizeof(Header) + heads * per_head) {
    return absl::InvalidArgumentError(absl::StrCat("sparse state holds ", bytes.size(),
                                                   " bytes; its header describes ",
                                                   sizeof(Header) + heads * per_head));
  }
  const char* values = bytes.data() + sizeof(Header);
  if (!AllFinite(values, (bytes.size() - sizeof(Header)) / sizeof(float))) {
    return absl::InvalidArgumentError("sparse state holds a NaN or infinite value");
  }
  SparseState st;
  st.num_layers = h.num_layers;
  st.num_kv_heads = h.num_kv_heads;
  st.group = h.group;
  st.tokens = static_cast<int64_t>(h.tokens);
  st.tail_rows = static_cast<int64_t>(h.tail_rows);
  st.params = {h.decay, static_cast<int64_t>(h.sink_tokens), static_cast<int64_t>(h.local_tokens),
               h.coverage};
  st.heads.resize(heads);
  const char* p = bytes.data() + sizeof(Header);
  for (HeadSparseState& s : st.heads) {
    float f[kFeatures];
    std::memcpy(f, p, sizeof(f));
    p += sizeof(f);
    s.middle_share = f[0];
    s.need_fraction = f[1];
    s.sink_mass = f[2];
    s.local_mass = f[3];
    s.entropy = f[4];
    // assign, not memcpy into data(): with 0 tokens data() is null, and memcpy from or to null
    // is undefined even for 0 bytes (UBSan, found by sparse_state_fuzz).
    const size_t bytes_per_table = static_cast<size_t>(st.tokens) * sizeof(float);
    s.vertical.resize(st.tokens);
    s.slash.resize(st.tokens);
    if (st.tokens > 0) {
      std::memcpy(s.vertical.data(), p, bytes_per_table);
      std::memcpy(s.slash.data(), p + bytes_per_table, bytes_per_table);
    }
    p += 2 * bytes_per_table;
  }
  return st;
}

absl::Status SparseState::CheckMatches(const AttentionShape& shape, int64_t prompt_tokens) const {
  if (num_layers != shape.num_layers || num_kv_heads != shape.num_kv_heads ||
      (shape.num_kv_heads > 0 && group != shape.num_heads / shape.num_kv_heads) ||
      tokens != prompt_tokens ||
      static_cast<int64_t>(heads.size()) != num_layers * num_kv_heads) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sparse state of ", num_layers, " layers x ", num_kv_heads, " KV heads (group ", group,
        ") over ", tokens, " tokens does not match the model's ", shape.num_layers, " x ",
        shape.num_kv_heads, " and the ", prompt_tokens, "-token prompt"));
  }
  return absl::OkStatus();
}

absl::StatusOr<SparseState> CaptureSparseState(
    const std::vector<const float*>& keys, int64_t tokens,
    const std::vector<std::vector<float>>& tail_q,
    const std::vector<std::vector<int64_t>>& tail_positions, const AttentionShape& shape,
    const SparseStateParams& params) {
  const int64_t layers = shape.num_layers, hkv = shape.num_kv_heads, d = shape.head_dim;
  const int64_t hq = shape.num_heads, group = hq / hkv;
  if (static_cast<int64_t>(keys.size()) != layers ||
      static_cast<int64_t>(tail_q.size()) != layers ||
      static_cast<int64_t>(tail_positions.size()) != layers) {
    return absl::InvalidArgumentError("sparse-state capture needs keys and tail rows per layer");
  }
  SparseState st;
  st.num_layers = layers;
  st.num_kv_heads = hkv;
  st.group = group;
  st.tokens = tokens;
  st.params = params;
  st.heads.resize(layers * hkv);
  std::vector<double> scores, best;
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t rows = static_cast<int64_t>(tail_positions[l].size());
    if (static_cast<int64_t>(tail_q[l].size()) != rows * hq * d) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", l, ": tail queries hold ",
                                                     tail_q[l].size(), " floats for ", rows,
                                                     " rows"));
    }
    st.tail_rows = std::max(st.tail_rows, rows);
    const int64_t last = rows > 0 ? tail_positions[l].back() : tokens - 1;
    for (int64_t kvh = 0; kvh < hkv; ++kvh) {
      HeadSparseState& hs = st.heads[l * hkv + kvh];
      hs.vertical.assign(tokens, 0.0f);
      hs.slash.assign(tokens, 0.0f);
      double share_max = 0, need_sum = 0, sink_sum = 0, local_sum = 0, entropy_sum = 0;
      int64_t need_rows = 0, head_rows = 0;
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t p = tail_positions[l][i];
        if (p < 0 || p >= tokens) {
          return absl::InvalidArgumentError(absl::StrCat("tail position ", p, " outside the ",
                                                         tokens, "-token prompt"));
        }
        const int64_t n = p + 1;
        const int64_t sink_end = std::min(params.sink_tokens, n);
        const int64_t local_begin = std::max(sink_end, n - params.local_tokens);
        best.assign(n, 0.0);
        for (int64_t g = 0; g < group; ++g) {
          const float* q = &tail_q[l][(i * hq + kvh * group + g) * d];
          scores.resize(n);
          double m = -INFINITY;
          for (int64_t j = 0; j < n; ++j) {
            const float* k = keys[l] + (j * hkv + kvh) * d;
            double dot = 0;
            for (int64_t t = 0; t < d; ++t) dot += double(q[t]) * k[t];
            scores[j] = dot * shape.scale;
            m = std::max(m, scores[j]);
          }
          double z = 0;
          for (int64_t j = 0; j < n; ++j) z += (scores[j] = std::exp(scores[j] - m));
          double sink = 0, local = 0, entropy = 0;
          for (int64_t j = 0; j < n; ++j) {
            const double a = scores[j] / z;
            best[j] = std::max(best[j], a);
            if (j < sink_end) sink += a;
            if (j >= local_begin) local += a;
            if (a > 0) entropy -= a * std::log(a);
          }
          sink_sum += sink;
          local_sum += local;
          entropy_sum += entropy;
          ++head_rows;
        }
        const double w = std::pow(params.decay, static_cast<double>(last - p));
        for (int64_t j = 0; j < n; ++j) {
          hs.vertical[j] += static_cast<float>(w * best[j]);
          hs.slash[p - j] += static_cast<float>(w * best[j]);
        }
        double share = 0;
        for (int64_t j = sink_end; j < local_begin; ++j) share += best[j];
        share_max = std::max(share_max, std::min(1.0, share));
        if (local_begin > sink_end && share > 0) {
          std::vector<double> middle(best.begin() + sink_end, best.begin() + local_begin);
          std::sort(middle.begin(), middle.end(), std::greater<double>());
          double covered = 0;
          size_t needed = 0;
          while (needed < middle.size() && covered < params.coverage * share) {
            covered += middle[needed++];
          }
          need_sum += static_cast<double>(needed) / middle.size();
          ++need_rows;
        }
      }
      hs.middle_share = rows > 0 ? static_cast<float>(share_max) : 1.0f;
      hs.need_fraction = need_rows > 0 ? static_cast<float>(need_sum / need_rows) : 1.0f;
      if (head_rows > 0) {
        hs.sink_mass = static_cast<float>(sink_sum / head_rows);
        hs.local_mass = static_cast<float>(local_sum / head_rows);
        hs.entropy = static_cast<float>(entropy_sum / head_rows);
      }
    }
  }
  return st;
}

absl::StatusOr<SparseState> CaptureSparseState(const DenseAttention& prefilled,
                                               const AttentionShape& shape,
                                               const SparseStateParams& params) {
  std::vector<const float*> keys;
  std::vector<std::vector<float>> tail_q;
  std::vector<std::vector<int64_t>> tail_positions;
  const int64_t tokens = shape.num_layers > 0 ? prefilled.length(0) : 0;
  for (int l = 0; l < shape.num_layers; ++l) {
    if (prefilled.length(l) != tokens) {
      return absl::InvalidArgumentError("prefilled layers hold different token counts");
    }
    keys.push_back(prefilled.keys(l));
    tail_q.push_back(prefilled.recorded_queries(l));
    tail_positions.push_back(prefilled.recorded_positions(l));
  }
  return CaptureSparseState(keys, tokens, tail_q, tail_positions, shape, params);
}

absl::StatusOr<SparseState> SynthesizeSparseState(const AttentionShape& shape, int64_t tokens,
                                                   uint64_t seed, const SparseStateParams& params) {
  if (tokens < 1 || static_cast<uint64_t>(tokens) > kMaxCount) {
    return absl::InvalidArgumentError(absl::StrCat("a synthesized sparse state needs 1 to ",
                                                   kMaxCount, " tokens, not ", tokens));
  }
  SparseState s;
  s.num_layers = shape.num_layers;
  s.num_kv_heads = shape.num_kv_heads;
  s.group = shape.num_heads / shape.num_kv_heads;
  s.tokens = tokens;
  s.tail_rows = 0;  // no rows were captured
  s.params = params;
  // One draw of 2 x tokens values, rotated per head: a head's tables differ from its neighbours'
  // without 2 x tokens draws per head (at 128K and 256 heads that would be 67M draws).
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> pool(2 * tokens);
  for (float& x : pool) x = 1e-4f * std::exp(normal(rng));
  const int64_t heads = shape.num_layers * shape.num_kv_heads;
  s.heads.resize(heads);
  for (int64_t h = 0; h < heads; ++h) {
    HeadSparseState& hs = s.heads[h];
    const int64_t shift = (h * 7919) % (2 * tokens);
    std::vector<float> tables(2 * tokens);
    std::rotate_copy(pool.begin(), pool.begin() + shift, pool.end(), tables.begin());
    hs.vertical.assign(tables.begin(), tables.begin() + tokens);
    hs.slash.assign(tables.begin() + tokens, tables.end());
  }
  return s;
}

}  // namespace fluxion::model

// generate_call_steps_bench: how long LandPrompt (decode/generate_call_steps.h) takes to land a
// prompt that a prefill node wrote, at Llama-3.1-8B KV shapes (32 layers, 8 KV heads, head_dim
// 128, 16-token pages), against one read of the context at this machine's measured read
// bandwidth (the physical limit of any landing that reads the pages once).
//
// Measurement tool, not a test: the pages hold random bf16 keys and values, filled once; each
// repetition reserves them again, writes what the prefill node would have sent (checksums), and
// times LandPrompt alone (verification, adoption, policy setup) until the attention exists.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "common/flag_set.h"
#include "common/half.h"
#include "common/read_bandwidth.h"
#include "decode/generate_call_steps.h"
#include "decode/paged_kv.h"
#include "nlohmann/json.hpp"
#include "transfer/crc32c.h"

namespace fluxion::decode {
namespace {

namespace v1 = ::fluxion::v1;

constexpr int64_t kPageTokens = 16;

model::AttentionShape Llama8bShape() {
  model::AttentionShape s;
  s.num_layers = 32;
  s.num_heads = 32;
  s.num_kv_heads = 8;
  s.head_dim = 128;
  s.scale = 1.0f / std::sqrt(128.0f);
  return s;
}

std::vector<int32_t> PageIds(const Reservation& r) {
  std::vector<int32_t> ids;
  for (const PageRun& run : r.runs()) {
    for (int32_t p = run.first; p < run.first + run.count; ++p) ids.push_back(p);
  }
  return ids;
}

struct Row {
  int64_t context = 0;
  double gib = 0, ms = 0, ms_min = 0, ms_max = 0, gbps = 0;
};

int Main(int argc, char** argv) {
  std::vector<int64_t> contexts = {2048, 8192, 16384};
  int64_t reps = 5;
  std::string json_path;
  FlagSet flags("generate_call_steps_bench",
                "Time LandPrompt (verify + adopt a landed prompt) at Llama-3.1-8B KV shapes.");
  flags.IntList("contexts", &contexts, "prompt lengths in tokens");
  flags.Int("reps", &reps, "timed repetitions per context (after one untimed)");
  flags.String("json", &json_path, "also write the results here (docs/BENCHMARKS.md format)");
  std::vector<std::string> args(argv + 1, argv + argc);
  if (absl::Status s = flags.Parse(args); !s.ok() || flags.help_requested()) {
    std::fprintf(stderr, "%s\n%s", s.ToString().c_str(), flags.Usage().c_str());
    return s.ok() ? 0 : 2;
  }
  const model::AttentionShape shape = Llama8bShape();
  const KvShape kv_shape{shape.num_layers, shape.num_kv_heads, shape.head_dim, kPageTokens};
  const int64_t max_context = *std::max_element(contexts.begin(), contexts.end());
  const int64_t max_pages =
      shape.num_layers * shape.num_kv_heads * ((max_context + kPageTokens - 1) / kPageTokens);
  absl::StatusOr<std::unique_ptr<KvArena>> arena =
      KvArena::Create(kv_shape.page_bytes(), max_pages + 64, {/*huge_pages=*/false});
  if (!arena.ok()) {
    std::fprintf(stderr, "arena: %s\n", arena.status().ToString().c_str());
    return 1;
  }
  {  // random finite bf16 keys and values (slices of a 4 Mi-value pool: drawing GiBs is slow)
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<bf16> pool(size_t{1} << 22);
    for (bf16& x : pool) x = FloatToBf16(normal(rng));
    const size_t per_page = kv_shape.page_bytes() / sizeof(bf16);
    for (int64_t p = 0; p < (*arena)->num_pages(); ++p) {
      const size_t at = (static_cast<size_t>(p) * 7919) % (pool.size() - per_page);
      std::memcpy((*arena)->page(static_cast<int32_t>(p)), pool.data() + at,
                  kv_shape.page_bytes());
    }
  }
  KvAdmissionOptions ao;
  ao.release_thread = false;
  KvAdmission admission(arena->get(), ao);
  absl::StatusOr<sparse::PolicyConfig> policy = sparse::ParsePolicy("full", 1.0);
  const double read_gbps = common::MeasureReadBandwidthGbps(size_t{1} << 30, 1);

  std::vector<Row> rows;
  for (int64_t context : contexts) {
    const int64_t per_head = (context + kPageTokens - 1) / kPageTokens;
    const int64_t pages = shape.num_layers * shape.num_kv_heads * per_head;
    std::vector<double> ms;
    for (int64_t rep = 0; rep <= reps; ++rep) {
      absl::StatusOr<Reservation> kv =
          admission.Reserve(pages, absl::Now() + absl::Seconds(10), [] { return false; });
      if (!kv.ok()) {
        std::fprintf(stderr, "reserve: %s\n", kv.status().ToString().c_str());
        return 1;
      }
      // What the prefill node sends: CRC-32C per layer over the content bytes in page order.
      const std::vector<int32_t> ids = PageIds(*kv);
      v1::PrefillResponse landed;
      landed.set_node_name("bench");
      const int64_t per_layer = pages / shape.num_layers;
      for (int64_t layer = 0; layer < shape.num_layers; ++layer) {
        uint32_t crc = 0;
        for (int64_t i = layer * per_layer; i < (layer + 1) * per_layer; ++i) {
          crc = transfer::Crc32cExtend(crc, (*arena)->page(ids[i]), kv_shape.page_bytes());
        }
        landed.add_layer_checksums(crc);
      }
      LandingInput in;
      in.arena = arena->get();
      in.shape = shape;
      in.page_tokens = kPageTokens;
      in.prompt_tokens = context;
      in.landed = &landed;
      in.policy = &*policy;
      bool checksum_failed = false;
      const absl::Time start = absl::Now();
      absl::StatusOr<std::unique_ptr<SparseAttention>> attention =
          LandPrompt(in, std::move(*kv), Reservation(), &checksum_failed);
      const double elapsed = absl::ToDoubleMilliseconds(absl::Now() - start);
      if (!attention.ok()) {
        std::fprintf(stderr, "landing: %s\n", attention.status().ToString().c_str());
        return 1;
      }
      if (rep > 0) ms.push_back(elapsed);
    }
    std::sort(ms.begin(), ms.end());
    Row row;
    row.context = context;
    row.gib = static_cast<double>(pages) * kv_shape.page_bytes() / (1 << 30);
    row.ms = ms[ms.size() / 2];
    row.ms_min = ms.front();
    row.ms_max = ms.back();
    row.gbps = static_cast<double>(pages) * kv_shape.page_bytes() / (row.ms * 1e6);
    rows.push_back(row);
  }

  std::printf("%8s %8s %10s %10s %10s %12s %14s\n", "context", "KV GiB", "ms", "min", "max",
              "KV GB/s", "one read, ms");
  for (const Row& r : rows) {
    std::printf("%8lld %8.2f %10.1f %10.1f %10.1f %12.2f %14.1f\n",
                static_cast<long long>(r.context), r.gib, r.ms, r.ms_min, r.ms_max, r.gbps,
                r.gib * (1 << 30) / (read_gbps * 1e6));
  }
  std::printf("# Llama-3.1-8B KV shapes, policy full, median of %lld; read probe %.2f GB/s "
              "(1 thread)\n",
              static_cast<long long>(reps), read_gbps);
  if (!json_path.empty()) {
    nlohmann::json j;
    j["limits"] = {{"host_read_gbps_1_thread", read_gbps}};
    for (const Row& r : rows) {
      j["results"].push_back({{"context", r.context},
                              {"kv_gib", r.gib},
                              {"ms", r.ms},
                              {"ms_min", r.ms_min},
                              {"ms_max", r.ms_max},
                              {"gbps", r.gbps}});
    }
    std::ofstream(json_path) << j.dump(2) << "\n";
  }
  return 0;
}

}  // namespace
}  // namespace fluxion::decode

int main(int argc, char** argv) { return fluxion::decode::Main(argc, argv); }

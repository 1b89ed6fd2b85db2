// `fluxion bench landing`: how long LandPrompt (decode/serving/generate_call_steps.h) takes to land
// a prompt that a prefill node wrote, at Llama-3.1-8B KV shapes (32 layers, 8 KV heads, head_dim
// 128, 16-token pages), against one read of the context at this machine's measured read
// bandwidth (the physical limit of any landing that reads the pages once).
//
// Measurement tool, not a test: the pages hold random bf16 keys and values, filled once; each
// repetition reserves them again, writes what the prefill node would have sent (checksums, and
// with --meta shipped the per-page metadata in its room), and times LandPrompt alone
// (verification, adoption, policy setup) until the attention exists. --meta recompute is a
// prefill node that ships no metadata (older ones): the decode node computes it in the same pass.
// --cpu-threads: the pool the layers are verified on (1: the calling thread alone).
#include "bench/landing_bench.h"

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
#include "decode/kv/paged_kv.h"
#include "decode/serving/generate_call_steps.h"
#include "nlohmann/json.hpp"
#include "transfer/crc32c.h"
#include "transfer/page_meta.h"

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
  std::string meta;
  int64_t threads = 1;
  int64_t context = 0;
  double gib = 0, ms = 0, ms_min = 0, ms_max = 0, gbps = 0;
};

// An arena for every page of a `max_context` prompt (and its metadata room), filled with random
// finite bf16 keys and values (slices of a 4 Mi-value pool: drawing GiBs is slow).
absl::StatusOr<std::unique_ptr<KvArena>> FilledArena(const KvShape& kv_shape,
                                                     const model::AttentionShape& shape,
                                                     int64_t max_context) {
  const int64_t max_pages =
      shape.num_layers * shape.num_kv_heads * ((max_context + kPageTokens - 1) / kPageTokens);
  absl::StatusOr<std::unique_ptr<KvArena>> arena =
      KvArena::Create(kv_shape.page_bytes(), max_pages + max_pages / 16 + 64,
                      {/*huge_pages=*/false});
  if (!arena.ok()) return arena.status();
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<bf16> pool(size_t{1} << 22);
  for (bf16& x : pool) x = FloatToBf16(normal(rng));
  const size_t per_page = kv_shape.page_bytes() / sizeof(bf16);
  for (int64_t p = 0; p < (*arena)->num_pages(); ++p) {
    const size_t at = (static_cast<size_t>(p) * 7919) % (pool.size() - per_page);
    std::memcpy((*arena)->page(static_cast<int32_t>(p)), pool.data() + at, kv_shape.page_bytes());
  }
  return arena;
}

// What the prefill node sends for the pages of `kv`: CRC-32C per layer over the content bytes in
// page order, and (shipped) each layer's metadata block, written into `room`, with its CRC-32C.
v1::PrefillResponse Send(KvArena& arena, const model::AttentionShape& shape, int64_t context,
                         const Reservation& kv, const Reservation& room, bool shipped) {
  const transfer::KvPageGeometry geo{shape.num_layers, shape.num_kv_heads, shape.head_dim,
                                     kPageTokens};
  const std::vector<int32_t> ids = PageIds(kv);
  const int64_t page_bytes = arena.page_bytes();
  v1::PrefillResponse landed;
  landed.set_node_name("bench");
  const int64_t per_layer = static_cast<int64_t>(ids.size()) / shape.num_layers;
  const uint64_t block = transfer::PageMetaLayerBytes(geo, context);
  std::vector<uint8_t> layer_pages(per_layer * page_bytes);
  std::vector<uint8_t> meta(transfer::PageMetaBytes(geo, context));
  for (int64_t layer = 0; layer < shape.num_layers; ++layer) {
    for (int64_t i = 0; i < per_layer; ++i) {
      std::memcpy(layer_pages.data() + i * page_bytes, arena.page(ids[layer * per_layer + i]),
                  page_bytes);
    }
    landed.add_layer_checksums(transfer::Crc32c(layer_pages.data(), layer_pages.size()));
    if (!shipped) continue;
    transfer::EncodeLayerPageMeta(geo, context, layer_pages.data(), meta.data() + layer * block);
    landed.mutable_page_meta()->add_layer_checksums(
        transfer::Crc32c(meta.data() + layer * block, block));
  }
  if (shipped) {
    uint64_t at = 0;
    for (const PageRun& r : room.runs()) {
      const uint64_t n =
          std::min<uint64_t>(meta.size() - at, static_cast<uint64_t>(r.count) * page_bytes);
      std::memcpy(arena.page(r.first), meta.data() + at, n);
      at += n;
    }
    landed.mutable_page_meta()->set_format_version(transfer::kPageMetaVersion);
    landed.mutable_page_meta()->set_bytes_written(meta.size());
  }
  return landed;
}

// One row: `reps` timed landings (after one untimed) of a `context`-token prompt.
absl::StatusOr<Row> TimeLanding(KvArena& arena, KvAdmission& admission,
                                const model::AttentionShape& shape, int64_t context, bool shipped,
                                const kernels::cpu::CpuPool& pool, int64_t reps) {
  const KvShape kv_shape{shape.num_layers, shape.num_kv_heads, shape.head_dim, kPageTokens};
  const int64_t pages =
      shape.num_layers * shape.num_kv_heads * ((context + kPageTokens - 1) / kPageTokens);
  const int64_t meta_pages = PageMetaRoomPages(shape, kPageTokens, context, arena.page_bytes());
  const sparse::PolicyConfig policy = *sparse::ParsePolicy("full", 1.0);
  std::vector<double> ms;
  for (int64_t rep = 0; rep <= reps; ++rep) {
    absl::StatusOr<Reservation> kv = admission.Reserve(
        pages + meta_pages, absl::Now() + absl::Seconds(10), [] { return false; });
    if (!kv.ok()) return kv.status();
    absl::StatusOr<Reservation> room = kv->SplitAfter(pages);
    if (!room.ok()) return room.status();
    const v1::PrefillResponse landed = Send(arena, shape, context, *kv, *room, shipped);
    LandingInput in;
    in.arena = &arena;
    in.shape = shape;
    in.page_tokens = kPageTokens;
    in.prompt_tokens = context;
    in.landed = &landed;
    in.policy = &policy;
    in.meta_pages = meta_pages;
    in.pool = &pool;
    bool checksum_failed = false;
    const absl::Time start = absl::Now();
    absl::StatusOr<std::unique_ptr<SparseAttention>> attention =
        LandPrompt(in, std::move(*kv), std::move(*room), &checksum_failed);
    const double elapsed = absl::ToDoubleMilliseconds(absl::Now() - start);
    if (!attention.ok()) return attention.status();
    if (rep > 0) ms.push_back(elapsed);
  }
  std::sort(ms.begin(), ms.end());
  Row row;
  row.meta = shipped ? "shipped" : "recompute";
  row.threads = pool.threads();
  row.context = context;
  row.gib = static_cast<double>(pages) * kv_shape.page_bytes() / (1 << 30);
  row.ms = ms[ms.size() / 2];
  row.ms_min = ms.front();
  row.ms_max = ms.back();
  row.gbps = static_cast<double>(pages) * kv_shape.page_bytes() / (row.ms * 1e6);
  return row;
}

void Report(const std::vector<Row>& rows, int64_t reps, double read_gbps,
            const std::string& json_path) {
  std::printf("%-10s %7s %8s %8s %10s %10s %10s %12s %14s\n", "meta", "threads", "context",
              "KV GiB", "ms", "min", "max", "KV GB/s", "one read, ms");
  for (const Row& r : rows) {
    std::printf("%-10s %7lld %8lld %8.2f %10.1f %10.1f %10.1f %12.2f %14.1f\n", r.meta.c_str(),
                static_cast<long long>(r.threads), static_cast<long long>(r.context), r.gib, r.ms,
                r.ms_min, r.ms_max, r.gbps, r.gib * (1 << 30) / (read_gbps * 1e6));
  }
  std::printf("# Llama-3.1-8B KV shapes, policy full, median of %lld; read probe %.2f GB/s "
              "(1 thread)\n",
              static_cast<long long>(reps), read_gbps);
  if (json_path.empty()) return;
  nlohmann::json j;
  j["limits"] = {{"host_read_gbps_1_thread", read_gbps}};
  for (const Row& r : rows) {
    j["results"].push_back({{"meta", r.meta},
                            {"threads", r.threads},
                            {"context", r.context},
                            {"kv_gib", r.gib},
                            {"ms", r.ms},
                            {"ms_min", r.ms_min},
                            {"ms_max", r.ms_max},
                            {"gbps", r.gbps}});
  }
  std::ofstream(json_path) << j.dump(2) << "\n";
}

int Main(const std::vector<std::string>& args) {
  std::vector<int64_t> contexts = {2048, 8192, 16384};
  int64_t reps = 5;
  std::string json_path;
  FlagSet flags("fluxion bench landing",
                "Time LandPrompt (verify + adopt a landed prompt) at Llama-3.1-8B KV shapes.");
  flags.IntList("contexts", &contexts, "prompt lengths in tokens");
  std::vector<std::string> metas = {"shipped", "recompute"};
  std::vector<int64_t> threads = {1, 2};
  flags.StringList("meta", &metas,
                   "shipped (the prefill node sends the page metadata) and/or recompute (it "
                   "sends none: an older prefill node)");
  flags.IntList("cpu-threads", &threads, "pool sizes to verify the layers on");
  flags.Int("reps", &reps, "timed repetitions per context (after one untimed)");
  flags.String("json", &json_path, "also write the results here (docs/BENCHMARKS.md format)");
  if (absl::Status s = flags.Parse(args); !s.ok() || flags.help_requested()) {
    std::fprintf(stderr, "%s\n%s", s.ToString().c_str(), flags.Usage().c_str());
    return s.ok() ? 0 : 2;
  }
  auto positive = [](const std::vector<int64_t>& v) {
    return !v.empty() && *std::min_element(v.begin(), v.end()) >= 1;
  };
  if (reps < 1 || !positive(contexts) || !positive(threads) || metas.empty()) {
    std::fprintf(stderr,
                 "--reps, every --contexts and --cpu-threads value must be >= 1, and --meta "
                 "non-empty\n");
    return 2;
  }
  for (const std::string& meta_mode : metas) {
    if (meta_mode != "shipped" && meta_mode != "recompute") {
      std::fprintf(stderr, "--meta takes shipped or recompute, not %s\n", meta_mode.c_str());
      return 2;
    }
  }
  const model::AttentionShape shape = Llama8bShape();
  const KvShape kv_shape{shape.num_layers, shape.num_kv_heads, shape.head_dim, kPageTokens};
  absl::StatusOr<std::unique_ptr<KvArena>> arena =
      FilledArena(kv_shape, shape, *std::max_element(contexts.begin(), contexts.end()));
  if (!arena.ok()) {
    std::fprintf(stderr, "arena: %s\n", arena.status().ToString().c_str());
    return 1;
  }
  KvAdmissionOptions ao;
  ao.release_thread = false;
  KvAdmission admission(arena->get(), ao);
  const double read_gbps = common::MeasureReadBandwidthGbps(size_t{1} << 30, 1);
  std::vector<Row> rows;
  for (const std::string& meta_mode : metas) {
    for (int64_t nthreads : threads) {
      const kernels::cpu::CpuPool pool(static_cast<int>(nthreads));
      for (int64_t context : contexts) {
        absl::StatusOr<Row> row = TimeLanding(**arena, admission, shape, context,
                                              meta_mode == "shipped", pool, reps);
        if (!row.ok()) {
          std::fprintf(stderr, "landing: %s\n", row.status().ToString().c_str());
          return 1;
        }
        rows.push_back(*row);
      }
    }
  }
  Report(rows, reps, read_gbps, json_path);
  return 0;
}

}  // namespace
}  // namespace fluxion::decode

namespace fluxion::bench {

int RunLandingBench(const std::vector<std::string>& args) { return decode::Main(args); }

}  // namespace fluxion::bench

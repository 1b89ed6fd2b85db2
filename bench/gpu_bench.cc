#include "bench/gpu_bench.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <chrono>
#include <cstring>
#include <functional>
#include <iostream>
#include <memory>
#include <random>

#include "absl/strings/str_cat.h"
#include "bench/bench_util.h"
#include "bench/cuda_bench_util.h"
#include "common/cpu_threads.h"
#include "common/flag_set.h"
#include "common/half.h"
#include "common/status_macros.h"
#include "kernels/cpu/process_cpu.h"
#include "kernels/attention_backend.h"
#include "kernels/cuda/attention_backend_cuda.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/decode_ops.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/paged_decode.h"
#include "kernels/cuda/sampling.h"
#include "model/cuda_dense_ops.h"
#include "model/layer.h"
#include "model/rope.h"

namespace fluxion::bench {
namespace {

using kernels::PageSpan;
namespace cuda = kernels::cuda;

// Llama-3.1-8B: hidden 4096, 32 layers, 32 query / 8 KV heads of 128, MLP 14336, vocab 128256.
constexpr int64_t kHidden = 4096, kLayers = 32, kKvHeads = 8, kGroup = 4, kHeadDim = 128;
constexpr int64_t kFfn = 14336, kVocab = 128256, kPageTokens = 16;
constexpr int64_t kPageBytes = 2 * kPageTokens * kHeadDim * 2;  // the pinned probe's unit
constexpr int64_t PageBytes(int64_t page_tokens) { return 2 * page_tokens * kHeadDim * 2; }

struct Options {
  std::vector<int64_t> batches = {1, 4, 16};
  std::vector<int64_t> contexts = {32768, 65536, 131072};
  std::vector<double> fractions = {0.05, 0.02};
  int64_t chunk_rows = 0, span_tokens = 32, repeats = 20;  // chunk_rows 0: ChoosePagedChunkRows
  double host_gib = 8.0;
  bool dense_step = true;
  std::vector<int64_t> page_tokens = {16};
  std::vector<std::string> paged_kernels = {"v3", "v5"};
};

// One launch plan: items (B x KV heads), each split into chunks of spans, and the merge.
struct AttentionPlan {
  std::vector<PageSpan> spans;
  std::vector<cuda::PagedItem> chunks;
  std::vector<int32_t> chunk_begin;  // per item
  PageSpan* d_spans = nullptr;
  cuda::PagedItem* d_chunks = nullptr;
  int32_t* d_chunk_begin = nullptr;
  float *d_chunk_out = nullptr, *d_chunk_lse = nullptr, *d_out = nullptr, *d_lse = nullptr;
  int64_t items = 0, rows = 0, chunk_rows = 0, page_tokens = kPageTokens;
  cuda::PagedKernel kernel = cuda::PagedKernel::kV5;
};

// Items of `rows_per_item` rows each: dense (every page of a contiguous range, full attention) or
// random spans of `span_tokens` over `arena_pages` pages (a sparse selection), pages of
// `page_tokens` tokens, chunked for `kernel`.
absl::Status BuildPlan(DeviceMemory& mem, int64_t items, int64_t rows_per_item, bool dense,
                       int64_t span_tokens, int64_t page_tokens, cuda::PagedKernel kernel,
                       int64_t arena_pages, int64_t chunk_rows, int num_sms, const float* d_q,
                       AttentionPlan* plan, std::mt19937_64& rng) {
  *plan = AttentionPlan{};
  plan->items = items;
  plan->page_tokens = page_tokens;
  plan->kernel = kernel;
  std::vector<int32_t> item_spans = {0};
  const int64_t span_pages = std::max<int64_t>(1, span_tokens / page_tokens);
  std::uniform_int_distribution<int64_t> pick(0, arena_pages / span_pages - 1);
  for (int64_t i = 0; i < items; ++i) {
    const int64_t pages = (rows_per_item + page_tokens - 1) / page_tokens;
    for (int64_t p = 0; p < pages; p += (dense ? 1 : span_pages)) {
      const int64_t first = dense ? i * pages + p : pick(rng) * span_pages;
      for (int64_t k = 0; k < (dense ? 1 : span_pages) && p + k < pages; ++k) {
        plan->spans.push_back(
            {static_cast<int32_t>(first + k), 0, static_cast<int32_t>(page_tokens)});
      }
    }
    item_spans.push_back(plan->spans.size());
  }
  plan->rows = static_cast<int64_t>(plan->spans.size()) * page_tokens;
  if (chunk_rows == 0) chunk_rows = cuda::ChoosePagedChunkRows(kernel, plan->rows, items, num_sms);
  plan->chunk_rows = chunk_rows;
  int64_t chunk_count = 0;
  plan->chunk_begin.push_back(0);
  std::vector<std::vector<int32_t>> bounds(items);
  for (int64_t i = 0; i < items; ++i) {
    bounds[i] = cuda::SplitByRows(plan->spans.data(), item_spans[i], item_spans[i + 1], chunk_rows);
    chunk_count += bounds[i].size() - 1;
    plan->chunk_begin.push_back(chunk_count);
  }
  auto alloc = [&mem](size_t bytes) -> absl::StatusOr<void*> { return mem.Get(bytes); };
  FLUXION_ASSIGN_OR_RETURN(void* co, alloc(chunk_count * kGroup * kHeadDim * sizeof(float)));
  FLUXION_ASSIGN_OR_RETURN(void* cl, alloc(chunk_count * kGroup * sizeof(float)));
  FLUXION_ASSIGN_OR_RETURN(void* o, alloc(items * kGroup * kHeadDim * sizeof(float)));
  FLUXION_ASSIGN_OR_RETURN(void* l, alloc(items * kGroup * sizeof(float)));
  plan->d_chunk_out = static_cast<float*>(co);
  plan->d_chunk_lse = static_cast<float*>(cl);
  plan->d_out = static_cast<float*>(o);
  plan->d_lse = static_cast<float*>(l);
  int64_t c = 0;
  for (int64_t i = 0; i < items; ++i) {
    for (size_t b = 0; b + 1 < bounds[i].size(); ++b, ++c) {
      plan->chunks.push_back({d_q + i * kGroup * kHeadDim, bounds[i][b], bounds[i][b + 1],
                              plan->d_chunk_out + c * kGroup * kHeadDim,
                              plan->d_chunk_lse + c * kGroup});
    }
  }
  FLUXION_ASSIGN_OR_RETURN(void* ds, alloc(std::max<size_t>(1, plan->spans.size()) * sizeof(PageSpan)));
  FLUXION_ASSIGN_OR_RETURN(void* dc, alloc(std::max<size_t>(1, plan->chunks.size()) *
                                           sizeof(cuda::PagedItem)));
  FLUXION_ASSIGN_OR_RETURN(void* db, alloc(plan->chunk_begin.size() * sizeof(int32_t)));
  plan->d_spans = static_cast<PageSpan*>(ds);
  plan->d_chunks = static_cast<cuda::PagedItem*>(dc);
  plan->d_chunk_begin = static_cast<int32_t*>(db);
  BENCH_CUDA(cudaMemcpy(ds, plan->spans.data(), plan->spans.size() * sizeof(PageSpan),
                        cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(dc, plan->chunks.data(), plan->chunks.size() * sizeof(cuda::PagedItem),
                        cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(db, plan->chunk_begin.data(), plan->chunk_begin.size() * sizeof(int32_t),
                        cudaMemcpyHostToDevice));
  return absl::OkStatus();
}

absl::Status RunPlan(const AttentionPlan& plan, const uint8_t* arena, cudaStream_t stream) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  BENCH_CUDA(cuda::PagedDecodeAttention(arena, PageBytes(plan.page_tokens), plan.page_tokens,
                                        kHeadDim, plan.d_spans, plan.d_chunks, plan.chunks.size(),
                                        kGroup, scale, stream, plan.kernel));
  BENCH_CUDA(cuda::MergeChunks(plan.d_chunk_out, plan.d_chunk_lse, plan.d_chunk_begin, plan.items,
                               kGroup, kHeadDim, plan.d_out, plan.d_lse, stream));
  return absl::OkStatus();
}

// Full attention over `pages` of `items` x ceil(ctx / page_tokens) whole pages, through
// CudaAttentionBackend (the device-side chunk plan + the paged kernel + MergeChunks): what the step
// executor pays, next to RunPlan's host-planned launch.
absl::StatusOr<Stats> TimeBackend(cuda::PagedKernel kernel, int64_t items, int64_t ctx,
                                  int64_t page_tokens, const uint8_t* arena, const float* d_q,
                                  int num_sms, int64_t repeats, cudaStream_t stream) {
  DeviceMemory mem;
  const int64_t pages = (ctx + page_tokens - 1) / page_tokens;
  std::vector<PageSpan> spans;
  std::vector<int64_t> indptr = {0};
  for (int64_t i = 0; i < items; ++i) {
    for (int64_t k = 0; k < pages; ++k) {
      spans.push_back({static_cast<int32_t>(i * pages + k), 0, static_cast<int32_t>(page_tokens)});
    }
    indptr.push_back(static_cast<int64_t>(spans.size()));
  }
  FLUXION_ASSIGN_OR_RETURN(void* ds, mem.Get(spans.size() * sizeof(PageSpan)));
  FLUXION_ASSIGN_OR_RETURN(void* di, mem.Get(indptr.size() * sizeof(int64_t)));
  FLUXION_ASSIGN_OR_RETURN(void* out, mem.Get(items * kGroup * kHeadDim * sizeof(float)));
  FLUXION_ASSIGN_OR_RETURN(void* lse, mem.Get(items * kGroup * sizeof(float)));
  BENCH_CUDA(cudaMemcpy(ds, spans.data(), spans.size() * sizeof(PageSpan),
                        cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(di, indptr.data(), indptr.size() * sizeof(int64_t),
                        cudaMemcpyHostToDevice));
  kernels::PagedDecodeProblem p;
  p.q = d_q;
  p.kv = {arena, static_cast<size_t>(PageBytes(page_tokens)), page_tokens, kHeadDim};
  p.span_indptr = static_cast<const int64_t*>(di);
  p.spans = static_cast<const PageSpan*>(ds);
  p.num_spans = static_cast<int64_t>(spans.size());
  p.out = static_cast<float*>(out);
  p.lse = static_cast<float*>(lse);
  p.num_requests = items / kKvHeads;
  p.num_qo_heads = kKvHeads * kGroup;
  p.num_kv_heads = kKvHeads;
  p.head_dim = kHeadDim;
  p.sm_scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<cuda::CudaAttentionBackend> backend,
                           cuda::CudaAttentionBackend::Create({stream, kernel, num_sms}));
  FLUXION_RETURN_IF_ERROR(backend->Supports(p));
  const size_t ws_bytes = backend->WorkspaceBytes(p);
  FLUXION_ASSIGN_OR_RETURN(void* ws, mem.Get(std::max<size_t>(1, ws_bytes)));
  const absl::Span<std::byte> workspace(static_cast<std::byte*>(ws), ws_bytes);
  return TimeMs(stream, repeats, [&] { return backend->Run(p, workspace); });
}

void Row(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void Row(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::vprintf(fmt, ap);
  va_end(ap);
  std::fflush(stdout);
}

// The bandwidth probes every row is compared with, and the pinned, mapped host memory the
// zero-copy rows read.
struct Probes {
  double hbm_gbps = 0, h2d_gbps = 0;
  std::unique_ptr<void, void (*)(void*)> host{nullptr, [](void* p) { cudaFreeHost(p); }};
  size_t host_bytes = 0;
};

absl::Status MeasureProbes(const Options& o, cudaStream_t stream, DeviceMemory& mem,
                           nlohmann::json* limits, Probes* probes) {
  // Probes: HBM device-to-device copy (bytes read + written) and pinned host-to-device copy.
  double hbm_gbps = 0;
  {
    DeviceMemory copy_buffers;  // freed before the rest of the bench allocates
    FLUXION_ASSIGN_OR_RETURN(hbm_gbps, HbmCopyGbps(copy_buffers, stream, o.repeats));
  }
  probes->hbm_gbps = hbm_gbps;
  const size_t probe_bytes = size_t{2} << 30;  // the host-to-device probe's copy
  FLUXION_ASSIGN_OR_RETURN(void* a, mem.Get(probe_bytes));
  const size_t host_bytes = static_cast<size_t>(o.host_gib * (1ull << 30)) / kPageBytes * kPageBytes;
  void* host = nullptr;
  BENCH_CUDA(cudaHostAlloc(&host, host_bytes, cudaHostAllocMapped));
  probes->host.reset(host);
  probes->host_bytes = host_bytes;
  std::memset(host, 0x3c, host_bytes);  // finite bf16 values, every page touched
  FLUXION_ASSIGN_OR_RETURN(Stats h2d, TimeMs(stream, o.repeats, [&] {
    return CudaCheck(cudaMemcpyAsync(a, host, std::min(probe_bytes, host_bytes),
                                 cudaMemcpyHostToDevice, stream), "h2d");
  }));
  const double h2d_gbps = probes->h2d_gbps = std::min(probe_bytes, host_bytes) / (h2d.median * 1e-3) / 1e9;
  *limits = {{"hbm_copy_gbps_read_plus_write", hbm_gbps}, {"pinned_h2d_gbps", h2d_gbps}};
  Row("probes: HBM copy %.0f GB/s (bytes read + written), pinned host->device copy %.1f GB/s\n"
      "(%% HBM and %% limit below: GB/s read over these probes)\n\n",
      hbm_gbps, h2d_gbps);
  return absl::OkStatus();
}

absl::Status TimeGemms(const Options& o, cudaStream_t stream, DeviceMemory& mem,
                       double hbm_gbps, nlohmann::json* results) {
  const int64_t max_m = *std::max_element(o.batches.begin(), o.batches.end());
  // GEMMs at 8B shapes: weights bf16 [n][k], activations bf16 [m][k], output fp32.
  FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<cuda::Gemm> gemm, cuda::Gemm::Create(stream));
  struct Matrix { const char* name; int64_t n, k, per_step; };
  const Matrix matrices[] = {{"qkv", (kKvHeads * kGroup + 2 * kKvHeads) * kHeadDim, kHidden, kLayers},
                             {"o", kHidden, kKvHeads * kGroup * kHeadDim, kLayers},
                             {"gate_up", 2 * kFfn, kHidden, kLayers},
                             {"down", kHidden, kFfn, kLayers},
                             {"lm_head", kVocab, kHidden, 1}};
  Row("%-8s %5s %10s %10s %8s\n", "gemm", "m", "ms", "GB/s", "% HBM");
  // Each matrix's weights, activations and output, allocated once for every batch size.
  struct Operands { void *w, *x, *y; };
  std::vector<Operands> operands;
  for (const Matrix& w : matrices) {
    Operands op;
    FLUXION_ASSIGN_OR_RETURN(op.w, mem.Get(w.n * w.k * 2));
    FLUXION_ASSIGN_OR_RETURN(op.x, mem.Get(max_m * w.k * 2));
    FLUXION_ASSIGN_OR_RETURN(op.y, mem.Get(max_m * w.n * 4));
    BENCH_CUDA(cudaMemsetAsync(op.w, 0x3c, w.n * w.k * 2, stream));
    BENCH_CUDA(cudaMemsetAsync(op.x, 0x3c, max_m * w.k * 2, stream));
    operands.push_back(op);
  }
  for (int64_t m : o.batches) {
    double step_ms = 0, step_bytes = 0;
    for (size_t i = 0; i < std::size(matrices); ++i) {
      const Matrix& w = matrices[i];
      void *dw = operands[i].w, *dx = operands[i].x, *dy = operands[i].y;
      FLUXION_ASSIGN_OR_RETURN(Stats t, TimeMs(stream, o.repeats, [&] {
        return gemm->MatMulBf16(static_cast<bf16*>(dx), static_cast<bf16*>(dw),
                                static_cast<float*>(dy), m, w.n, w.k);
      }));
      const double bytes = 2.0 * w.n * w.k;
      const double gbps = bytes / (t.median * 1e-3) / 1e9;
      Row("%-8s %5ld %10.4f %10.0f %7.0f%%\n", w.name, m, t.median, gbps, 100 * gbps / hbm_gbps);
      step_ms += t.median * w.per_step;
      step_bytes += bytes * w.per_step;
      results->push_back({{"kind", "gemm"}, {"matrix", w.name}, {"m", m}, {"n", w.n}, {"k", w.k},
                          {"ms", t.median}, {"p10_ms", t.p10}, {"p90_ms", t.p90}, {"gbps", gbps}});
    }
    Row("%-8s %5ld %10.3f %10.0f   (dense GEMMs of one whole step: 32 layers + lm_head)\n",
        "step", m, step_ms, step_bytes / (step_ms * 1e-3) / 1e9);
    results->push_back({{"kind", "gemm_step"}, {"m", m}, {"ms", step_ms},
                        {"weight_gib", step_bytes / (1 << 30)}});
  }
  return absl::OkStatus();
}

absl::Status TimeSampling(const Options& o, cudaStream_t stream, DeviceMemory& mem,
                          std::mt19937_64& rng, nlohmann::json* results) {
  const int64_t max_m = *std::max_element(o.batches.begin(), o.batches.end());
  // Sampling's device half: the candidate kernel over the LM head's logits [B][128256] against
  // the D2H copy of those logits it replaces (into pageable memory, as the step did, and pinned).
  Row("\n%-10s %5s %6s %12s %12s %12s\n", "sampling", "B", "k", "cand ms", "D2H pageable",
      "D2H pinned");
  std::vector<float> host_logits(max_m * kVocab);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (float& v : host_logits) v = normal(rng);
  FLUXION_ASSIGN_OR_RETURN(void* d_logits, mem.Get(host_logits.size() * sizeof(float)));
  BENCH_CUDA(cudaMemcpy(d_logits, host_logits.data(), host_logits.size() * sizeof(float),
                        cudaMemcpyHostToDevice));
  FLUXION_ASSIGN_OR_RETURN(void* d_temps, mem.Get(max_m * sizeof(double)));
  FLUXION_ASSIGN_OR_RETURN(void* d_norms, mem.Get(max_m * sizeof(double)));
  FLUXION_ASSIGN_OR_RETURN(void* d_ids, mem.Get(max_m * cuda::kMaxTopCandidates * 4));
  FLUXION_ASSIGN_OR_RETURN(void* d_values, mem.Get(max_m * cuda::kMaxTopCandidates * 4));
  const std::vector<double> temps(max_m, 0.8);
  BENCH_CUDA(cudaMemcpy(d_temps, temps.data(), max_m * sizeof(double), cudaMemcpyHostToDevice));
  void* pinned_logits = nullptr;
  BENCH_CUDA(cudaMallocHost(&pinned_logits, host_logits.size() * sizeof(float)));
  std::unique_ptr<void, void (*)(void*)> pinned_owner(pinned_logits,
                                                      [](void* p) { cudaFreeHost(p); });
  for (int64_t m : o.batches) {
    const size_t bytes = m * kVocab * sizeof(float);
    FLUXION_ASSIGN_OR_RETURN(Stats pageable, TimeMs(stream, o.repeats, [&] {
      return CudaCheck(cudaMemcpyAsync(host_logits.data(), d_logits, bytes, cudaMemcpyDeviceToHost,
                                   stream), "d2h pageable");
    }));
    FLUXION_ASSIGN_OR_RETURN(Stats pinned, TimeMs(stream, o.repeats, [&] {
      return CudaCheck(cudaMemcpyAsync(pinned_logits, d_logits, bytes, cudaMemcpyDeviceToHost,
                                   stream), "d2h pinned");
    }));
    for (int64_t k : {int64_t{1}, int64_t{50}, cuda::kMaxTopCandidates}) {
      FLUXION_ASSIGN_OR_RETURN(Stats t, TimeMs(stream, o.repeats, [&] {
        return CudaCheck(cuda::TopCandidates(static_cast<const float*>(d_logits), m, kVocab, k,
                                         static_cast<const double*>(d_temps),
                                         static_cast<int32_t*>(d_ids),
                                         static_cast<float*>(d_values),
                                         static_cast<double*>(d_norms), stream),
                     "TopCandidates");
      }));
      Row("%-10s %5ld %6ld %12.4f %12.4f %12.4f\n", "sampling", m, k, t.median,
          pageable.median, pinned.median);
      results->push_back({{"kind", "sampling_candidates"}, {"batch", m}, {"vocab", kVocab},
                          {"k", k}, {"ms", t.median}, {"p10_ms", t.p10}, {"p90_ms", t.p90},
                          {"full_d2h_pageable_ms", pageable.median},
                          {"full_d2h_pinned_ms", pinned.median}});
    }
  }
  return absl::OkStatus();
}

// What one (batch, context, page size) point of the attention rows shares.
struct AttentionPoint {
  int64_t batch, ctx, page_tokens;
};

// Dense over HBM: every kernel over the layer's KV in HBM, and the same pages through the
// attention seam; skipped when the layer's KV does not fit next to what is allocated.
absl::Status TimeHbmAttention(const Options& o, cudaStream_t stream, int num_sms,
                              const std::vector<cuda::PagedKernel>& kernels, float* dq,
                              const AttentionPoint& point, double hbm_gbps, std::mt19937_64& rng,
                              nlohmann::json* results) {
  const int64_t batch = point.batch, ctx = point.ctx, page_tokens = point.page_tokens;
  const int64_t page_bytes = PageBytes(page_tokens);
  const int64_t items = batch * kKvHeads;
  const int64_t pages = items * ((ctx + page_tokens - 1) / page_tokens);
  size_t free_bytes = 0, total = 0;
  BENCH_CUDA(cudaMemGetInfo(&free_bytes, &total));
  void* arena = nullptr;
  if (static_cast<size_t>(pages) * page_bytes + (size_t{1} << 30) < free_bytes) {
    BENCH_CUDA(cudaMalloc(&arena, pages * page_bytes));
    BENCH_CUDA(cudaMemsetAsync(arena, 0x3c, pages * page_bytes, stream));
  } else {
    Row("%-30s %3ld %5ld %8ld %9s   skipped: %ld MiB of KV does not fit in free HBM\n",
        "full, KV in HBM", page_tokens, batch, ctx, "1", pages * page_bytes >> 20);
  }
  std::unique_ptr<void, void (*)(void*)> arena_owner(arena, [](void* p) { cudaFree(p); });
  for (cuda::PagedKernel kernel : kernels) {
    if (arena == nullptr) break;
    if (kernel == cuda::PagedKernel::kV3 && page_tokens > 32) continue;  // v3: 8/16/32
    AttentionPlan plan;
    DeviceMemory plan_mem;
    FLUXION_RETURN_IF_ERROR(BuildPlan(plan_mem, items, ctx, /*dense=*/true, o.span_tokens,
                                      page_tokens, kernel, pages, o.chunk_rows, num_sms,
                                      static_cast<float*>(dq), &plan, rng));
    FLUXION_ASSIGN_OR_RETURN(Stats t, TimeMs(stream, o.repeats, [&] {
                               return RunPlan(plan, static_cast<uint8_t*>(arena), stream);
                             }));
    const double bytes = static_cast<double>(plan.rows) * kHeadDim * 2 * 2;
    const double gbps = bytes / (t.median * 1e-3) / 1e9;
    const std::string label =
        absl::StrCat("full, KV in HBM, ", cuda::PagedKernelName(kernel));
    Row("%-30s %3ld %5ld %8ld %9s %10.4f %9.0f %7.0f%% %7zu\n", label.c_str(),
        page_tokens, batch, ctx, "1", t.median, gbps, 100 * gbps / hbm_gbps,
        plan.chunks.size());
    results->push_back({{"kind", "attention_hbm_full"},
                        {"kernel", cuda::PagedKernelName(kernel)},
                        {"page_tokens", page_tokens},
                        {"batch", batch},
                        {"context", ctx},
                        {"ms", t.median},
                        {"p10_ms", t.p10},
                        {"p90_ms", t.p90},
                        {"gbps", gbps},
                        {"ratio_to_hbm_copy", gbps / hbm_gbps},
                        {"chunks", plan.chunks.size()},
                        {"chunk_rows", plan.chunk_rows}});
    // The same pages through the attention seam (device-planned chunks).
    FLUXION_ASSIGN_OR_RETURN(
        Stats tb,
        TimeBackend(kernel, items, ctx, page_tokens, static_cast<uint8_t*>(arena),
                    static_cast<float*>(dq), num_sms, o.repeats, stream));
    const double backend_gbps = bytes / (tb.median * 1e-3) / 1e9;
    const std::string backend_label =
        absl::StrCat("  same via backend, ", cuda::PagedKernelName(kernel));
    Row("%-30s %3ld %5ld %8ld %9s %10.4f %9.0f %7.0f%%\n", backend_label.c_str(),
        page_tokens, batch, ctx, "1", tb.median, backend_gbps,
        100 * backend_gbps / hbm_gbps);
    results->push_back({{"kind", "attention_hbm_full_backend"},
                        {"kernel", cuda::PagedKernelName(kernel)},
                        {"page_tokens", page_tokens},
                        {"batch", batch},
                        {"context", ctx},
                        {"ms", tb.median},
                        {"p10_ms", tb.p10},
                        {"p90_ms", tb.p90},
                        {"gbps", backend_gbps},
                        {"ratio_to_hbm_copy", backend_gbps / hbm_gbps}});
  }
  return absl::OkStatus();
}

// Sparse selection read straight from pinned host memory, at each --fractions share.
absl::Status TimeZeroCopyAttention(const Options& o, cudaStream_t stream, int num_sms,
                                   const std::vector<cuda::PagedKernel>& kernels, float* dq,
                                   const AttentionPoint& point, const Probes& probes,
                                   std::mt19937_64& rng, nlohmann::json* results) {
  const int64_t batch = point.batch, ctx = point.ctx, page_tokens = point.page_tokens;
  const int64_t page_bytes = PageBytes(page_tokens);
  const int64_t items = batch * kKvHeads;
  void* host = probes.host.get();
  const size_t host_bytes = probes.host_bytes;
  const double h2d_gbps = probes.h2d_gbps;
  const int64_t host_pages = host_bytes / page_bytes;
  void* mapped = nullptr;
  BENCH_CUDA(cudaHostGetDevicePointer(&mapped, host, 0));
  const uint8_t* host_arena = static_cast<const uint8_t*>(mapped);
  for (double f : o.fractions) {
    for (cuda::PagedKernel kernel : kernels) {
      if (kernel == cuda::PagedKernel::kV3 && page_tokens > 32) continue;
      const int64_t rows = std::max<int64_t>(page_tokens, static_cast<int64_t>(f * ctx));
      AttentionPlan plan;
      DeviceMemory plan_mem;
      FLUXION_RETURN_IF_ERROR(BuildPlan(
          plan_mem, items, rows, /*dense=*/false, o.span_tokens, page_tokens, kernel,
          host_pages, o.chunk_rows, num_sms, static_cast<float*>(dq), &plan, rng));
      FLUXION_ASSIGN_OR_RETURN(Stats t, TimeMs(stream, o.repeats, [&] {
                                 return RunPlan(plan, host_arena, stream);
                               }));
      const double bytes = static_cast<double>(plan.rows) * kHeadDim * 2 * 2;
      const double gbps = bytes / (t.median * 1e-3) / 1e9;
      // A span is at least one page.
      const int64_t span_tokens = std::max(o.span_tokens, page_tokens);
      const std::string label = absl::StrCat("zero-copy host, ", span_tokens, "-tok, ",
                                             cuda::PagedKernelName(kernel));
      Row("%-30s %3ld %5ld %8ld %9.3f %10.4f %9.1f %7.0f%% %7zu\n", label.c_str(),
          page_tokens, batch, ctx, f, t.median, gbps, 100 * gbps / h2d_gbps,
          plan.chunks.size());
      results->push_back({{"kind", "attention_host_zero_copy"},
                          {"kernel", cuda::PagedKernelName(kernel)},
                          {"page_tokens", page_tokens},
                          {"batch", batch},
                          {"context", ctx},
                          {"read_fraction", f},
                          {"span_tokens", span_tokens},
                          {"ms", t.median},
                          {"p10_ms", t.p10},
                          {"p90_ms", t.p90},
                          {"gbps", gbps},
                          {"ratio_to_h2d_copy", gbps / h2d_gbps},
                          {"chunks", plan.chunks.size()},
                          {"chunk_rows", plan.chunk_rows}});
    }
  }
  return absl::OkStatus();
}

absl::Status Run(const Options& o, int num_sms, nlohmann::json* results,
                 nlohmann::json* limits) {
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreate(&stream));
  DeviceMemory mem;
  std::mt19937_64 rng(1);
  Probes probes;
  FLUXION_RETURN_IF_ERROR(MeasureProbes(o, stream, mem, limits, &probes));
  FLUXION_RETURN_IF_ERROR(TimeGemms(o, stream, mem, probes.hbm_gbps, results));
  FLUXION_RETURN_IF_ERROR(TimeSampling(o, stream, mem, rng, results));
  const int64_t max_m = *std::max_element(o.batches.begin(), o.batches.end());
  // Attention of one layer over every KV head of the batch, for each paged kernel and page size
  // (the same pages and plan shape for every kernel, so rows compare kernel against kernel).
  FLUXION_ASSIGN_OR_RETURN(void* dq, mem.Get(max_m * kKvHeads * kGroup * kHeadDim * 4));
  BENCH_CUDA(cudaMemsetAsync(dq, 0, max_m * kKvHeads * kGroup * kHeadDim * 4, stream));
  std::vector<cuda::PagedKernel> kernels;
  for (const std::string& k : o.paged_kernels) {
    cuda::PagedKernel kernel;
    if (!cuda::PagedKernelFromName(k, &kernel)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--paged-kernels: unknown kernel '", k, "' (v3, v5)"));
    }
    kernels.push_back(kernel);
  }
  Row("\n%-30s %3s %5s %8s %9s %10s %9s %8s %7s\n", "attention (one layer)", "P", "B", "context",
      "read", "ms", "GB/s", "% limit", "chunks");
  // Two passes: every HBM point first, then the zero-copy reads over PCIe, so that the HBM table is
  // complete even if a kernel fails on mapped host memory.
  for (int pass = 0; pass < 2; ++pass) {
    for (int64_t batch : o.batches) {
      for (int64_t ctx : o.contexts) {
        for (int64_t page_tokens : o.page_tokens) {
          const AttentionPoint point{batch, ctx, page_tokens};
          FLUXION_RETURN_IF_ERROR(
              pass == 0 ? TimeHbmAttention(o, stream, num_sms, kernels, static_cast<float*>(dq),
                                           point, probes.hbm_gbps, rng, results)
                        : TimeZeroCopyAttention(o, stream, num_sms, kernels,
                                                static_cast<float*>(dq), point, probes, rng,
                                                results));
        }
      }
    }
  }
  BENCH_CUDA(cudaStreamSynchronize(stream));
  cudaStreamDestroy(stream);
  return absl::OkStatus();
}

// Llama-3.1-8B as a ModelConfig (llama3 RoPE scaling), for the whole-model dense step.
model::ModelConfig Llama8bConfig() {
  model::ModelConfig c;
  c.vocab_size = kVocab;
  c.hidden_size = kHidden;
  c.intermediate_size = kFfn;
  c.num_layers = kLayers;
  c.num_heads = kKvHeads * kGroup;
  c.num_kv_heads = kKvHeads;
  c.head_dim = kHeadDim;
  c.rms_norm_eps = 1e-5;
  c.max_position_embeddings = 131072;
  c.rope = model::RopeConfig{model::RopeType::kLlama3, 500000.0, 8.0, 1.0, 4.0, 8192};
  return c;
}

// The weights of `c` made on the device through `ops` (16 GB of bf16 matrices for 8B: no host
// copy): matrices FillRandomBf16 with std 0.02, norm gains 1, no biases.
absl::StatusOr<model::ModelParams> RandomDeviceParams(model::DenseOps& ops,
                                                      const model::ModelConfig& c) {
  model::ModelParams p;
  uint64_t seed = 1;
  auto matrix = [&](int64_t rows, int64_t cols) -> absl::StatusOr<model::WeightRef> {
    FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<model::OpsBuffer> b,
                             ops.Allocate(static_cast<size_t>(rows * cols) * sizeof(bf16)));
    BENCH_CUDA(cuda::FillRandomBf16(static_cast<bf16*>(b->data()), rows * cols, seed++, 0.0f,
                                    0.02f, nullptr));
    const void* data = b->data();
    p.owned.push_back(std::move(b));
    return model::WeightRef{data, model::WeightDType::kBF16};
  };
  auto vector = [&](const std::vector<float>& host) -> absl::StatusOr<const float*> {
    FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<model::OpsBuffer> b,
                             ops.Allocate(host.size() * sizeof(float)));
    ops.CopyFromHost(b->data(), host.data(), host.size() * sizeof(float));
    const float* data = static_cast<const float*>(b->data());
    p.owned.push_back(std::move(b));
    return data;
  };
  auto linear = [&](int64_t out, int64_t in) -> absl::StatusOr<model::LinearParams> {
    model::LinearParams l;
    FLUXION_ASSIGN_OR_RETURN(l.weight, matrix(out, in));
    l.out = out;
    l.in = in;
    return l;
  };
  const int64_t h = c.hidden_size, q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
  const std::vector<float> ones(h, 1.0f);
  FLUXION_ASSIGN_OR_RETURN(p.embed, matrix(c.vocab_size, h));
  FLUXION_ASSIGN_OR_RETURN(p.lm_head, matrix(c.vocab_size, h));
  FLUXION_ASSIGN_OR_RETURN(p.final_norm, vector(ones));
  FLUXION_ASSIGN_OR_RETURN(p.inv_freq, vector(model::ComputeInvFreq(c.rope, c.head_dim)));
  for (int64_t l = 0; l < c.num_layers; ++l) {
    model::LayerParams lp;
    FLUXION_ASSIGN_OR_RETURN(lp.input_norm, vector(ones));
    FLUXION_ASSIGN_OR_RETURN(lp.post_attention_norm, vector(ones));
    FLUXION_ASSIGN_OR_RETURN(lp.q, linear(q, h));
    FLUXION_ASSIGN_OR_RETURN(lp.k, linear(kv, h));
    FLUXION_ASSIGN_OR_RETURN(lp.v, linear(kv, h));
    FLUXION_ASSIGN_OR_RETURN(lp.o, linear(h, q));
    FLUXION_ASSIGN_OR_RETURN(lp.gate, linear(c.intermediate_size, h));
    FLUXION_ASSIGN_OR_RETURN(lp.up, linear(c.intermediate_size, h));
    FLUXION_ASSIGN_OR_RETURN(lp.down, linear(h, c.intermediate_size));
    p.layers.push_back(lp);
  }
  BENCH_CUDA(cudaDeviceSynchronize());  // the fills ran on the default stream
  FLUXION_RETURN_IF_ERROR(ops.Sync());
  return p;
}

// The dense half of a whole decode step at 8B shapes through CudaDenseOps and model/layer.h, the
// code `fluxion generate --device cuda` runs: embed, 32 x (PreAttention, PostAttention), final
// norm + LM head; attention left out (the attention output buffer is held at zero). Timed on the
// host around the step and a Sync, so kernel-launch overhead counts: against the weight bytes a
// step reads and the HBM probe. The weights are stacked (FuseParams) so the layers run fused, as
// a DecodeStepRunner's do; "graph" rows replay the layers + LM head as one CUDA graph (embed and
// the Sync outside it).
absl::Status RunDenseStep(const Options& o, double hbm_gbps, nlohmann::json* results) {
  FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<model::DenseOps> ops, model::NewCudaDenseOps(0));
  const model::ModelConfig c = Llama8bConfig();
  FLUXION_ASSIGN_OR_RETURN(model::ModelParams params, RandomDeviceParams(*ops, c));
  FLUXION_RETURN_IF_ERROR(model::FuseParams(*ops, &params));
  const int64_t max_m = *std::max_element(o.batches.begin(), o.batches.end());
  FLUXION_ASSIGN_OR_RETURN(model::StepBuffers buf, model::StepBuffers::Create(*ops, c, max_m));
  FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<model::OpsBuffer> logits,
                           ops->Allocate(max_m * c.vocab_size * sizeof(float)));
  const int64_t q_row = c.num_heads * c.head_dim;
  const std::vector<float> zeros(max_m * q_row, 0.0f);
  ops->CopyFromHost(buf.attn, zeros.data(), zeros.size() * sizeof(float));
  const int64_t h = c.hidden_size, q = q_row, kv = c.num_kv_heads * c.head_dim;
  const double weight_bytes =
      2.0 * (c.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * c.intermediate_size) +
             c.vocab_size * h);
  Row("\n%-24s %5s %10s %10s %8s\n", "dense step (CudaDenseOps)", "B", "ms", "GB/s", "% HBM");
  for (int64_t m : o.batches) {
    std::vector<int32_t> tokens(m);
    std::vector<int64_t> positions(m);
    for (int64_t i = 0; i < m; ++i) {
      tokens[i] = static_cast<int32_t>((i * 7919) % c.vocab_size);
      positions[i] = 32768 + 1000 * i;
    }
    auto dense = [&]() -> absl::Status {
      auto attend = [](int, int64_t rows) -> absl::StatusOr<int64_t> { return rows; };
      FLUXION_RETURN_IF_ERROR(model::RunLayers(*ops, c, params, buf, m, attend).status());
      model::LmHead(*ops, params, c, buf, buf.x, m, static_cast<float*>(logits->data()));
      return absl::OkStatus();
    };
    std::unique_ptr<model::OpsGraph> graph;
    auto step = [&]() -> absl::Status {
      model::EmbedRows(*ops, params, c, buf, tokens.data(), positions.data(), m);
      if (graph != nullptr) {
        ops->graphs()->Replay(*graph);
      } else {
        FLUXION_RETURN_IF_ERROR(dense());
      }
      return ops->Sync();
    };
    for (const bool graphed : {false, true}) {
      if (graphed) {
        // Recorded after the eager runs above (the GEMM choices and scratch have settled).
        model::OpsGraphs* g = ops->graphs();
        if (g == nullptr) break;
        FLUXION_RETURN_IF_ERROR(g->BeginCapture());
        FLUXION_RETURN_IF_ERROR(dense());
        FLUXION_ASSIGN_OR_RETURN(graph, g->EndCapture());
      }
      std::vector<double> samples;
      for (int64_t r = 0; r < o.repeats + 2; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        FLUXION_RETURN_IF_ERROR(step());
        const double ms = std::chrono::duration<double, std::milli>(
                              std::chrono::steady_clock::now() - t0)
                              .count();
        if (r >= 2) samples.push_back(ms);
      }
      const Stats t = Summarize(samples);
      const double gbps = weight_bytes / (t.median * 1e-3) / 1e9;
      Row("%-24s %5ld %10.3f %10.0f %7.0f%%\n",
          graphed ? "fused, one graph" : "embed+32 layers+lm_head", m, t.median, gbps,
          100 * gbps / hbm_gbps);
      results->push_back({{"kind", graphed ? "dense_step_graph" : "dense_step"}, {"batch", m},
                          {"ms", t.median}, {"p10_ms", t.p10}, {"p90_ms", t.p90},
                          {"weight_gib", weight_bytes / (1 << 30)}, {"gbps", gbps}});
    }
    graph.reset();
  }
  return absl::OkStatus();
}

}  // namespace

int RunGpuBench(const std::vector<std::string>& args) {
  Options o;
  std::string json_path;
  FlagSet flags("fluxion bench gpu",
                "Times the decode step's GPU kernels at Llama-3.1-8B shapes: bf16 GEMMs, paged "
                "attention over HBM-resident KV, and attention reading selected pages from pinned "
                "host memory (zero-copy), against copy probes measured in the same run.");
  flags.IntList("batch", &o.batches, "batch sizes (GEMM m; requests in the attention step)");
  flags.IntList("contexts", &o.contexts, "context lengths in tokens");
  flags.DoubleList("read-fraction", &o.fractions, "share of the context a sparse step reads");
  flags.Int("chunk-rows", &o.chunk_rows,
            "rows per flash-decoding chunk; 0 = each kernel's own (ChoosePagedChunkRows)");
  flags.IntList("page-tokens", &o.page_tokens,
                "tokens per KV page of the attention rows: 8, 16, 32, 64 (v3 skips 64)");
  flags.StringList("paged-kernels", &o.paged_kernels,
                   "paged attention kernels to time side by side: v5 (tensor cores; the default "
                   "for KV in HBM), v3 (the zero-copy reader of pinned host pages)");
  flags.Int("span-tokens", &o.span_tokens, "tokens per selected span (multiple of 16)");
  flags.Int("repeats", &o.repeats, "timed repeats per point (median reported)");
  flags.Double("host-gib", &o.host_gib, "pinned host arena the sparse reads are drawn from");
  flags.Bool("dense-step", &o.dense_step,
             "also time the whole-model dense step (CudaDenseOps, random bf16 weights made on "
             "the device: 16 GB of HBM; --dense-step=false skips it)");
  flags.String("json", &json_path, "also write results to this file");
  CpuThreadsFlag cpu_threads(flags, CpuRole::kOffline);
  if (int rc = ParseFlagsOrExit(flags, args); rc >= 0) return rc;
  if (absl::StatusOr<kernels::cpu::CpuPool> pool = kernels::cpu::SetUpProcessCpu(cpu_threads);
      !pool.ok()) {
    std::cerr << "error: " << pool.status().message() << "\n";
    return 2;
  }
  if (!cuda::DeviceAvailable()) {
    std::cerr << "error: no CUDA device\n";
    return 1;
  }
  if (o.span_tokens <= 0 || o.span_tokens % kPageTokens != 0 || o.chunk_rows < 0 ||
      o.repeats <= 0 || !(o.host_gib > 0 && o.host_gib <= 64)) {
    std::cerr << "error: --span-tokens must be a positive multiple of 16, --chunk-rows >= 0, "
                 "--repeats positive, --host-gib in (0, 64]\n";
    return 2;
  }
  for (const std::string& k : o.paged_kernels) {
    cuda::PagedKernel kernel;
    if (!cuda::PagedKernelFromName(k, &kernel)) {
      std::cerr << "error: --paged-kernels values must be v3 or v5\n";
      return 2;
    }
  }
  for (int64_t p : o.page_tokens) {
    if (p != 8 && p != 16 && p != 32 && p != 64) {
      std::cerr << "error: --page-tokens values must be 8, 16, 32 or 64\n";
      return 2;
    }
    if (o.span_tokens % p != 0 && p <= o.span_tokens) {
      std::cerr << "error: --span-tokens must be a multiple of every --page-tokens value\n";
      return 2;
    }
  }
  for (int64_t b : o.batches) {
    if (b <= 0 || b > 256) {
      std::cerr << "error: --batch values must be in [1, 256]\n";
      return 2;
    }
  }
  for (int64_t c : o.contexts) {
    if (c <= 0 || c > (int64_t{1} << 20)) {
      std::cerr << "error: --contexts values must be in [1, 1048576]\n";
      return 2;
    }
  }
  for (double f : o.fractions) {
    if (!(f > 0 && f <= 1)) {
      std::cerr << "error: --read-fraction values must be in (0, 1]\n";
      return 2;
    }
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("device: %s, %.0f GiB\n", prop.name, prop.totalGlobalMem / double(1 << 30));
  nlohmann::json results = nlohmann::json::array(), limits;
  if (absl::Status s = Run(o, prop.multiProcessorCount, &results, &limits); !s.ok()) {
    std::cerr << "error: " << s << "\n";
    return 1;
  }
  if (o.dense_step) {
    const double hbm_gbps = limits["hbm_copy_gbps_read_plus_write"].get<double>();
    if (absl::Status s = RunDenseStep(o, hbm_gbps, &results); !s.ok()) {
      std::cerr << "error: dense step: " << s << "\n";
      return 1;
    }
  }
  limits["device"] = prop.name;
  if (!json_path.empty()) {
    absl::Status s = WriteJson(json_path,
                               ResultEnvelope(JoinCommand("fluxion bench gpu", args), limits, results));
    if (!s.ok()) {
      std::cerr << "error: " << s << "\n";
      return 1;
    }
  }
  return 0;
}

}  // namespace fluxion::bench

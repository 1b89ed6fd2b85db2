#include "bench/hybrid_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "bench/bench_util.h"
#include "common/read_bandwidth.h"
#include "common/status_macros.h"
#include "decode/kv/kv_arena.h"
#include "decode/kv/paged_kv.h"
#include "decode/sparse/decision_profile.h"
#include "decode/sparse/guard_flags.h"
#include "decode/sparse/policy.h"
#include "decode/step/hybrid_step_executor.h"
#include "decode/step/ping_pong_step_executor.h"
#include "decode/step/resident_window.h"
#include "decode/step/sparse_attention.h"
#include "kernels/cpu/cpu_pool.h"
#include "model/cpu_dense_ops.h"
#include "model/cuda_dense_ops.h"
#include "model/random_model.h"
#include "model/random_params.h"
#include "model/sampler.h"
#include "model/sparse_state.h"
#ifdef FLUXION_HAVE_CUDA
#include <cuda_runtime.h>

#include "decode/device/cuda_resident_window.h"
#include "decode/device/hbm_full_attention.h"
#endif

namespace fluxion::bench {
namespace {

constexpr int64_t kPageTokens = 16;
constexpr int64_t kFillChunk = 256;  // tokens of random K/V rows appended at a time

struct Device {
  std::unique_ptr<model::DenseOps> ops;
  std::unique_ptr<decode::ResidentWindow> window;
};

absl::StatusOr<Device> MakeDevice(const std::string& name, const decode::WindowShape& shape,
                                  const kernels::cpu::CpuPool* pool) {
  Device d;
  if (name == "cpu") {
    // The stand-in: the dense halves on the CPU pool, the window on the host.
    d.ops = std::make_unique<model::CpuDenseOps>(pool);
    FLUXION_ASSIGN_OR_RETURN(d.window, decode::NewHostResidentWindow(shape, kPageTokens));
    return d;
  }
  if (name != "cuda") {
    return absl::InvalidArgumentError(absl::StrCat("--device must be cpu or cuda, not ", name));
  }
  FLUXION_ASSIGN_OR_RETURN(d.ops, model::NewCudaDenseOps(0));
#ifdef FLUXION_HAVE_CUDA
  FLUXION_ASSIGN_OR_RETURN(d.window, decode::NewCudaResidentWindow(
                                         shape, static_cast<cudaStream_t>(d.ops->native_stream())));
  return d;
#else
  return absl::FailedPreconditionError("this binary was built without CUDA");
#endif
}

double MemAvailableGib() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  double kb = 0;
  while (in >> key >> kb) {
    if (key == "MemAvailable:") return kb / (1024.0 * 1024.0);
    in.ignore(256, '\n');
  }
  return 0;
}

// Host bytes one token of one request holds: K and V rows of every (layer, KV head) plus the
// pages' selection metadata (min, max and mean key, fp32, per page).
double BytesPerToken(const model::ModelConfig& c) {
  const double per_head = 2.0 * c.head_dim * 2 + 3.0 * c.head_dim * 4 / kPageTokens;
  return per_head * c.num_layers * c.num_kv_heads;
}

// `count` requests of `context` tokens each, their K/V random rows (a chunk of kFillChunk tokens
// repeated: a step's cost depends on how many rows it reads, not on their values), filled in
// parallel over requests.
absl::StatusOr<std::vector<std::unique_ptr<decode::PagedKv>>> FillKv(
    decode::KvArena* arena, const decode::KvShape& shape, int64_t count, int64_t context,
    const kernels::cpu::CpuPool& pool) {
  const int64_t row = shape.num_kv_heads * shape.head_dim;
  std::vector<float> k(kFillChunk * row), v(kFillChunk * row);
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& x : k) x = normal(rng);
  for (float& x : v) x = normal(rng);
  std::vector<std::unique_ptr<decode::PagedKv>> kvs(count);
  std::vector<absl::Status> statuses(count);
  pool.ParallelFor(count, [&](int64_t i) {
    auto kv = decode::PagedKv::Create(arena, shape);
    if (!kv.ok()) {
      statuses[i] = kv.status();
      return;
    }
    for (int layer = 0; layer < shape.num_layers && statuses[i].ok(); ++layer) {
      for (int64_t t = 0; t < context && statuses[i].ok(); t += kFillChunk) {
        statuses[i] =
            (*kv)->Append(layer, std::min(kFillChunk, context - t), k.data(), v.data(), row);
      }
    }
    kvs[i] = std::move(*kv);
  });
  for (const absl::Status& s : statuses) FLUXION_RETURN_IF_ERROR(s);
  return kvs;
}

struct Point {
  double median_ms = 0;
  decode::HybridCounters per_step;  // counters divided by the timed steps
  // The policies' own reads per timed step, summed over the batch: K rows read only to score
  // (exact rescoring: exact_topk, LFPS / Fluxion candidates) and page bounds scanned on the CPU.
  double k_rows_scored = 0;
  double metadata_bytes = 0;
  // Of the timed head-steps that rescored table candidates (LFPS / Fluxion), the share whose
  // table picks were made a step ahead (SparsePolicy::PrepareNextStep; 0 without any).
  double prepared_share = 0;
  // With --degrade-on-stall: the share of the middle budget the guard left the last step, the
  // smallest over the pipelines (1: never degraded).
  double budget_scale_end = 1;
  // Admission into the window (inside the first warm-up step, which every other request of a
  // served batch would wait for): mean ms per request, and that whole first step.
  double admit_ms = 0;
  double first_step_ms = 0;
};

// Dynamic degradation (decode/step/stall_guard.h) on every pipeline of a stepper, restarting it.
void SetStallGuard(decode::HybridStepExecutor& e, const decode::StallGuardOptions& o) {
  e.set_stall_guard(o);
}
void SetStallGuard(decode::PingPongStepExecutor& e, const decode::StallGuardOptions& o) {
  for (int h = 0; h < 2; ++h) e.pipeline(h).set_stall_guard(o);
}
double GuardScale(decode::HybridStepExecutor& e) { return e.stall_guard().scale(); }
double GuardScale(decode::PingPongStepExecutor& e) {
  return std::min(e.pipeline(0).stall_guard().scale(), e.pipeline(1).stall_guard().scale());
}

// Requests admitted and the seconds that took, over the stepper's pipelines.
decode::HybridStepExecutor::AdmissionCounters Admissions(decode::HybridStepExecutor& e) {
  return e.admission_counters();
}
decode::HybridStepExecutor::AdmissionCounters Admissions(decode::PingPongStepExecutor& e) {
  decode::HybridStepExecutor::AdmissionCounters sum;
  for (int h = 0; h < 2; ++h) {
    sum.requests += e.pipeline(h).admission_counters().requests;
    sum.seconds += e.pipeline(h).admission_counters().seconds;
  }
  return sum;
}

// The batch's selection stats summed.
decode::sparse::SelectionStats PolicyReads(
    const std::vector<decode::SparseAttention*>& attentions) {
  decode::sparse::SelectionStats sum;
  for (const decode::SparseAttention* a : attentions) sum.Add(a->stats());
  return sum;
}

// One timed configuration: a policy, and for lfps / fluxion the decision profile it replays.
struct Timed {
  decode::sparse::PolicyConfig policy;
  std::string label;    // PolicyLabel, plus "/<profile>" under a profile
  std::string profile;  // empty: profile-free (fixed hybrids, dense paths)
};

// The policies x profiles to time. lfps and fluxion run once per profile; every other policy
// that needs the prefill's sparse state is refused (random weights give it no meaning).
absl::StatusOr<std::vector<Timed>> TimedConfigs(const HybridBenchOptions& o) {
  FLUXION_ASSIGN_OR_RETURN(std::vector<decode::sparse::PolicyConfig> policies,
                           decode::sparse::ExpandPolicies(o.policies, o.budgets));
  {
    // Random weights: the guard's e_h through the identity (its cost is what is timed; the
    // checks' decisions mean as little as the policies' own here).
    FLUXION_ASSIGN_OR_RETURN(model::ModelConfig config, model::PresetConfig(o.preset));
    policies = decode::sparse::ExpandGuard(
        policies, o.guard_modes, o.guard,
        std::make_shared<const model::OutputProjection>(model::OutputProjection::Identity(
            config.num_layers, config.num_heads * config.head_dim)));
  }
  std::vector<std::shared_ptr<const decode::sparse::DecisionProfile>> profiles;
  for (const std::string& flag : o.profiles) {
    FLUXION_ASSIGN_OR_RETURN(auto p, decode::sparse::DecisionProfile::Resolve(flag));
    profiles.push_back(std::move(p));
  }
  std::vector<decode::sparse::Selector> selectors;
  for (const std::string& name : o.selectors) {
    FLUXION_ASSIGN_OR_RETURN(decode::sparse::Selector s, decode::sparse::ParseSelector(name));
    selectors.push_back(s);
  }
  policies = decode::sparse::ExpandSelectors(policies, selectors);
  std::vector<Timed> timed;
  for (const auto& p : policies) {
    const bool replayable = p.kind == decode::sparse::PolicyKind::kLfps ||
                            p.kind == decode::sparse::PolicyKind::kFluxion;
    if (!replayable && decode::sparse::TraitsOf(p.kind).needs_sparse_state) {
      return absl::InvalidArgumentError(absl::StrCat(
          "policy ", p.name,
          " decides from the prefill's sparse state, which random weights do "
          "not have; lfps and fluxion are timed under --profile (docs/SPARSE.md, \"Decision "
          "profiles\")"));
    }
    if (!replayable) {
      timed.push_back({p, decode::sparse::PolicyLabel(p), ""});
      continue;
    }
    if (profiles.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("policy ", p.name, " needs a --profile (conservative or a file)"));
    }
    for (const auto& profile : profiles) {
      FLUXION_RETURN_IF_ERROR(profile->For(p).status());
      Timed t{p, absl::StrCat(decode::sparse::PolicyLabel(p), "/", profile->name()),
              profile->name()};
      t.policy.decision_profile = profile;
      timed.push_back(std::move(t));
    }
  }
  return timed;
}

// The first `batch` of `kvs` as requests stepping under `policy`, with greedy samplers, as a served
// request without sampling parameters has: the step samples where the logits are (only each
// row's best candidate crosses; docs/EXECUTOR.md section 9), so the timed step is the serving
// loop's. Give() returns the pages to `kvs`.
class TimedBatch {
 public:
  static absl::StatusOr<TimedBatch> Make(std::vector<std::unique_ptr<decode::PagedKv>>& kvs,
                                         int64_t batch, const decode::sparse::PolicyConfig& policy,
                                         const model::SparseState* state,
                                         const model::AttentionShape& shape, int64_t vocab) {
    TimedBatch b;
    for (int64_t i = 0; i < batch; ++i) {
      const int64_t length = kvs[i]->length(0);
      FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<decode::SparseAttention> a,
                               FromPages(std::move(kvs[i]), policy, state, shape));
      b.attentions.push_back(a.get());
      b.seqs_.push_back(std::make_unique<model::Sequence>(std::move(a), length));
    }
    for (int64_t i = 0; i < batch; ++i) {
      b.samplers_.push_back(std::make_unique<model::Sampler>(model::SamplingParams{}));
      b.requests.push_back({b.seqs_[i].get(), b.attentions[i],
                            static_cast<int32_t>((31 * i + 7) % vocab), b.samplers_.back().get()});
    }
    return b;
  }

  // A request's attention over `kv` under `policy`, with `state` only for policies that need one.
  static absl::StatusOr<std::unique_ptr<decode::SparseAttention>> FromPages(
      std::unique_ptr<decode::PagedKv> kv, const decode::sparse::PolicyConfig& policy,
      const model::SparseState* state, const model::AttentionShape& shape) {
    return decode::SparseAttention::FromPages(
        std::move(kv), shape, policy,
        decode::sparse::TraitsOf(policy.kind).needs_sparse_state ? state : nullptr);
  }

  // One step of every request; returns its ms and keeps the first error in `failed`.
  template <typename Executor>
  double Step(Executor& executor, absl::Status* failed) {
    const auto t0 = std::chrono::steady_clock::now();
    executor.StepAndSample(requests, &next_, &logits_, &statuses_);
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    for (const absl::Status& st : statuses_) {
      if (!st.ok() && failed->ok()) *failed = st;
    }
    for (size_t i = 0; i < requests.size(); ++i) {
      if (next_[i] >= 0) requests[i].token = next_[i];
    }
    return ms;
  }

  // The pages back to `kvs`, whatever happened, so the next point can use them; then an empty
  // step releases the window's slots.
  template <typename Executor>
  void Give(Executor& executor, std::vector<std::unique_ptr<decode::PagedKv>>& kvs) {
    for (size_t i = 0; i < attentions.size(); ++i) kvs[i] = attentions[i]->TakeKv();
    executor.Step({}, &logits_, &statuses_);
  }

  std::vector<decode::SparseAttention*> attentions;
  std::vector<decode::StepRequest> requests;

 private:
  std::vector<std::unique_ptr<model::Sequence>> seqs_;
  std::vector<std::unique_ptr<model::Sampler>> samplers_;
  std::vector<int32_t> next_;
  std::vector<float> logits_;
  std::vector<absl::Status> statuses_;
};

// The executor's counters and the policies' reads of the timed steps, per step.
void PerStep(const decode::HybridCounters& counters, const decode::sparse::SelectionStats& before,
             const decode::sparse::SelectionStats& after, int64_t steps, Point* p) {
  p->per_step = counters;
  const double n = static_cast<double>(steps);
  for (double* x : {&p->per_step.to_host_s, &p->per_step.plan_s, &p->per_step.append_s,
                    &p->per_step.scores_s, &p->per_step.select_s, &p->per_step.host_s,
                    &p->per_step.host_prep_s, &p->per_step.host_kernel_s, &p->per_step.finish_s,
                    &p->per_step.merge_s, &p->per_step.lane_wait_s}) {
    *x /= n;
  }
  p->per_step.host_rows = static_cast<int64_t>(p->per_step.host_rows / n);
  p->per_step.mapped_rows = static_cast<int64_t>(p->per_step.mapped_rows / n);
  p->per_step.resident_rows = static_cast<int64_t>(p->per_step.resident_rows / n);
  p->k_rows_scored = (after.k_rows_scored - before.k_rows_scored) / n;
  p->metadata_bytes = (after.metadata_bytes - before.metadata_bytes) / n;
  const int64_t candidate_steps = after.candidate_steps - before.candidate_steps;
  p->prepared_share =
      candidate_steps > 0
          ? static_cast<double>(after.candidate_steps_prepared - before.candidate_steps_prepared) /
                candidate_steps
          : 0.0;
}

// Two warm-up steps and `steps` timed steps of `executor` over the first `batch` of `kvs` under
// `policy`; the pages come back to
// `kvs` afterwards. `state`: the sparse state policies that need one start from (null for the
// others).
template <typename Executor>  // HybridStepExecutor or PingPongStepExecutor
absl::StatusOr<Point> TimePoint(Executor& executor,
                                std::vector<std::unique_ptr<decode::PagedKv>>& kvs, int64_t batch,
                                const decode::sparse::PolicyConfig& policy,
                                const model::SparseState* state, const model::AttentionShape& shape,
                                int64_t vocab, int64_t steps) {
  FLUXION_ASSIGN_OR_RETURN(TimedBatch b, TimedBatch::Make(kvs, batch, policy, state, shape, vocab));
  // Two warm-up steps: the first admits the requests to the window (and, at a new batch size,
  // tunes the GEMMs), the second records the dense segments' CUDA graphs (model/decode_step.h).
  constexpr int64_t kWarmup = 2;
  Point p;
  std::vector<double> ms;
  absl::Status failed;
  decode::sparse::SelectionStats reads_before;
  const decode::HybridStepExecutor::AdmissionCounters admitted_before = Admissions(executor);
  for (int64_t s = 0; s < kWarmup + steps && failed.ok(); ++s) {
    if (s == kWarmup) {
      executor.ResetCounters();
      reads_before = PolicyReads(b.attentions);
    }
    const double elapsed = b.Step(executor, &failed);
    if (s >= kWarmup) ms.push_back(elapsed);
    if (s == 0) {
      // Admission into the window happens inside the first step.
      const decode::HybridStepExecutor::AdmissionCounters a = Admissions(executor);
      const int64_t n = a.requests - admitted_before.requests;
      if (n > 0) p.admit_ms = 1e3 * (a.seconds - admitted_before.seconds) / n;
      p.first_step_ms = elapsed;
    }
  }
  const decode::sparse::SelectionStats reads_after = PolicyReads(b.attentions);
  const decode::HybridCounters timed_counters = executor.counters();
  p.budget_scale_end = GuardScale(executor);
  b.Give(executor, kvs);
  FLUXION_RETURN_IF_ERROR(failed);
  p.median_ms = Summarize(ms).median;
  PerStep(timed_counters, reads_before, reads_after, steps, &p);
  return p;
}

#ifdef FLUXION_HAVE_CUDA
// The HBM-resident reference: the same dense halves with the whole KV (random) in HBM and full
// attention through the CUDA backend. Unavailable (skipped, with the reason) when the KV does not
// fit in the device memory left.
absl::StatusOr<double> TimeHbmFull(decode::HybridStepExecutor& executor,
                                   const model::ModelConfig& config, int64_t context, int64_t batch,
                                   int64_t steps, kernels::cuda::PagedKernel kernel) {
  decode::HbmKvShape shape;
  shape.num_layers = config.num_layers;
  shape.num_heads = config.num_heads;
  shape.num_kv_heads = config.num_kv_heads;
  shape.head_dim = config.head_dim;
  shape.scale = 1.0f / std::sqrt(static_cast<float>(config.head_dim));
  shape.max_requests = batch;
  shape.max_tokens = context + steps + 2;
  size_t free_bytes = 0, total = 0;
  cudaMemGetInfo(&free_bytes, &total);
  const size_t need = shape.num_layers * shape.layer_bytes();
  if (need + (size_t{4} << 30) > free_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("the KV (", need >> 30,
                                                     " GiB) does not fit "
                                                     "the ",
                                                     free_bytes >> 30, " GiB free"));
  }
  FLUXION_ASSIGN_OR_RETURN(
      std::unique_ptr<decode::HbmFullAttention> hbm,
      decode::HbmFullAttention::Create(
          shape, static_cast<cudaStream_t>(executor.ops().native_stream()), kernel));
  std::vector<int> slots(batch);
  std::vector<int64_t> positions(batch, context);
  std::vector<int32_t> tokens(batch);
  for (int64_t i = 0; i < batch; ++i) {
    slots[i] = static_cast<int>(i);
    tokens[i] = static_cast<int32_t>((31 * i + 7) % config.vocab_size);
    FLUXION_RETURN_IF_ERROR(hbm->FillRandom(static_cast<int>(i), context, 100 + i));
  }
  std::vector<float> logits(batch * config.vocab_size);
  std::vector<double> ms;
  for (int64_t s = 0; s <= steps; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    FLUXION_RETURN_IF_ERROR(hbm->BeginStep(slots, positions));
    FLUXION_RETURN_IF_ERROR(executor.runner().Step(tokens, positions, *hbm, logits.data()));
    const double elapsed =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (s > 0) ms.push_back(elapsed);
    for (int64_t& p : positions) ++p;
  }
  return Summarize(ms).median;
}
#endif

// What every point of a run shares: the model's shape, the configurations timed, the sizes the
// window and the arenas are made for.
struct RunPlan {
  model::ModelConfig config;
  model::AttentionShape shape;
  std::vector<Timed> policies;
  bool any_profiled = false;  // some policy needs the (synthesized) sparse state
  // Every plan resident (a budget below sinks + window): the GPU-only step.
  decode::sparse::PolicyConfig resident_only;
  int64_t max_batch = 0;
  // Tokens every request gains over the run (each point appends steps + 1 to the same pages).
  int64_t step_tokens = 0;
};

absl::StatusOr<RunPlan> MakePlan(const HybridBenchOptions& o) {
  for (const std::string& b : o.block_scores) {
    if (b != "device" && b != "cpu") {
      return absl::InvalidArgumentError(
          absl::StrCat("--block-scores takes device and cpu, not ", b));
    }
  }
  RunPlan plan;
  FLUXION_ASSIGN_OR_RETURN(plan.config, model::PresetConfig(o.preset));
  if (o.layers > 0) plan.config.num_layers = std::min<int>(plan.config.num_layers, o.layers);
  const model::ModelConfig& c = plan.config;
  plan.shape = model::AttentionShape{c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim,
                                     1.0f / std::sqrt(static_cast<float>(c.head_dim))};
  FLUXION_ASSIGN_OR_RETURN(plan.policies, TimedConfigs(o));
  plan.any_profiled = std::any_of(plan.policies.begin(), plan.policies.end(),
                                  [](const Timed& t) { return !t.profile.empty(); });
  FLUXION_ASSIGN_OR_RETURN(plan.resident_only, decode::sparse::ParsePolicy("quest", 1e-6));
  plan.max_batch = *std::max_element(o.batches.begin(), o.batches.end());
  const int64_t rows_per_point = static_cast<int64_t>(plan.policies.size() * o.block_scores.size() *
                                                      o.device_read_shares.size());
  plan.step_tokens = (o.steps + 3) * (rows_per_point + 1) *
                     static_cast<int64_t>(o.batches.size() * o.micro_batches.size());
  return plan;
}

// The one-pipeline executor, and with --micro-batches 2 the ping-pong one whose pipeline A it
// then is (so the weights are made, and on CUDA uploaded, once).
struct Executors {
  std::unique_ptr<decode::PingPongStepExecutor> ping_pong;
  std::unique_ptr<decode::HybridStepExecutor> single_owned;
  decode::HybridStepExecutor* single = nullptr;
  double weights_s = 0;  // making the random weights
};

absl::StatusOr<Executors> MakeExecutors(const HybridBenchOptions& o, const RunPlan& plan,
                                        const kernels::cpu::CpuPool& pool) {
  decode::WindowShape window_shape = decode::WindowShapeFor(plan.shape, plan.max_batch);
  window_shape.page_tokens = kPageTokens;
  window_shape.max_context_tokens =
      *std::max_element(o.contexts.begin(), o.contexts.end()) + plan.step_tokens + kPageTokens;
  if (std::any_of(plan.policies.begin(), plan.policies.end(),
                  [](const Timed& t) { return decode::sparse::DeviceSelects(t.policy); })) {
    window_shape.compact_slots = plan.max_batch;  // every request's compact rows in HBM
  }
  FLUXION_ASSIGN_OR_RETURN(Device device, MakeDevice(o.device, window_shape, &pool));
  Executors e;
  const auto w0 = std::chrono::steady_clock::now();
  FLUXION_ASSIGN_OR_RETURN(model::ModelParams params,
                           model::RandomParams(plan.config, *device.ops, 1, &pool));
  FLUXION_RETURN_IF_ERROR(device.ops->Sync());
  e.weights_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
  if (std::find(o.micro_batches.begin(), o.micro_batches.end(), 2) == o.micro_batches.end()) {
    FLUXION_ASSIGN_OR_RETURN(
        e.single_owned,
        decode::HybridStepExecutor::Create(plan.config, std::move(device.ops), std::move(params),
                                           std::move(device.window), &pool));
    e.single = e.single_owned.get();
    return e;
  }
  // A holds every request in the one-pipeline rows and the larger half in the ping-pong ones;
  // B the smaller half.
  decode::WindowShape b_shape = window_shape;
  b_shape.max_requests = b_shape.max_rows = std::max<int64_t>(1, plan.max_batch / 2);
  b_shape.compact_slots = std::min(b_shape.compact_slots, b_shape.max_requests);
  FLUXION_ASSIGN_OR_RETURN(Device second, MakeDevice(o.device, b_shape, &pool));
  decode::PingPongStepExecutor::Options options;
#ifdef FLUXION_HAVE_CUDA
  if (o.device == "cuda") options = decode::CudaPingPongOptions(0);
#endif
  FLUXION_ASSIGN_OR_RETURN(
      e.ping_pong,
      decode::PingPongStepExecutor::Create(
          plan.config, std::move(params), {std::move(device.ops), std::move(device.window)},
          {std::move(second.ops), std::move(second.window)}, &pool, options));
  e.single = &e.ping_pong->pipeline(0);
  return e;
}

void PrintHeader(const HybridBenchOptions& o, const RunPlan& plan, const Executors& e, int threads,
                 double probe_gbps, double limit_gib) {
  std::printf(
      "preset %s (%lld layers) on %s, %d CPU threads (read probe %.1f GB/s), weights made "
      "in %.1f s, host KV limit %.0f GiB (%.0f KiB per token)\n",
      o.preset.c_str(), static_cast<long long>(plan.config.num_layers), o.device.c_str(), threads,
      probe_gbps, e.weights_s, limit_gib, BytesPerToken(plan.config) / 1024);
  // mb: micro-batches (1: one pipeline, 2: ping-pong). With 2 the phase times (to_host ...
  // lane) are summed over both halves, each on its own thread, so they may exceed the step.
  // admit: ms per request to enter the window (in the first warm-up step; a served batch waits).
  // cpu GB/s: the CPU's attended rows' K/V bytes over its attention kernel's time, and that as a
  // share of the read probe (with a zero-copy share the device reads host memory at the same time).
  std::printf(
      "%8s %5s %2s %-34s | %9s %9s | %9s %9s | %7s %7s %7s %7s %7s %7s | %6s | %8s | "
      "%13s\n",
      "context", "batch", "mb", "policy", "step ms", "tok/s", "host rows", "res rows", "to_host",
      "plan", "cpu att", "finish", "merge", "lane", "idle", "admit", "cpu GB/s");
}

// One context's requests: `fits` of them (as many of the largest batch as the host memory limit
// holds; 0: the context is skipped), their pages filled, and the sparse state lfps and fluxion
// start from. Every batch point of the context uses the first `batch` of the same requests.
struct ContextKv {
  int64_t fits = 0;
  std::unique_ptr<decode::KvArena> arena;  // declared before `kvs`: outlives their pages
  std::vector<std::unique_ptr<decode::PagedKv>> kvs;
  model::SparseState state;
};

absl::StatusOr<ContextKv> FillContext(const HybridBenchOptions& o, const RunPlan& plan,
                                      int64_t context, double limit_gib,
                                      const kernels::cpu::CpuPool& pool) {
  const model::ModelConfig& config = plan.config;
  ContextKv c;
  const double per_request_gib = BytesPerToken(config) * (context + plan.step_tokens) / (1 << 30);
  c.fits = std::min<int64_t>(plan.max_batch, static_cast<int64_t>(limit_gib / per_request_gib));
  if (c.fits < 1) {
    std::printf("%8lld: skipped (one request's KV, %.1f GiB, exceeds the %.0f GiB limit)\n",
                static_cast<long long>(context), per_request_gib, limit_gib);
    c.fits = 0;
    return c;
  }
  const decode::KvShape kv_shape{config.num_layers, config.num_kv_heads, config.head_dim,
                                 kPageTokens};
  const int64_t pages = c.fits * config.num_layers * config.num_kv_heads *
                        ((context + plan.step_tokens) / kPageTokens + 2);
  FLUXION_ASSIGN_OR_RETURN(c.arena, decode::KvArena::Create(kv_shape.page_bytes(), pages));
#ifdef FLUXION_HAVE_CUDA
  if (o.device == "cuda") {
    // Pinned, so the GPU can read host pages zero-copy (--device-read-share).
    const auto p0 = std::chrono::steady_clock::now();
    if (absl::Status pinned = decode::PinArenaForCuda(c.arena.get()); !pinned.ok()) {
      std::printf("%8lld: arena not pinned (%s): the CPU reads every host row\n",
                  static_cast<long long>(context), std::string(pinned.message()).c_str());
    } else {
      std::printf("%8lld: %.1f GiB arena pinned in %.1f s\n", static_cast<long long>(context),
                  c.arena->bytes() / double(1 << 30),
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - p0).count());
    }
  }
#endif
  const auto f0 = std::chrono::steady_clock::now();
  FLUXION_ASSIGN_OR_RETURN(c.kvs, FillKv(c.arena.get(), kv_shape, c.fits, context, pool));
  std::printf("%8lld: %lld requests' KV filled in %.1f s\n", static_cast<long long>(context),
              static_cast<long long>(c.fits),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - f0).count());
  // lfps and fluxion start from a prefill's sparse state; random KV had no prefill, so one is
  // synthesized (model/sparse_state.h says why its contents do not decide the timing under a
  // profile). One per context, shared by every request, as a real prefill's would be per request.
  if (plan.any_profiled) {
    FLUXION_ASSIGN_OR_RETURN(c.state, model::SynthesizeSparseState(plan.shape, context));
  }
  return c;
}

// One printed row of a (context, batch) point.
struct Row {
  std::string label, profile;
  int64_t micro_batches = 1;
  Point point;
  double gpu_only_ms = 0;  // the resident-only step of the same micro-batching
};

// Every row of one micro-batching `mb` at one (context, batch): the resident-only step first,
// then each policy under each --block-scores and --device-read-share value.
template <typename Stepper>  // HybridStepExecutor or PingPongStepExecutor
absl::Status TimeRows(Stepper& stepper, const HybridBenchOptions& o, const RunPlan& plan,
                      ContextKv& kv, int64_t batch, int64_t mb, std::vector<Row>* rows) {
  const int64_t vocab = plan.config.vocab_size;
  SetStallGuard(stepper, decode::StallGuardOptions{});  // the GPU-only row: never degraded
  FLUXION_ASSIGN_OR_RETURN(Point gpu_only, TimePoint(stepper, kv.kvs, batch, plan.resident_only,
                                                     nullptr, plan.shape, vocab, o.steps));
  rows->push_back({"resident-only", "", mb, gpu_only, gpu_only.median_ms});
  decode::StallGuardOptions guard;
  guard.enabled = o.degrade_on_stall;
  for (const Timed& t : plan.policies) {
    const bool scored = decode::sparse::ReadsPageScores(t.policy);
    for (const std::string& where : o.block_scores) {
      for (double share : o.device_read_shares) {
        stepper.set_window_block_scores(where == "device");
        stepper.set_device_read_share(share);
        SetStallGuard(stepper, guard);  // each row starts undegraded
        FLUXION_ASSIGN_OR_RETURN(Point p, TimePoint(stepper, kv.kvs, batch, t.policy, &kv.state,
                                                    plan.shape, vocab, o.steps));
        std::string label = t.label;
        if (scored && o.block_scores.size() > 1) absl::StrAppend(&label, "/", where);
        if (o.device_read_shares.size() > 1 || share > 0) absl::StrAppend(&label, "/zc", share);
        rows->push_back({label, t.profile, mb, p, gpu_only.median_ms});
      }
      if (!scored) break;  // one set of rows: nothing to score
    }
  }
  stepper.set_window_block_scores(true);
  stepper.set_device_read_share(0);
  return absl::OkStatus();
}

#ifdef FLUXION_HAVE_CUDA
// The HBM-resident reference rows (one per --hbm-kernels value), printed and recorded at once;
// skipped, with the reason, where the KV does not fit.
void TimeHbmRows(decode::HybridStepExecutor& executor, const HybridBenchOptions& o,
                 const RunPlan& plan, int64_t context, int64_t batch, nlohmann::json* results) {
  for (const std::string& kernel_name : o.hbm_kernels) {
    kernels::cuda::PagedKernel kernel = kernels::cuda::PagedKernel::kV5;
    kernels::cuda::PagedKernelFromName(kernel_name, &kernel);  // checked with the flags
    const std::string label =
        o.hbm_kernels.size() > 1 ? "hbm-full-" + kernel_name : std::string("hbm-full");
    absl::StatusOr<double> hbm =
        TimeHbmFull(executor, plan.config, context, batch, o.steps, kernel);
    if (!hbm.ok()) {
      std::printf("%8lld %5lld %2s %-34s | skipped: %s\n", static_cast<long long>(context),
                  static_cast<long long>(batch), "1", label.c_str(),
                  std::string(hbm.status().message()).c_str());
      continue;
    }
    // Whether the dense segments ran from CUDA graphs (docs/GPU.md, "Fused, graphed and tuned
    // dense half").
    const model::DecodeStepRunner& runner = executor.runner();
    const std::string graphs = runner.graph_status().ok()
                                   ? absl::StrCat(runner.graph_replays(), " graph replays so far")
                                   : std::string(runner.graph_status().message());
    std::printf(
        "%8lld %5lld %2s %-34s | %9.2f %9.1f | (whole KV in HBM, full attention on "
        "the GPU; %s)\n",
        static_cast<long long>(context), static_cast<long long>(batch), "1", label.c_str(), *hbm,
        1e3 * batch / *hbm, graphs.c_str());
    results->push_back({{"preset", o.preset},
                        {"device", o.device},
                        {"context", context},
                        {"batch", batch},
                        {"policy", "hbm-full"},
                        {"kernel", kernel_name},
                        {"step_ms", *hbm},
                        {"tokens_per_s", 1e3 * batch / *hbm},
                        {"graphs", graphs}});
  }
}
#endif

// Prints `row` and appends its JSON record to `results`.
void ReportRow(const HybridBenchOptions& o, const RunPlan& plan, const Row& row, int64_t context,
               int64_t batch, double probe_gbps, nlohmann::json* results) {
  const Point& p = row.point;
  const decode::HybridCounters& c = p.per_step;
  // Host bytes of one attended row of one KV head: its bf16 K and V.
  const double row_bytes = 2.0 * plan.config.head_dim * 2;
  // The device is busy at most the resident-only step's time; the rest of a step it waits.
  const double idle = std::max(0.0, 1.0 - row.gpu_only_ms / p.median_ms);
  const double cpu_gbps =
      c.host_kernel_s > 0 ? c.host_rows * row_bytes / c.host_kernel_s / 1e9 : 0.0;
  std::printf(
      "%8lld %5lld %2lld %-34s | %9.2f %9.1f | %9lld %9lld | %7.2f %7.2f %7.2f "
      "%7.2f %7.2f %7.2f | %5.0f%% | %8.2f | %6.1f (%3.0f%%)\n",
      static_cast<long long>(context), static_cast<long long>(batch),
      static_cast<long long>(row.micro_batches), row.label.c_str(), p.median_ms,
      1e3 * batch / p.median_ms, static_cast<long long>(c.host_rows),
      static_cast<long long>(c.resident_rows), 1e3 * c.to_host_s, 1e3 * c.plan_s, 1e3 * c.host_s,
      1e3 * c.finish_s, 1e3 * c.merge_s, 1e3 * c.lane_wait_s, 100 * idle, p.admit_ms, cpu_gbps,
      100 * cpu_gbps / probe_gbps);
  std::fflush(stdout);
  results->push_back(
      {{"preset", o.preset},
       {"layers", plan.config.num_layers},
       {"device", o.device},
       {"context", context},
       {"batch", batch},
       {"micro_batches", row.micro_batches},
       {"degrade_on_stall", o.degrade_on_stall},
       {"budget_scale_end", p.budget_scale_end},
       {"admit_ms_per_request", p.admit_ms},
       {"first_step_ms", p.first_step_ms},
       {"policy", row.label},
       // null: the path decides nothing data-driven (profile-free)
       {"profile", row.profile.empty() ? nlohmann::json(nullptr) : nlohmann::json(row.profile)},
       {"step_ms", p.median_ms},
       {"tokens_per_s", 1e3 * batch / p.median_ms},
       {"host_rows_per_step", c.host_rows},
       {"device_read_rows_per_step", c.mapped_rows},
       {"k_rows_scored_per_step", p.k_rows_scored},
       {"cpu_metadata_bytes_per_step", p.metadata_bytes},
       {"prepared_pick_share", p.prepared_share},
       {"resident_rows_per_step", c.resident_rows},
       {"to_host_ms", 1e3 * c.to_host_s},
       {"plan_ms", 1e3 * c.plan_s},
       {"append_ms", 1e3 * c.append_s},
       {"scores_wait_ms", 1e3 * c.scores_s},
       {"select_ms", 1e3 * c.select_s},
       {"cpu_attention_ms", 1e3 * c.host_s},
       {"cpu_attention_prep_ms", 1e3 * c.host_prep_s},
       {"cpu_attention_kernel_ms", 1e3 * c.host_kernel_s},
       {"finish_ms", 1e3 * c.finish_s},
       {"merge_ms", 1e3 * c.merge_s},
       {"lane_wait_ms", 1e3 * c.lane_wait_s},
       {"cpu_attention_gbps", cpu_gbps},
       {"host_read_probe_gbps", probe_gbps},
       {"gpu_idle_estimate", idle}});
}

// `flush` is called after every (context, batch) point, so a run cut short by a time limit
// keeps what it measured.
absl::Status Run(const HybridBenchOptions& o, const kernels::cpu::CpuPool& pool,
                 nlohmann::json* results, const std::function<void()>& flush) {
  FLUXION_ASSIGN_OR_RETURN(RunPlan plan, MakePlan(o));
  FLUXION_ASSIGN_OR_RETURN(Executors e, MakeExecutors(o, plan, pool));
  const double limit_gib = o.host_memory_gib > 0 ? o.host_memory_gib : 0.8 * MemAvailableGib();
  // The pool's read bandwidth from host memory: what the CPU attention's rate is compared with
  // (issue 14's target: >= 80% of it for the bytes the CPU part touches).
  const double probe_gbps = common::MeasureReadBandwidthGbps(size_t{1} << 30, pool.threads());
  PrintHeader(o, plan, e, pool.threads(), probe_gbps, limit_gib);
  for (int64_t context : o.contexts) {
    FLUXION_ASSIGN_OR_RETURN(ContextKv kv, FillContext(o, plan, context, limit_gib, pool));
    if (kv.fits == 0) continue;
    for (int64_t batch : o.batches) {
      if (batch > kv.fits) {
        std::printf("%8lld %5lld skipped: %lld requests' KV (%.0f GiB) exceed the limit\n",
                    static_cast<long long>(context), static_cast<long long>(batch),
                    static_cast<long long>(batch),
                    batch * BytesPerToken(plan.config) * (context + plan.step_tokens) / (1 << 30));
        results->push_back({{"context", context}, {"batch", batch}, {"skipped", true}});
        continue;
      }
      std::vector<Row> rows;
      for (int64_t mb : o.micro_batches) {
        FLUXION_RETURN_IF_ERROR(mb == 2 ? TimeRows(*e.ping_pong, o, plan, kv, batch, mb, &rows)
                                        : TimeRows(*e.single, o, plan, kv, batch, mb, &rows));
      }
#ifdef FLUXION_HAVE_CUDA
      if (o.device == "cuda") TimeHbmRows(*e.single, o, plan, context, batch, results);
#endif
      for (const Row& row : rows) ReportRow(o, plan, row, context, batch, probe_gbps, results);
      flush();
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RunHybridBench(const HybridBenchOptions& o, const kernels::cpu::CpuPool& pool,
                            nlohmann::json* results, const std::function<void()>& flush) {
  return Run(o, pool, results, flush);
}

}  // namespace fluxion::bench

// The step executors against each other, for every policy, over real host pages of a random tiny
// model: the batched CPU executor (one attention problem per layer for the whole batch, built
// from the policies' plans) against the per-request loop (each request's
// SparseAttention::Forward), and the hybrid executor over the host stand-in of the resident
// window against the batched one: the same greedy tokens, logits equal up to rounding, and every
// policy spending exactly the same rows.
#include "decode/step/step_executor.h"

#include <array>
#include <random>

#include <unistd.h>

#include "decode/kv/kv_arena.h"
#include "decode/step/hybrid_step_executor.h"
#include "decode/step/paged_batch_attention.h"
#include "decode/step/resident_window.h"
#include "decode/sparse/guard_flags.h"
#include "decode/sparse/policy.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_pool.h"
#include "model/cpu_dense_ops.h"
#include "model/dense_attention.h"
#include "decode/step/step_testing.h"

namespace fluxion::decode {
namespace {

using step_testing::kPageTokens;

class StepExecutorTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    tiny_ = new step_testing::TinyModel("step_executor_test", 5);
    model_ = tiny_->get();
  }
  static void TearDownTestSuite() {
    delete tiny_;
    model_ = nullptr;
  }

  using Prefill = step_testing::Prefill;
  using Request = step_testing::Request;
  static Prefill MakePrefill(const std::vector<int32_t>& prompt) {
    return step_testing::MakePrefill(*model_, prompt);
  }
  static Request MakeRequest(KvArena* arena, const Prefill& prefill,
                             const sparse::PolicyConfig& policy) {
    return step_testing::MakeRequest(*model_, arena, prefill, policy);
  }
  static std::vector<int32_t> Prompt(int64_t n, uint32_t seed) {
    return step_testing::Prompt(n, seed);
  }

  // Six prompts of several lengths for the sampling tests: their prefills, caches and first tokens.
  struct SampledPrompts {
    std::vector<Prefill> prefills;
    std::vector<model::DenseAttention*> caches;
    std::vector<int32_t> first;
  };
  static SampledPrompts MakeSampledPrompts() {
    SampledPrompts out;
    for (int64_t n : {260, 700, 400, 70, 130, 90}) {
      out.prefills.push_back(MakePrefill(Prompt(n, 800 + n)));
    }
    for (const Prefill& p : out.prefills) {
      out.caches.push_back(p.cache.get());
      out.first.push_back(p.first_token);
    }
    return out;
  }

  struct Run {
    std::vector<std::vector<int32_t>> tokens;  // [request][step]
    std::vector<std::vector<float>> logits;    // [step][batch * vocab]
    std::vector<int64_t> rows_attended;        // [request]
    std::vector<sparse::SelectionStats> stats;  // [request]
    std::vector<sparse::GuardStats> guard;      // [request]
  };

  // `steps` greedy steps of `executor` over requests from `prefills` under `policy`.
  static Run Decode(StepExecutor& executor, const sparse::PolicyConfig& policy,
                    const std::vector<Prefill>& prefills, int steps) {
    const model::AttentionShape shape = model_->attention_shape();
    auto arena = *KvArena::Create(
        KvShape{shape.num_layers, shape.num_kv_heads, shape.head_dim, kPageTokens}.page_bytes(),
        4096);
    std::vector<Request> requests;
    for (const Prefill& p : prefills) requests.push_back(MakeRequest(arena.get(), p, policy));
    Run run;
    run.tokens.resize(requests.size());
    const int64_t vocab = model_->config().vocab_size;
    std::vector<float> logits;
    std::vector<absl::Status> statuses;
    for (int s = 0; s < steps; ++s) {
      std::vector<StepRequest> batch;
      for (Request& r : requests) batch.push_back({r.seq.get(), r.attention, r.token});
      executor.Step(batch, &logits, &statuses);
      for (size_t i = 0; i < requests.size(); ++i) {
        EXPECT_TRUE(statuses[i].ok()) << statuses[i];
        const float* row = logits.data() + i * vocab;
        requests[i].token = static_cast<int32_t>(std::max_element(row, row + vocab) - row);
        run.tokens[i].push_back(requests[i].token);
      }
      run.logits.push_back(logits);
    }
    for (const Request& r : requests) {
      EXPECT_EQ(r.seq->length(), prefills[&r - requests.data()].cache->length(0) + steps);
      run.rows_attended.push_back(r.attention->stats().rows_attended);
      run.stats.push_back(r.attention->stats());
      run.guard.push_back(r.attention->guard_stats());
    }
    return run;
  }

  // The hybrid executor with the dense halves on the CPU and the host stand-in of the window.
  // With max_context_tokens > 0 the window keeps page bounds and scores blocks for quest and
  // fixed_* (ResidentWindow::ScoreBlocks).
  // With compact_slots > 0 that many requests keep compact keys, and exact_topk / lfps / fluxion
  // under Selector::kDevice take their picks from the window (ResidentWindow::SelectRows).
  static std::unique_ptr<HybridStepExecutor> MakeHybrid(const kernels::cpu::CpuPool* pool,
                                                        int64_t max_requests = 8,
                                                        int64_t max_context_tokens = 0,
                                                        int64_t compact_slots = 0) {
    WindowShape w = WindowShapeFor(model_->attention_shape(), max_requests);
    w.page_tokens = kPageTokens;
    w.max_context_tokens = max_context_tokens;
    w.compact_slots = compact_slots;
    auto window = NewHostResidentWindow(w, kPageTokens);
    EXPECT_TRUE(window.ok()) << window.status();
    auto hybrid = HybridStepExecutor::Create(
        model_, std::make_unique<model::CpuDenseOps>(pool), std::move(*window), pool);
    EXPECT_TRUE(hybrid.ok()) << hybrid.status();
    return std::move(*hybrid);
  }

  static void ExpectSameRun(const Run& a, const Run& b, float tolerance) {
    EXPECT_EQ(a.tokens, b.tokens);
    EXPECT_EQ(a.rows_attended, b.rows_attended);
    ASSERT_EQ(a.logits.size(), b.logits.size());
    for (size_t s = 0; s < a.logits.size(); ++s) {
      ASSERT_EQ(a.logits[s].size(), b.logits[s].size());
      float worst = 0;
      for (size_t j = 0; j < a.logits[s].size(); ++j) {
        worst = std::max(worst, std::abs(a.logits[s][j] - b.logits[s][j]));
      }
      EXPECT_LT(worst, tolerance) << "step " << s;
    }
  }

  static std::vector<std::string> AllPolicies() {
    std::vector<std::string> names = {"fixed_32_0.3"};
    for (const std::string& n : sparse::PolicyNames()) {
      if (n.rfind("fixed_", 0) != 0) names.push_back(n);
    }
    return names;
  }

  static step_testing::TinyModel* tiny_;
  static const model::Model* model_;
};

step_testing::TinyModel* StepExecutorTest::tiny_ = nullptr;
const model::Model* StepExecutorTest::model_ = nullptr;

TEST_F(StepExecutorTest, EveryPolicyDecodesTheBatchAsThePerRequestLoopDoes) {
  // 700 rows exceed the CPU backend's piece size (512): the long request is split and merged.
  // At budget 0.3 every context here leaves the policies middle rows to choose (0.3 x 260 > the
  // 68 rows of sinks + window).
  std::vector<Prefill> prefills;
  for (int64_t n : {260, 700, 400}) prefills.push_back(MakePrefill(Prompt(n, 100 + n)));
  const kernels::cpu::CpuPool pool(2);
  for (const std::string& name : AllPolicies()) {
    SCOPED_TRACE(name);
    const sparse::PolicyConfig policy = *sparse::ParsePolicy(name, 0.3);
    std::unique_ptr<StepExecutor> batched = NewCpuStepExecutor(model_, &pool);
    std::unique_ptr<StepExecutor> loop = NewPerRequestStepExecutor(model_);
    // A GEMM over the batch's rows instead of one GEMV per request, and split-KV's merge: float
    // rounding only.
    ExpectSameRun(Decode(*batched, policy, prefills, 6), Decode(*loop, policy, prefills, 6),
                  1e-3f);
  }
}

TEST_F(StepExecutorTest, TheHybridStepOverTheHostWindowGivesTheBatchedStepsResults) {
  // Contexts past sinks + window, so the ring wraps every step; one long enough to be split.
  std::vector<Prefill> prefills;
  for (int64_t n : {260, 700, 400, 70}) prefills.push_back(MakePrefill(Prompt(n, 200 + n)));
  const kernels::cpu::CpuPool pool(2);
  for (const std::string& name : AllPolicies()) {
    SCOPED_TRACE(name);
    const sparse::PolicyConfig policy = *sparse::ParsePolicy(name, 0.3);
    std::unique_ptr<StepExecutor> batched = NewCpuStepExecutor(model_, &pool);
    std::unique_ptr<HybridStepExecutor> hybrid = MakeHybrid(&pool);
    const Run h = Decode(*hybrid, policy, prefills, 6);
    // The same rows in another merge order (window, host part, then the policy's estimate).
    ExpectSameRun(h, Decode(*batched, policy, prefills, 6), 1e-3f);
    const HybridCounters& c = hybrid->counters();
    int64_t rows = 0;
    for (int64_t r : h.rows_attended) rows += r;
    EXPECT_EQ(c.resident_rows + c.host_rows, rows) << "every planned row attended exactly once";
    EXPECT_GT(c.resident_rows, 0);
  }
}

// The hybrid step observes a layer beside the next layer's selections when those leave the
// pool's threads idle, else in the layer's finish phase (HybridBatchAttention::ObserveInFinish):
// either way the policies select the same rows. One request of the tiny model has 2 units a
// layer: a pool of 2 observes in the finish phase, a pool of 3 beside the next selections.
TEST_F(StepExecutorTest, TheHybridStepSelectsTheSameRowsWhereverItObserves) {
  const std::vector<Prefill> prefills = [] {
    std::vector<Prefill> p;
    p.push_back(MakePrefill(Prompt(700, 321)));
    return p;
  }();
  const kernels::cpu::CpuPool two(2), three(3);
  for (const char* name : {"lfps", "fluxion_rules"}) {
    SCOPED_TRACE(name);
    const sparse::PolicyConfig policy = *sparse::ParsePolicy(name, 0.1);
    std::unique_ptr<HybridStepExecutor> in_finish = MakeHybrid(&two);
    std::unique_ptr<HybridStepExecutor> deferred = MakeHybrid(&three);
    const Run a = Decode(*in_finish, policy, prefills, 8);
    const Run b = Decode(*deferred, policy, prefills, 8);
    EXPECT_EQ(in_finish->counters().layers_observed_in_finish,
              8 * model_->attention_shape().num_layers);
    EXPECT_EQ(deferred->counters().layers_observed_in_finish, 0);
    ExpectSameRun(a, b, 1e-3f);
    EXPECT_EQ(a.rows_attended, b.rows_attended);
    ASSERT_EQ(a.stats.size(), b.stats.size());
    EXPECT_EQ(a.stats[0].candidate_rows, b.stats[0].candidate_rows);
    EXPECT_EQ(a.stats[0].k_rows_scored, b.stats[0].k_rows_scored);
  }
}

// The online error guard (decode/sparse/error_guard.h) runs on every executor, the hybrid one's
// host stand-in included (its checks come after the window's rows are merged in): the same heads
// checked with the same errors, and the same tokens, as the per-request loop.
TEST_F(StepExecutorTest, TheErrorGuardChecksTheSameHeadsOnEveryExecutor) {
  std::vector<Prefill> prefills;
  for (int64_t n : {260, 700}) prefills.push_back(MakePrefill(Prompt(n, 300 + n)));
  const kernels::cpu::CpuPool pool(2);
  sparse::GuardConfig guard;
  guard.sample_rate = 0.25;
  auto projection = std::make_shared<const model::OutputProjection>(model_->output_projection());
  for (const char* name : {"lfps", "fluxion"}) {
    SCOPED_TRACE(name);
    const sparse::PolicyConfig policy =
        sparse::WithGuard(*sparse::ParsePolicy(name, 0.3), true, guard, projection);
    ASSERT_TRUE(sparse::GuardActive(policy));
    std::unique_ptr<StepExecutor> loop = NewPerRequestStepExecutor(model_);
    std::unique_ptr<StepExecutor> batched = NewCpuStepExecutor(model_, &pool);
    std::unique_ptr<HybridStepExecutor> hybrid = MakeHybrid(&pool);
    const Run l = Decode(*loop, policy, prefills, 6);
    for (StepExecutor* e : {static_cast<StepExecutor*>(batched.get()),
                            static_cast<StepExecutor*>(hybrid.get())}) {
      const Run r = Decode(*e, policy, prefills, 6);
      // Same tokens and rows; the logits within 3e-3: the per-request loop multiplies by GEMV
      // and the batched executors by GEMM, and where OpenBLAS picks its AVX-512 kernels (it
      // takes an AMD Zen 4 for a Cooper Lake) the two round apart by up to 1.34e-3 by the sixth
      // step of lfps (1e-3 passes with OPENBLAS_CORETYPE=HASWELL; the guard's budget moves
      // compound it). A divergence would change a token or a row count.
      ExpectSameRun(r, l, 3e-3f);
      for (size_t i = 0; i < prefills.size(); ++i) {
        EXPECT_GT(l.guard[i].checks, 0);
        EXPECT_EQ(r.guard[i].checks, l.guard[i].checks);
        EXPECT_EQ(r.guard[i].check_rows, l.guard[i].check_rows);
        ASSERT_EQ(r.guard[i].errors.size(), l.guard[i].errors.size());
        for (size_t j = 0; j < l.guard[i].errors.size(); ++j) {
          EXPECT_NEAR(r.guard[i].errors[j], l.guard[i].errors[j], 1e-3) << "check " << j;
        }
      }
    }
  }
}

TEST_F(StepExecutorTest, BlockScoresFromTheWindowSelectWhatTheCpuScanSelects) {
  // The window scores blocks from its own page bounds (loaded at admission, then folded from
  // each step's K) with the CPU policy's kernel: the same picks, tokens and rows attended, and
  // the CPU reads no page bounds. The 700-token request outgrows the window's 704-token metadata
  // mid-decode and goes on with CPU scoring (as a request that never fit does).
  std::vector<Prefill> prefills;
  // Every request's budget leaves its policy whole blocks to pick (0.3 x 400 - 68 > 32).
  for (int64_t n : {400, 700, 500}) prefills.push_back(MakePrefill(Prompt(n, 500 + n)));
  const kernels::cpu::CpuPool pool(2);
  for (const std::string name : {"quest", "fixed_32_0.3", "fixed_64_0.5"}) {
    SCOPED_TRACE(name);
    const sparse::PolicyConfig policy = *sparse::ParsePolicy(name, 0.3);
    std::unique_ptr<StepExecutor> batched = NewCpuStepExecutor(model_, &pool);
    std::unique_ptr<HybridStepExecutor> hybrid =
        MakeHybrid(&pool, /*max_requests=*/8, /*max_context_tokens=*/704);
    const Run h = Decode(*hybrid, policy, prefills, 6);
    ExpectSameRun(h, Decode(*batched, policy, prefills, 6), 1e-3f);
    EXPECT_GT(h.stats[0].blocks_scored_elsewhere, 0);
    EXPECT_GT(h.stats[0].selections_ranked_elsewhere, 0) << "the window's picks were taken";
    EXPECT_EQ(h.stats[0].metadata_bytes, 0) << "no bounds read on the CPU";
    EXPECT_GT(h.stats[2].blocks_scored_elsewhere, 0);
    EXPECT_EQ(h.stats[2].metadata_bytes, 0);
    // 700 + 4 steps fit; the fifth step's context (705) does not.
    EXPECT_GT(h.stats[1].blocks_scored_elsewhere, 0);
    EXPECT_GT(h.stats[1].metadata_bytes, 0);
  }
}

TEST_F(StepExecutorTest, DevicePicksFromTheWindowSelectWhatTheCpuEmulationSelects) {
  // The window keeps compact keys for two of the three requests (loaded at admission, then
  // appended from each step's K) and picks their rows; the third, and the 700-token request once
  // it outgrows the 704-token compact rows, compute the same picks on the CPU: the same tokens,
  // rows and logits as the CPU step, where every pick is the CPU's.
  std::vector<Prefill> prefills;
  for (int64_t n : {400, 700, 500}) prefills.push_back(MakePrefill(Prompt(n, 900 + n)));
  const kernels::cpu::CpuPool pool(2);
  // lfps: among its tables' candidates (the window's picks take the candidates' words).
  for (const std::string name : {"exact_topk", "fluxion_rules", "lfps"}) {
    SCOPED_TRACE(name);
    sparse::PolicyConfig policy = *sparse::ParsePolicy(name, 0.3);
    policy.selector = sparse::Selector::kDevice;
    std::unique_ptr<StepExecutor> batched = NewCpuStepExecutor(model_, &pool);
    std::unique_ptr<HybridStepExecutor> hybrid = MakeHybrid(
        &pool, /*max_requests=*/8, /*max_context_tokens=*/704, /*compact_slots=*/2);
    const Run h = Decode(*hybrid, policy, prefills, 6);
    const Run b = Decode(*batched, policy, prefills, 6);
    ExpectSameRun(h, b, 1e-3f);
    EXPECT_GT(h.stats[0].selections_ranked_elsewhere, 0) << "the window's picks were taken";
    EXPECT_EQ(h.stats[0].k_rows_scored, 0) << "no K row read on the CPU to score";
    EXPECT_GT(h.stats[1].selections_ranked_elsewhere, 0);
    EXPECT_GT(h.stats[1].k_rows_scored, 0) << "the CPU picks once the context outgrows them";
    EXPECT_EQ(h.stats[2].selections_ranked_elsewhere, 0) << "no compact slot left for it";
    EXPECT_GT(h.stats[2].k_rows_scored, 0);
    EXPECT_EQ(b.stats[0].selections_ranked_elsewhere, 0);
    if (name == "lfps") {
      EXPECT_GT(h.stats[0].candidate_steps, 0) << "some steps picked among table candidates";
    }
  }
}

TEST_F(StepExecutorTest, ReserveHoldsTheDevicePlacesForTheRequestsThatSelectOnTheDevice) {
  // One compact place: the first device-selecting request takes it, a second waits (false)
  // until the first is forgotten; a request too long for the compact rows, one selecting on
  // the host and quest need none. The admitted request's picks come from the window.
  const kernels::cpu::CpuPool pool(2);
  std::unique_ptr<HybridStepExecutor> hybrid =
      MakeHybrid(&pool, /*max_requests=*/8, /*max_context_tokens=*/704, /*compact_slots=*/1);
  const model::AttentionShape shape = model_->attention_shape();
  auto arena = *KvArena::Create(
      KvShape{shape.num_layers, shape.num_kv_heads, shape.head_dim, kPageTokens}.page_bytes(),
      4096);
  sparse::PolicyConfig device = *sparse::ParsePolicy("exact_topk", 0.3);
  device.selector = sparse::Selector::kDevice;
  const sparse::PolicyConfig host = *sparse::ParsePolicy("exact_topk", 0.3);
  const sparse::PolicyConfig quest = *sparse::ParsePolicy("quest", 0.3);
  const Prefill short_prompt = MakePrefill(Prompt(300, 11));
  const Prefill long_prompt = MakePrefill(Prompt(710, 12));
  Request a = MakeRequest(arena.get(), short_prompt, device);
  Request b = MakeRequest(arena.get(), short_prompt, device);
  Request too_long = MakeRequest(arena.get(), long_prompt, device);
  Request on_host = MakeRequest(arena.get(), short_prompt, host);
  Request ranked = MakeRequest(arena.get(), short_prompt, quest);

  EXPECT_TRUE(hybrid->Reserve(*a.attention));
  EXPECT_TRUE(hybrid->Reserve(*a.attention)) << "asking again keeps the reservation";
  EXPECT_FALSE(hybrid->Reserve(*b.attention)) << "the one place is reserved";
  EXPECT_TRUE(hybrid->Reserve(*too_long.attention)) << "never gets compact rows: no place";
  EXPECT_TRUE(hybrid->Reserve(*on_host.attention));
  EXPECT_TRUE(hybrid->Reserve(*ranked.attention));
  EXPECT_EQ(hybrid->compact_places_reserved(), 1);

  std::vector<float> logits;
  std::vector<absl::Status> statuses;
  hybrid->Step({{a.seq.get(), a.attention, a.token}}, &logits, &statuses);
  ASSERT_TRUE(statuses[0].ok()) << statuses[0];
  EXPECT_GT(a.attention->stats().selections_ranked_elsewhere, 0) << "picked by the window";

  hybrid->Forget(*a.attention);
  EXPECT_EQ(hybrid->compact_places_reserved(), 0);
  EXPECT_TRUE(hybrid->Reserve(*b.attention));
  hybrid->Step({{b.seq.get(), b.attention, b.token}}, &logits, &statuses);
  ASSERT_TRUE(statuses[0].ok()) << statuses[0];
  EXPECT_GT(b.attention->stats().selections_ranked_elsewhere, 0) << "the place came back";
}

TEST_F(StepExecutorTest, ADeviceReadShareSplitsEveryPairsHostRowsAndChangesNoResult) {
  // The device (here the host stand-in) attends the first share of every pair's host rows
  // straight from the pages while the CPU attends the rest: the same plans, merged in another
  // order.
  std::vector<Prefill> prefills;
  for (int64_t n : {260, 700, 400}) prefills.push_back(MakePrefill(Prompt(n, 600 + n)));
  const kernels::cpu::CpuPool pool(2);
  for (const std::string name : {"full", "quest", "lfps"}) {
    for (double share : {0.4, 1.0}) {
      SCOPED_TRACE(name + " share " + std::to_string(share));
      const sparse::PolicyConfig policy = *sparse::ParsePolicy(name, 0.3);
      std::unique_ptr<StepExecutor> batched = NewCpuStepExecutor(model_, &pool);
      std::unique_ptr<HybridStepExecutor> hybrid = MakeHybrid(&pool);
      hybrid->set_device_read_share(share);
      const Run h = Decode(*hybrid, policy, prefills, 6);
      ExpectSameRun(h, Decode(*batched, policy, prefills, 6), 1e-3f);
      const HybridCounters& c = hybrid->counters();
      int64_t rows = 0;
      for (int64_t r : h.rows_attended) rows += r;
      EXPECT_EQ(c.resident_rows + c.host_rows + c.mapped_rows, rows);
      EXPECT_GT(c.mapped_rows, 0);
      if (share == 1.0) {
        EXPECT_EQ(c.host_rows, 0);
      } else {
        EXPECT_GT(c.host_rows, 0);
      }
    }
  }
}

// One request per entry of SampledParams: greedy, top-k, top-p (without top-k: the normaliser's
// path), seeded temperature + top-k, top-p + top-k, and temperature alone (every token needed).
std::vector<model::SamplingParams> SampledParams() {
  return {{0.0, 0, 1.0, 0},  {0.8, 40, 1.0, 11}, {0.3, 0, 0.9, 12},
          {1.0, 20, 1.0, 13}, {0.7, 50, 0.8, 14}, {1.0, 0, 1.0, 15}};
}

// `steps` steps over requests from `prefills`, request i drawing with SampledParams()[i]: through
// StepAndSample, or (host_sampling) through Step and each sampler over its full row. With
// `logprobs` >= 0 every request asks for them and each draw's land in (*drawn_logprobs)[i].
std::vector<std::vector<int32_t>> DecodeSampled(
    StepExecutor& executor, const model::Model* model, const sparse::PolicyConfig& policy,
    const std::vector<model::DenseAttention*>& caches, const std::vector<int32_t>& first_tokens,
    int steps, bool host_sampling, int32_t logprobs = -1,
    std::vector<std::vector<model::TokenLogprobs>>* drawn_logprobs = nullptr) {
  const model::AttentionShape shape = model->attention_shape();
  auto arena = *KvArena::Create(
      KvShape{shape.num_layers, shape.num_kv_heads, shape.head_dim, kPageTokens}.page_bytes(),
      4096);
  const std::vector<model::SamplingParams> params = SampledParams();
  std::vector<std::unique_ptr<model::Sequence>> seqs;
  std::vector<SparseAttention*> attentions;
  std::vector<model::Sampler> samplers;
  std::vector<int32_t> next = first_tokens;
  for (size_t i = 0; i < caches.size(); ++i) {
    auto attention = SparseAttention::FromDense(arena.get(), shape, kPageTokens, *caches[i], policy);
    EXPECT_TRUE(attention.ok()) << attention.status();
    attentions.push_back(attention->get());
    seqs.push_back(std::make_unique<model::Sequence>(std::move(*attention), caches[i]->length(0)));
    model::SamplingParams p = params[i % params.size()];
    p.logprobs = logprobs;
    samplers.emplace_back(p);
  }
  if (drawn_logprobs != nullptr) drawn_logprobs->assign(caches.size(), {});
  std::vector<std::vector<int32_t>> tokens(caches.size());
  const int64_t vocab = model->config().vocab_size;
  std::vector<int32_t> drawn;
  std::vector<float> logits;
  std::vector<absl::Status> statuses;
  for (int s = 0; s < steps; ++s) {
    std::vector<StepRequest> batch;
    for (size_t i = 0; i < seqs.size(); ++i) {
      batch.push_back({seqs[i].get(), attentions[i], next[i], &samplers[i]});
    }
    if (host_sampling) {
      executor.Step(batch, &logits, &statuses);
      drawn.clear();
      for (size_t i = 0; i < batch.size(); ++i) {
        drawn.push_back(samplers[i].Sample(absl::MakeConstSpan(logits.data() + i * vocab, vocab)));
      }
    } else {
      executor.StepAndSample(batch, &drawn, &logits, &statuses);
    }
    for (size_t i = 0; i < batch.size(); ++i) {
      EXPECT_TRUE(statuses[i].ok()) << statuses[i];
      EXPECT_GE(drawn[i], 0) << "request " << i << " step " << s;
      next[i] = drawn[i];
      tokens[i].push_back(drawn[i]);
      if (drawn_logprobs != nullptr && samplers[i].last_logprobs().has_value()) {
        (*drawn_logprobs)[i].push_back(*samplers[i].last_logprobs());
      }
    }
  }
  return tokens;
}

TEST_F(StepExecutorTest, TheHybridStepSamplesFromCandidatesTheTokensTheCpuStepSamples) {
  const SampledPrompts prompts = MakeSampledPrompts();
  const std::vector<model::DenseAttention*>& caches = prompts.caches;
  const std::vector<int32_t>& first = prompts.first;
  const kernels::cpu::CpuPool pool(2);
  const sparse::PolicyConfig policy = *sparse::ParsePolicy("quest", 0.3);
  constexpr int kSteps = 8;
  std::unique_ptr<StepExecutor> cpu = NewCpuStepExecutor(model_, &pool);
  const auto want = DecodeSampled(*cpu, model_, policy, caches, first, kSteps, false);
  // The hybrid step's own logits sampled on the host: the reference for its candidate path.
  std::unique_ptr<HybridStepExecutor> full = MakeHybrid(&pool);
  EXPECT_EQ(DecodeSampled(*full, model_, policy, caches, first, kSteps, true), want);
  // Every candidate count: the whole 512-token row (1024), a partial list (64: top-p without
  // top-k draws against the device-style normaliser or falls back), and too few for top-k 20+
  // (8: those rows and temperature alone fall back to their full logits).
  for (int64_t max_candidates : {int64_t{1024}, int64_t{64}, int64_t{8}}) {
    SCOPED_TRACE(max_candidates);
    std::unique_ptr<HybridStepExecutor> hybrid = MakeHybrid(&pool);
    hybrid->set_max_candidates(max_candidates);
    EXPECT_EQ(DecodeSampled(*hybrid, model_, policy, caches, first, kSteps, false), want);
    const HybridStepExecutor::SamplingCounters& c = hybrid->sampling_counters();
    EXPECT_EQ(c.candidate_rows + c.full_rows, kSteps * 6);
    // Greedy always draws from candidates; temperature alone never does from a partial list.
    EXPECT_GE(c.candidate_rows, kSteps);
    if (max_candidates == 1024) {
      EXPECT_EQ(c.full_rows, 0);
    } else if (max_candidates == 64) {
      // This model's top-p rows reach their mass within 64 tokens: only temperature alone crosses.
      EXPECT_EQ(c.full_rows, kSteps);
    } else {
      EXPECT_GE(c.full_rows, 4 * kSteps);  // top_k 20, 40, 50 and temperature alone
    }
  }
}

// Logprobs ride on the candidate path: the rows that draw from candidates give the log-softmax of
// their full row (their normaliser summed at temperature 1), the same tokens are drawn, and a
// top-p row at another temperature crosses whole (one normaliser per row).
TEST_F(StepExecutorTest, TheHybridStepsLogprobsFromCandidatesEqualTheFullRowsOnes) {
  const SampledPrompts prompts = MakeSampledPrompts();
  const std::vector<model::DenseAttention*>& caches = prompts.caches;
  const std::vector<int32_t>& first = prompts.first;
  const kernels::cpu::CpuPool pool(2);
  const sparse::PolicyConfig policy = *sparse::ParsePolicy("quest", 0.3);
  constexpr int kSteps = 6, kTop = 4;
  std::vector<std::vector<model::TokenLogprobs>> want, got;
  std::unique_ptr<HybridStepExecutor> full = MakeHybrid(&pool);
  const auto tokens =
      DecodeSampled(*full, model_, policy, caches, first, kSteps, true, kTop, &want);
  std::unique_ptr<HybridStepExecutor> hybrid = MakeHybrid(&pool);
  hybrid->set_max_candidates(64);
  EXPECT_EQ(DecodeSampled(*hybrid, model_, policy, caches, first, kSteps, false, kTop, &got),
            tokens);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(got[i].size(), static_cast<size_t>(kSteps));
    for (int s = 0; s < kSteps; ++s) {
      SCOPED_TRACE(::testing::Message() << "request " << i << " step " << s);
      EXPECT_EQ(got[i][s].token, tokens[i][s]);
      EXPECT_NEAR(got[i][s].logprob, want[i][s].logprob, 1e-4);
      EXPECT_EQ(got[i][s].top_ids, want[i][s].top_ids);
      ASSERT_EQ(got[i][s].top_logprobs.size(), static_cast<size_t>(kTop));
      for (int k = 0; k < kTop; ++k) {
        EXPECT_NEAR(got[i][s].top_logprobs[k], want[i][s].top_logprobs[k], 1e-4);
      }
    }
  }
  // Greedy, top-k and top-p at temperature 1 draw from candidates; temperature alone and top-p at
  // 0.3 / 0.7 (another normaliser) cross whole.
  const HybridStepExecutor::SamplingCounters& c = hybrid->sampling_counters();
  EXPECT_EQ(c.candidate_rows + c.full_rows, kSteps * 6);
  EXPECT_GE(c.candidate_rows, 3 * kSteps);
  EXPECT_GE(c.full_rows, 2 * kSteps);
}

std::tuple<int32_t, int32_t, int32_t> Fields(const kernels::PageSpan& s) {
  return {s.page, s.first_row, s.rows};
}

TEST(SplitSpansTest, CutsAtTheRowAndKeepsTokenOrder) {
  const std::vector<kernels::PageSpan> spans = {{3, 0, 16}, {7, 0, 16}, {9, 2, 5}};
  std::vector<kernels::PageSpan> front, rest;
  SplitSpans(spans.data(), spans.data() + spans.size(), 20, &front, &rest);
  ASSERT_EQ(front.size(), 2u);
  EXPECT_EQ(Fields(front[0]), std::make_tuple(3, 0, 16));
  EXPECT_EQ(Fields(front[1]), std::make_tuple(7, 0, 4));
  ASSERT_EQ(rest.size(), 2u);
  EXPECT_EQ(Fields(rest[0]), std::make_tuple(7, 4, 12));
  EXPECT_EQ(Fields(rest[1]), std::make_tuple(9, 2, 5));
  front.clear();
  rest.clear();
  SplitSpans(spans.data(), spans.data() + spans.size(), 0, &front, &rest);
  EXPECT_TRUE(front.empty());
  EXPECT_EQ(rest.size(), 3u);
  EXPECT_EQ(DeviceRows(37, 0.5), 19);
  EXPECT_EQ(DeviceRows(37, 0.0), 0);
  EXPECT_EQ(DeviceRows(37, 1.0), 37);
}

TEST_F(StepExecutorTest, StreamingPlansNeverReachTheHostPart) {
  // Budget 0.01 at these contexts is below sinks + window: every plan is sinks + window only.
  std::vector<Prefill> prefills;
  for (int64_t n : {300, 500}) prefills.push_back(MakePrefill(Prompt(n, 300 + n)));
  const kernels::cpu::CpuPool pool(2);
  std::unique_ptr<HybridStepExecutor> hybrid = MakeHybrid(&pool);
  const Run h = Decode(*hybrid, *sparse::ParsePolicy("quest", 0.01), prefills, 4);
  EXPECT_EQ(hybrid->counters().host_rows, 0);
  EXPECT_EQ(hybrid->counters().host_pairs, 0);
  EXPECT_GT(hybrid->counters().resident_rows, 0);
}

TEST_F(StepExecutorTest, TheHybridStepRefusesOnlyTheRequestsItCannotHold) {
  const model::AttentionShape shape = model_->attention_shape();
  auto arena = *KvArena::Create(
      KvShape{shape.num_layers, shape.num_kv_heads, shape.head_dim, kPageTokens}.page_bytes(),
      4096);
  const Prefill prefill = MakePrefill(Prompt(100, 4));
  sparse::PolicyConfig narrow = *sparse::ParsePolicy("quest", 0.3);
  narrow.local_tokens = 32;  // below the window's 64: its plans would miss resident rows
  const sparse::PolicyConfig full = *sparse::ParsePolicy("full", 1.0);
  const kernels::cpu::CpuPool pool(1);
  std::unique_ptr<HybridStepExecutor> hybrid = MakeHybrid(&pool, /*max_requests=*/2);
  Request a = MakeRequest(arena.get(), prefill, full);
  Request b = MakeRequest(arena.get(), prefill, narrow);
  Request c = MakeRequest(arena.get(), prefill, full);
  Request d = MakeRequest(arena.get(), prefill, full);
  std::vector<float> logits;
  std::vector<absl::Status> statuses;
  hybrid->Step({{a.seq.get(), a.attention, a.token},
                {b.seq.get(), b.attention, b.token},
                {c.seq.get(), c.attention, c.token},
                {d.seq.get(), d.attention, d.token}},
               &logits, &statuses);
  ASSERT_EQ(statuses.size(), 4u);
  EXPECT_TRUE(statuses[0].ok()) << statuses[0];
  EXPECT_EQ(statuses[1].code(), absl::StatusCode::kFailedPrecondition) << statuses[1];
  EXPECT_TRUE(statuses[2].ok()) << statuses[2];
  EXPECT_EQ(statuses[3].code(), absl::StatusCode::kResourceExhausted) << statuses[3];
  EXPECT_EQ(a.seq->length(), 101);
  EXPECT_EQ(d.seq->length(), 100);
  // a leaves: its slot goes to d in the next step.
  hybrid->Step({{c.seq.get(), c.attention, 0}, {d.seq.get(), d.attention, d.token}}, &logits,
               &statuses);
  EXPECT_TRUE(statuses[0].ok()) << statuses[0];
  EXPECT_TRUE(statuses[1].ok()) << statuses[1];
  EXPECT_EQ(d.seq->length(), 101);
}

TEST(TrimSpansTest, CutsRowsOffBothEndsInsideSpans) {
  using kernels::PageSpan;
  const std::vector<PageSpan> spans = {{7, 0, 4}, {3, 2, 10}, {9, 0, 16}, {5, 1, 3}};  // 33 rows
  auto trim = [&](int64_t front, int64_t back) {
    std::vector<PageSpan> out;
    TrimSpans(spans.data(), spans.data() + spans.size(), front, back, &out);
    std::vector<std::array<int32_t, 3>> flat;
    for (const PageSpan& s : out) flat.push_back({s.page, s.first_row, s.rows});
    return flat;
  };
  using V = std::vector<std::array<int32_t, 3>>;
  EXPECT_EQ(trim(0, 0), (V{{7, 0, 4}, {3, 2, 10}, {9, 0, 16}, {5, 1, 3}}));
  EXPECT_EQ(trim(4, 3), (V{{3, 2, 10}, {9, 0, 16}}));
  EXPECT_EQ(trim(6, 5), (V{{3, 4, 8}, {9, 0, 14}}));
  EXPECT_EQ(trim(20, 12), (V{{9, 6, 1}}));
  EXPECT_EQ(trim(30, 3), V{});
  EXPECT_EQ(trim(1, 31), (V{{7, 1, 1}}));
  EXPECT_EQ(trim(2, 31), V{});
}

TEST_F(StepExecutorTest, AFullArenaFailsTheStepWithResourceExhaustedNamingTheRequest) {
  const model::AttentionShape shape = model_->attention_shape();
  const int64_t growth = shape.num_layers * shape.num_kv_heads;
  const int64_t prompt = kPageTokens;  // the next token starts a page in every (layer, head)
  auto arena = *KvArena::Create(
      KvShape{shape.num_layers, shape.num_kv_heads, shape.head_dim, kPageTokens}.page_bytes(),
      growth);  // exactly the prompt's pages: none left for the step
  const sparse::PolicyConfig policy = *sparse::ParsePolicy("full", 1.0);
  Request r = MakeRequest(arena.get(), MakePrefill(Prompt(prompt, 9)), policy);
  std::unique_ptr<StepExecutor> batched = NewCpuStepExecutor(model_);
  std::vector<float> logits;
  std::vector<absl::Status> statuses;
  batched->Step({{r.seq.get(), r.attention, r.token}}, &logits, &statuses);
  ASSERT_EQ(statuses.size(), 1u);
  EXPECT_EQ(statuses[0].code(), absl::StatusCode::kResourceExhausted) << statuses[0];
  EXPECT_NE(statuses[0].message().find("request 0, layer 0"), std::string::npos) << statuses[0];
}

}  // namespace
}  // namespace fluxion::decode

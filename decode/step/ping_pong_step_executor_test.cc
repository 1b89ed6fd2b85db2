// The ping-pong executor over the host stand-in (the CPU DenseOps and the host resident window,
// as `fluxion bench decode --device cpu` runs it) against two single-pipeline hybrid executors
// stepping the same halves on the test's thread: bit-for-bit the same logits, over steps where
// requests join and leave, for several policies. The stand-in computes every row of a half the
// same way whichever thread drives it (the same products over the same rows, the same attention
// problem), so any difference would be a bug in the split, the reassembly or the sharing.
#include "decode/step/ping_pong_step_executor.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <random>
#include <set>
#include <string>
#include <thread>

#include <unistd.h>

#include "decode/step/hybrid_step_executor.h"
#include "decode/kv/kv_arena.h"
#include "common/wait_testing.h"
#include "decode/step/resident_window.h"
#include "decode/sparse/policy.h"
#include "gtest/gtest.h"
#include "model/sampler.h"
#include "kernels/cpu/cpu_pool.h"
#include "model/cpu_dense_ops.h"
#include "model/dense_attention.h"
#include "model/layer.h"
#include "decode/step/step_testing.h"

namespace fluxion::decode {
namespace {

using step_testing::kPageTokens;

class PingPongTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    tiny_ = new step_testing::TinyModel("ping_pong_test", 7);
    model_ = tiny_->get();
  }
  static void TearDownTestSuite() {
    delete tiny_;
    model_ = nullptr;
  }

  using Prefill = step_testing::Prefill;
  using Request = step_testing::Request;
  static std::vector<int32_t> Prompt(int64_t n, uint32_t seed) {
    return step_testing::Prompt(n, seed);
  }
  static Prefill MakePrefill(int64_t n, uint32_t seed) {
    return step_testing::MakePrefill(*model_, Prompt(n, seed));
  }
  static std::unique_ptr<KvArena> MakeArena() { return step_testing::MakeArena(*model_); }
  static Request MakeRequest(KvArena* arena, const Prefill& prefill,
                             const sparse::PolicyConfig& policy) {
    return step_testing::MakeRequest(*model_, arena, prefill, policy);
  }

  static std::unique_ptr<ResidentWindow> MakeWindow(int64_t slots) {
    WindowShape w = WindowShapeFor(model_->attention_shape(), slots);
    w.page_tokens = kPageTokens;
    w.max_context_tokens = 2048;  // quest / fixed_* scored by the window, as served
    auto window = NewHostResidentWindow(w, kPageTokens);
    EXPECT_TRUE(window.ok()) << window.status();
    return std::move(*window);
  }

  static PingPongStepExecutor::Pipeline MakePipeline(const kernels::cpu::CpuPool* pool,
                                                     int64_t slots) {
    return {std::make_unique<model::CpuDenseOps>(pool), MakeWindow(slots)};
  }

  static std::unique_ptr<PingPongStepExecutor> MakePingPong(const kernels::cpu::CpuPool* pool,
                                                            int64_t slots_each = 4) {
    auto made = PingPongStepExecutor::Create(model_, MakePipeline(pool, slots_each),
                                             MakePipeline(pool, slots_each), pool);
    EXPECT_TRUE(made.ok()) << made.status();
    return std::move(*made);
  }

  static std::unique_ptr<HybridStepExecutor> MakeSingle(const kernels::cpu::CpuPool* pool,
                                                        int64_t slots = 4) {
    auto made = HybridStepExecutor::Create(
        model_, std::make_unique<model::CpuDenseOps>(pool), MakeWindow(slots), pool);
    EXPECT_TRUE(made.ok()) << made.status();
    return std::move(*made);
  }

  // The micro-batch rule as the header states it, kept by the test for the reference run.
  struct Split {
    std::map<int, int> half;  // request index -> micro-batch
    std::array<int64_t, 2> held = {0, 0};
    int64_t capacity = 4;
    void Update(const std::vector<int>& listed) {
      for (auto it = half.begin(); it != half.end();) {
        if (std::find(listed.begin(), listed.end(), it->first) == listed.end()) {
          --held[it->second];
          it = half.erase(it);
        } else {
          ++it;
        }
      }
      for (int r : listed) {
        if (half.count(r) > 0) continue;
        int h = held[0] <= held[1] ? 0 : 1;
        if (held[h] >= capacity) h = 1 - h;
        half[r] = h;
        ++held[h];
      }
    }
  };

  static void ExpectBitEqual(const float* a, const float* b, int64_t n, const std::string& what) {
    int64_t differ = 0;
    float worst = 0;
    for (int64_t j = 0; j < n; ++j) {
      if (a[j] != b[j]) {
        ++differ;
        worst = std::max(worst, std::abs(a[j] - b[j]));
      }
    }
    EXPECT_EQ(differ, 0) << what << ": largest difference " << worst;
  }

  static step_testing::TinyModel* tiny_;
  static const model::Model* model_;
};

step_testing::TinyModel* PingPongTest::tiny_ = nullptr;
const model::Model* PingPongTest::model_ = nullptr;

TEST_F(PingPongTest, GivesTheLogitsOfTwoSinglePipelinesSteppingTheSameHalves) {
  // Contexts past sinks + window (the rings wrap) and one past the CPU backend's 512-row piece.
  const std::vector<int64_t> lengths = {260, 700, 400, 70, 150, 333};
  std::vector<Prefill> prefills;
  for (size_t i = 0; i < lengths.size(); ++i) prefills.push_back(MakePrefill(lengths[i], 40 + i));
  // Who is listed at each step: joins, leaves, a batch of one, and a return to six.
  const std::vector<std::vector<int>> schedule = {
      {0, 1}, {0, 1, 2}, {0, 1, 2, 3, 4}, {1, 2, 3, 4}, {1, 4, 5}, {4}, {2, 4, 5, 0, 3, 1}};
  const kernels::cpu::CpuPool pool(2);
  const int64_t vocab = model_->config().vocab_size;
  for (const char* name : {"full", "quest", "fixed_32_0.05", "lfps"}) {
    SCOPED_TRACE(name);
    const sparse::PolicyConfig policy = *sparse::ParsePolicy(name, 0.3);
    std::unique_ptr<PingPongStepExecutor> ping_pong = MakePingPong(&pool);
    std::array<std::unique_ptr<HybridStepExecutor>, 2> single = {MakeSingle(&pool),
                                                                 MakeSingle(&pool)};
    // Each side decodes its own copies of the requests (a step appends to their pages).
    auto arena_p = MakeArena(), arena_r = MakeArena();
    std::vector<Request> mine, ref;
    for (const Prefill& p : prefills) {
      mine.push_back(MakeRequest(arena_p.get(), p, policy));
      ref.push_back(MakeRequest(arena_r.get(), p, policy));
    }
    Split split;
    std::vector<float> logits, half_logits;
    std::vector<absl::Status> statuses, half_statuses;
    for (size_t s = 0; s < schedule.size(); ++s) {
      SCOPED_TRACE("step " + std::to_string(s));
      const std::vector<int>& listed = schedule[s];
      std::vector<StepRequest> batch;
      for (int r : listed) batch.push_back({mine[r].seq.get(), mine[r].attention, mine[r].token});
      ping_pong->Step(batch, &logits, &statuses);
      ASSERT_EQ(statuses.size(), listed.size());
      ASSERT_EQ(logits.size(), listed.size() * vocab);
      split.Update(listed);
      // The reference: each half on its own single pipeline, rows in the caller's order.
      std::map<int, const float*> expected;
      std::array<std::vector<float>, 2> ref_logits;
      std::array<std::vector<int>, 2> ref_rows;
      for (int h = 0; h < 2; ++h) {
        std::vector<StepRequest> half;
        for (int r : listed) {
          if (split.half.at(r) != h) continue;
          half.push_back({ref[r].seq.get(), ref[r].attention, ref[r].token});
          ref_rows[h].push_back(r);
        }
        single[h]->Step(half, &ref_logits[h], &half_statuses);
        for (const absl::Status& st : half_statuses) ASSERT_TRUE(st.ok()) << st;
      }
      for (int h = 0; h < 2; ++h) {
        for (size_t j = 0; j < ref_rows[h].size(); ++j) {
          expected[ref_rows[h][j]] = ref_logits[h].data() + j * vocab;
        }
      }
      for (size_t i = 0; i < listed.size(); ++i) {
        const int r = listed[i];
        ASSERT_TRUE(statuses[i].ok()) << statuses[i];
        EXPECT_EQ(ping_pong->MicroBatchOf(mine[r].attention->id()), split.half.at(r));
        ExpectBitEqual(logits.data() + i * vocab, expected.at(r), vocab,
                       "request " + std::to_string(r));
        const float* row = logits.data() + i * vocab;
        mine[r].token = static_cast<int32_t>(std::max_element(row, row + vocab) - row);
        const float* ref_row = expected.at(r);
        ref[r].token = static_cast<int32_t>(std::max_element(ref_row, ref_row + vocab) - ref_row);
        EXPECT_EQ(mine[r].seq->length(), ref[r].seq->length());
      }
    }
    const HybridCounters c = ping_pong->counters();
    EXPECT_GT(c.resident_rows, 0);
    // fixed_32_0.05 reads 5% of at most ~710 tokens here: fewer than sinks + window, all resident.
    if (std::string(name) != "fixed_32_0.05") {
      EXPECT_GT(c.host_rows, 0);
    }
    EXPECT_GE(c.lane_wait_s, 0);
    EXPECT_GT(ping_pong->pipeline(0).counters().pairs, 0);
    EXPECT_GT(ping_pong->pipeline(1).counters().pairs, 0);
    // Both pipelines' rows, summed.
    EXPECT_EQ(c.resident_rows, single[0]->counters().resident_rows +
                                   single[1]->counters().resident_rows);
    EXPECT_EQ(c.host_rows, single[0]->counters().host_rows + single[1]->counters().host_rows);
  }
}

// StepAndSample: each half samples where its logits are (candidates, not rows, when the samplers
// allow), drawing the tokens the host draws from the whole rows with the same samplers.
TEST_F(PingPongTest, SamplesTheTokensTheHostDrawsFromItsLogits) {
  const std::vector<int64_t> lengths = {260, 700, 400, 150};
  std::vector<Prefill> prefills;
  for (size_t i = 0; i < lengths.size(); ++i) prefills.push_back(MakePrefill(lengths[i], 70 + i));
  const kernels::cpu::CpuPool pool(2);
  const sparse::PolicyConfig policy = *sparse::ParsePolicy("quest", 0.3);
  std::unique_ptr<PingPongStepExecutor> sampling = MakePingPong(&pool), host = MakePingPong(&pool);
  auto arena_s = MakeArena(), arena_h = MakeArena();
  std::vector<Request> mine, ref;
  std::vector<std::unique_ptr<model::Sampler>> mine_samplers, ref_samplers;
  for (size_t i = 0; i < prefills.size(); ++i) {
    mine.push_back(MakeRequest(arena_s.get(), prefills[i], policy));
    ref.push_back(MakeRequest(arena_h.get(), prefills[i], policy));
    // Greedy, top-k, top-p and top-k + top-p, seeded.
    model::SamplingParams params;
    params.temperature = i == 0 ? 0.0 : 0.8;
    params.top_k = i == 1 || i == 3 ? 20 : 0;
    params.top_p = i >= 2 ? 0.9 : 1.0;
    params.seed = 1000 + i;
    mine_samplers.push_back(std::make_unique<model::Sampler>(params));
    ref_samplers.push_back(std::make_unique<model::Sampler>(params));
  }
  const int64_t vocab = model_->config().vocab_size;
  std::vector<int32_t> tokens;
  std::vector<float> logits, ref_logits;
  std::vector<absl::Status> statuses, ref_statuses;
  for (int step = 0; step < 6; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    std::vector<StepRequest> batch, ref_batch;
    for (size_t i = 0; i < mine.size(); ++i) {
      batch.push_back({mine[i].seq.get(), mine[i].attention, mine[i].token,
                       mine_samplers[i].get()});
      ref_batch.push_back({ref[i].seq.get(), ref[i].attention, ref[i].token});
    }
    sampling->StepAndSample(batch, &tokens, &logits, &statuses);
    host->Step(ref_batch, &ref_logits, &ref_statuses);
    for (size_t i = 0; i < mine.size(); ++i) {
      ASSERT_TRUE(statuses[i].ok()) << statuses[i];
      ASSERT_TRUE(ref_statuses[i].ok()) << ref_statuses[i];
      const int32_t want = ref_samplers[i]->Sample(
          absl::MakeConstSpan(ref_logits.data() + i * vocab, vocab));
      EXPECT_EQ(tokens[i], want) << "request " << i;
      mine[i].token = tokens[i];
      ref[i].token = want;
    }
  }
  // The halves drew from candidates (not from rows copied to the host and sampled there).
  EXPECT_GT(sampling->pipeline(0).sampling_counters().candidate_rows, 0);
  EXPECT_GT(sampling->pipeline(1).sampling_counters().candidate_rows, 0);
}

TEST_F(PingPongTest, ARequestsErrorFailsOnlyThatRequest) {
  const kernels::cpu::CpuPool pool(2);
  auto arena = MakeArena();
  const Prefill prefill = MakePrefill(100, 4);
  sparse::PolicyConfig narrow = *sparse::ParsePolicy("quest", 0.3);
  narrow.local_tokens = 32;  // below the window's 64: its plans would miss resident rows
  const sparse::PolicyConfig full = *sparse::ParsePolicy("full", 1.0);
  std::unique_ptr<PingPongStepExecutor> ping_pong = MakePingPong(&pool, /*slots_each=*/1);
  EXPECT_EQ(ping_pong->max_batch(), 2);
  Request a = MakeRequest(arena.get(), prefill, full);
  Request b = MakeRequest(arena.get(), prefill, narrow);  // joins B, refused there
  Request c = MakeRequest(arena.get(), prefill, full);    // no window has room
  std::vector<float> logits;
  std::vector<absl::Status> statuses;
  ping_pong->Step({{a.seq.get(), a.attention, a.token},
                   {b.seq.get(), b.attention, b.token},
                   {c.seq.get(), c.attention, c.token}},
                  &logits, &statuses);
  ASSERT_EQ(statuses.size(), 3u);
  EXPECT_TRUE(statuses[0].ok()) << statuses[0];
  EXPECT_EQ(statuses[1].code(), absl::StatusCode::kFailedPrecondition) << statuses[1];
  EXPECT_EQ(statuses[2].code(), absl::StatusCode::kResourceExhausted) << statuses[2];
  EXPECT_EQ(a.seq->length(), 101);
  EXPECT_EQ(b.seq->length(), 100);
  EXPECT_EQ(c.seq->length(), 100);
  // b ends (as the scheduler would end it): its micro-batch takes c at the next step.
  ping_pong->Step({{a.seq.get(), a.attention, 0}, {c.seq.get(), c.attention, c.token}}, &logits,
                  &statuses);
  EXPECT_TRUE(statuses[0].ok()) << statuses[0];
  EXPECT_TRUE(statuses[1].ok()) << statuses[1];
  EXPECT_EQ(ping_pong->MicroBatchOf(a.attention->id()), 0);
  EXPECT_EQ(ping_pong->MicroBatchOf(c.attention->id()), 1);
  EXPECT_EQ(ping_pong->MicroBatchOf(b.attention->id()), -1);
  EXPECT_EQ(a.seq->length(), 102);
  EXPECT_EQ(c.seq->length(), 101);
}

TEST_F(PingPongTest, AStepOfOneRequestRunsOnOnePipeline) {
  const kernels::cpu::CpuPool pool(2);
  const Prefill prefill = MakePrefill(300, 9);
  const sparse::PolicyConfig policy = *sparse::ParsePolicy("quest", 0.3);
  std::unique_ptr<PingPongStepExecutor> ping_pong = MakePingPong(&pool);
  std::unique_ptr<HybridStepExecutor> single = MakeSingle(&pool);
  auto arena_p = MakeArena(), arena_r = MakeArena();
  Request mine = MakeRequest(arena_p.get(), prefill, policy);
  Request ref = MakeRequest(arena_r.get(), prefill, policy);
  std::vector<float> logits, expected;
  std::vector<absl::Status> statuses, ref_statuses;
  for (int s = 0; s < 3; ++s) {
    ping_pong->Step({{mine.seq.get(), mine.attention, mine.token}}, &logits, &statuses);
    single->Step({{ref.seq.get(), ref.attention, ref.token}}, &expected, &ref_statuses);
    ASSERT_TRUE(statuses[0].ok()) << statuses[0];
    ASSERT_EQ(logits.size(), expected.size());
    ExpectBitEqual(logits.data(), expected.data(), static_cast<int64_t>(logits.size()),
                   "step " + std::to_string(s));
    mine.token = ref.token = static_cast<int32_t>(
        std::max_element(expected.begin(), expected.end()) - expected.begin());
  }
  EXPECT_EQ(ping_pong->MicroBatchOf(mine.attention->id()), 0);
  EXPECT_GT(ping_pong->pipeline(0).counters().pairs, 0);
  EXPECT_EQ(ping_pong->pipeline(1).counters().pairs, 0) << "the empty half never stepped";
  // An empty step gives the slot back.
  ping_pong->Step({}, &logits, &statuses);
  EXPECT_TRUE(statuses.empty());
  EXPECT_EQ(ping_pong->MicroBatchOf(mine.attention->id()), -1);
}

TEST_F(PingPongTest, TheDestructorJoinsItsThreadsWithAndWithoutSteps) {
  const kernels::cpu::CpuPool pool(1);
  { std::unique_ptr<PingPongStepExecutor> idle = MakePingPong(&pool); }
  {
    std::unique_ptr<PingPongStepExecutor> used = MakePingPong(&pool);
    auto arena = MakeArena();
    const Prefill prefill = MakePrefill(80, 3);
    const sparse::PolicyConfig policy = *sparse::ParsePolicy("full", 1.0);
    Request a = MakeRequest(arena.get(), prefill, policy);
    Request b = MakeRequest(arena.get(), prefill, policy);
    std::vector<float> logits;
    std::vector<absl::Status> statuses;
    used->Step({{a.seq.get(), a.attention, a.token}, {b.seq.get(), b.attention, b.token}},
               &logits, &statuses);
    EXPECT_TRUE(statuses[0].ok() && statuses[1].ok());
  }
}

TEST_F(PingPongTest, EachDriverThreadRunsTheInitAndItsErrorFailsItsRequests) {
  const kernels::cpu::CpuPool pool(1);
  std::atomic<int> inits{0};
  PingPongStepExecutor::Options options;
  options.thread_init = [&inits]() -> absl::Status {
    // The second thread to start fails (as a cudaSetDevice could).
    if (inits.fetch_add(1) == 1) return absl::InternalError("no device here");
    return absl::OkStatus();
  };
  auto made = PingPongStepExecutor::Create(model_, MakePipeline(&pool, 2), MakePipeline(&pool, 2),
                                           &pool, options);
  ASSERT_TRUE(made.ok()) << made.status();
  auto arena = MakeArena();
  const Prefill prefill = MakePrefill(80, 3);
  const sparse::PolicyConfig policy = *sparse::ParsePolicy("full", 1.0);
  Request a = MakeRequest(arena.get(), prefill, policy);
  Request b = MakeRequest(arena.get(), prefill, policy);
  std::vector<float> logits;
  std::vector<absl::Status> statuses;
  (*made)->Step({{a.seq.get(), a.attention, a.token}, {b.seq.get(), b.attention, b.token}},
                &logits, &statuses);
  EXPECT_EQ(inits.load(), 2);
  // Exactly one micro-batch's request failed, with the init's error (and the step returned: the
  // failed driver left the CPU lane without a phase).
  const int failed = !statuses[0].ok() + !statuses[1].ok();
  EXPECT_EQ(failed, 1);
  for (const absl::Status& st : statuses) {
    if (st.ok()) continue;
    EXPECT_EQ(st.code(), absl::StatusCode::kInternal);
    EXPECT_NE(st.message().find("no device here"), std::string::npos) << st;
  }
}

// A host DenseOps standing in for a device of its own: its weights are copies it owns.
class OtherDeviceOps : public model::CpuDenseOps {
 public:
  bool host_memory() const override { return false; }
};

TEST_F(PingPongTest, RefusesADenseOpsThatCannotReadTheFirstsWeights) {
  const kernels::cpu::CpuPool pool(1);
  model::CpuDenseOps a, b;
  OtherDeviceOps other;
  EXPECT_TRUE(b.CanUseWeightsOf(a));
  EXPECT_FALSE(other.CanUseWeightsOf(a));
  EXPECT_FALSE(a.CanUseWeightsOf(other));
  PingPongStepExecutor::Pipeline pa = MakePipeline(&pool, 2);
  PingPongStepExecutor::Pipeline pb{std::make_unique<OtherDeviceOps>(), MakeWindow(2)};
  auto made = PingPongStepExecutor::Create(model_, std::move(pa), std::move(pb), &pool);
  EXPECT_EQ(made.status().code(), absl::StatusCode::kInvalidArgument) << made.status();
}

TEST_F(PingPongTest, BorrowedParamsPointAtTheOwnersWeights) {
  model::CpuDenseOps ops;
  auto owner = model_->UploadParams(ops);
  ASSERT_TRUE(owner.ok()) << owner.status();
  const model::ModelParams view = model::BorrowParams(*owner);
  EXPECT_TRUE(view.owned.empty());
  EXPECT_EQ(view.embed.data, owner->embed.data);
  EXPECT_EQ(view.lm_head.data, owner->lm_head.data);
  EXPECT_EQ(view.final_norm, owner->final_norm);
  EXPECT_EQ(view.inv_freq, owner->inv_freq);
  ASSERT_EQ(view.layers.size(), owner->layers.size());
  EXPECT_EQ(view.layers[0].q.weight.data, owner->layers[0].q.weight.data);
  EXPECT_EQ(view.layers.back().down.weight.data, owner->layers.back().down.weight.data);
}

TEST_F(PingPongTest, AnOpenLaneRunsTheHybridAttentionsCpuPhaseOnTheServingThread) {
  // While the lane is open a step cannot finish before some thread serves the lane (its CPU
  // phase runs there); served, the step completes with its usual result. The test waits until
  // the step has handed its CPU phase to the lane (or, wrongly, finished without it).
  const kernels::cpu::CpuPool pool(1);
  auto arena = MakeArena();
  const Prefill prefill = MakePrefill(200, 5);
  Request r = MakeRequest(arena.get(), prefill, *sparse::ParsePolicy("full", 1.0));
  std::unique_ptr<HybridStepExecutor> hybrid = MakeSingle(&pool);
  CpuLane lane;
  hybrid->set_cpu_lane(&lane);
  lane.Open(1);
  std::atomic<bool> done{false};
  std::vector<float> logits;
  std::vector<absl::Status> statuses;
  std::thread step([&] {
    hybrid->Step({{r.seq.get(), r.attention, r.token}}, &logits, &statuses);
    done = true;
    lane.Leave();
  });
  ASSERT_TRUE(WaitFor([&] { return lane.queued() == 1 || done.load(); }));
  EXPECT_FALSE(done.load()) << "the step finished without the lane";
  EXPECT_EQ(lane.queued(), 1);
  lane.Serve();
  step.join();
  EXPECT_TRUE(done.load());
  ASSERT_EQ(statuses.size(), 1u);
  EXPECT_TRUE(statuses[0].ok()) << statuses[0];
  EXPECT_EQ(r.seq->length(), 201);
  EXPECT_GT(hybrid->counters().lane_wait_s, 0);
  // Closed again, a step runs its CPU phase on its own thread.
  hybrid->Step({{r.seq.get(), r.attention, r.token}}, &logits, &statuses);
  EXPECT_TRUE(statuses[0].ok()) << statuses[0];
  EXPECT_EQ(r.seq->length(), 202);
}

TEST(CpuLaneTest, AClosedLaneRunsAtOnceOnTheCallingThread) {
  CpuLane lane;
  std::thread::id ran;
  const absl::Status s = lane.Run([&] {
    ran = std::this_thread::get_id();
    return absl::DataLossError("returned as is");
  });
  EXPECT_EQ(ran, std::this_thread::get_id());
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
}

TEST(CpuLaneTest, AnOpenLaneRunsEverySubmittersFunctionsOnTheServingThreadOneAtATimeInOrder) {
  CpuLane lane;
  // Guarded by the lane itself: only the serving thread touches them.
  int inside = 0, most = 0, total = 0;
  std::set<std::thread::id> runners;
  std::array<std::vector<int>, 3> order;  // each submitter's calls, in the order they ran
  lane.Open(3);
  auto work = [&](int caller) {
    for (int i = 0; i < 2000; ++i) {
      const absl::Status s = lane.Run([&, i] {
        most = std::max(most, ++inside);
        ++total;
        runners.insert(std::this_thread::get_id());
        order[caller].push_back(i);
        --inside;
        return i == 1999 ? absl::CancelledError("the last") : absl::OkStatus();
      });
      EXPECT_EQ(s.ok(), i != 1999) << s;
    }
    lane.Leave();
  };
  std::thread t0(work, 0), t1(work, 1), t2(work, 2);
  lane.Serve();  // returns once all three have left
  EXPECT_EQ(total, 6000);
  t0.join();
  t1.join();
  t2.join();
  EXPECT_EQ(most, 1);
  ASSERT_EQ(runners.size(), 1u);
  EXPECT_EQ(*runners.begin(), std::this_thread::get_id());
  for (const std::vector<int>& calls : order) {
    ASSERT_EQ(calls.size(), 2000u);
    EXPECT_TRUE(std::is_sorted(calls.begin(), calls.end()));
  }
}

}  // namespace
}  // namespace fluxion::decode

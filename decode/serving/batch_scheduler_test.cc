// The continuous-batching loop with its step executors, in process, on a random tiny model over
// real host pages: the batched CPU executor gives the per-request loop's greedy tokens, the
// preemption rule holds when several requests start a page in the same step, and an executor's
// failure ends exactly the requests it concerns.
#include "decode/serving/batch_scheduler.h"

#include <filesystem>
#include <random>

#include <unistd.h>

#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/notification.h"
#include "decode/kv/kv_admission.h"
#include "decode/step/hybrid_step_executor.h"
#include "decode/step/ping_pong_step_executor.h"
#include "decode/kv/kv_arena.h"
#include "decode/step/resident_window.h"
#include "decode/sparse/policy.h"
#include "gtest/gtest.h"
#include "model/cpu_dense_ops.h"
#include "model/dense_attention.h"
#include "model/random_model.h"

namespace fluxion::decode {
namespace {

constexpr int64_t kPageTokens = 16;

class BatchSchedulerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/batch_scheduler_test_" + std::to_string(getpid());
    ASSERT_TRUE(model::WriteRandomModel(*model::PresetConfig("tiny"), 11, dir_).ok());
    model_ = std::move(*model::Model::Load(dir_));
    shape_ = model_->attention_shape();
    growth_pages_ = shape_.num_layers * shape_.num_kv_heads;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  void MakeArena(int64_t pages) {
    arena_ = std::move(*KvArena::Create(
        KvShape{shape_.num_layers, shape_.num_kv_heads, shape_.head_dim, kPageTokens}
            .page_bytes(),
        pages));
    admission_ = std::make_unique<KvAdmission>(arena_.get(), KvAdmissionOptions{});
  }

  // Prefills `prompt` on the dense cache, moves it into host pages under `full`, and makes the
  // request with its first token sampled greedily.
  std::shared_ptr<DecodeRequest> MakeRequest(const std::vector<int32_t>& prompt,
                                             int64_t max_tokens, uint64_t admission_seq) {
    auto dense = std::make_unique<model::DenseAttention>(shape_);
    const model::DenseAttention* prefilled = dense.get();
    model::Sequence seq(std::move(dense));
    std::vector<float> logits;
    EXPECT_TRUE(model_->Forward(seq, prompt, &logits).ok());
    auto attention = SparseAttention::FromDense(arena_.get(), shape_, kPageTokens, *prefilled,
                                                *sparse::ParsePolicy("full", 1.0));
    EXPECT_TRUE(attention.ok()) << attention.status();
    auto r = std::make_shared<DecodeRequest>();
    r->id = "r" + std::to_string(admission_seq);
    r->admission_seq = admission_seq;
    r->attention = attention->get();
    r->seq = std::make_unique<model::Sequence>(std::move(*attention), seq.length());
    r->sampler.emplace(model::SamplingParams{});
    r->max_tokens = max_tokens;
    r->last_token = r->sampler->Sample(logits);
    AcceptToken(*r, r->last_token);
    return r;
  }

  static std::vector<int32_t> Prompt(int64_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<int32_t> p(n);
    for (auto& t : p) t = static_cast<int32_t>(rng() % 256);
    return p;
  }

  // Joins every request into the same first step and waits (up to a minute: a loaded CI box)
  // until all have finished.
  static void RunToEnd(BatchScheduler& scheduler,
                       const std::vector<std::shared_ptr<DecodeRequest>>& requests) {
    scheduler.JoinAll(requests);
    WaitForEnd(requests);
  }

  // Waits (up to a minute: a loaded CI box) until every request has finished.
  static void WaitForEnd(const std::vector<std::shared_ptr<DecodeRequest>>& requests) {
    const absl::Time deadline = absl::Now() + absl::Minutes(1);
    for (auto& r : requests) {
      absl::MutexLock lock(&r->mu);
      auto done = [&r]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu) {
        return r->finish != Finish::kNone;
      };
      ASSERT_TRUE(r->mu.AwaitWithDeadline(absl::Condition(&done), deadline)) << r->id;
    }
  }

  static std::vector<int32_t> Tokens(DecodeRequest& r) {
    absl::MutexLock lock(&r.mu);
    return r.pending;
  }

  std::string dir_;
  std::unique_ptr<model::Model> model_;
  model::AttentionShape shape_;
  int64_t growth_pages_ = 0;
  std::unique_ptr<KvArena> arena_;
  std::unique_ptr<KvAdmission> admission_;
};

TEST_F(BatchSchedulerTest, BatchedStepGivesThePerRequestLoopsGreedyTokens) {
  const std::vector<int64_t> lengths = {50, 100, 150, 33};
  std::vector<std::vector<int32_t>> tokens[2];
  for (int batched = 0; batched < 2; ++batched) {
    MakeArena(growth_pages_ * 64);
    std::unique_ptr<StepExecutor> executor =
        batched ? NewCpuStepExecutor(model_.get()) : NewPerRequestStepExecutor(model_.get());
    std::vector<std::shared_ptr<DecodeRequest>> requests;
    for (size_t i = 0; i < lengths.size(); ++i) {
      requests.push_back(MakeRequest(Prompt(lengths[i], 7 + i), 20, i));
    }
    {
      BatchScheduler scheduler(model_.get(), admission_.get(), growth_pages_, kPageTokens,
                               nullptr, executor.get());
      RunToEnd(scheduler, requests);
    }
    for (auto& r : requests) {
      absl::MutexLock lock(&r->mu);
      EXPECT_EQ(r->finish, Finish::kLength) << r->id << ": " << r->error;
      tokens[batched].push_back(r->pending);
    }
    EXPECT_EQ(arena_->counters().reserved, 0);
  }
  EXPECT_EQ(tokens[0], tokens[1]);
  for (const auto& t : tokens[1]) EXPECT_EQ(t.size(), 20u);
}

TEST_F(BatchSchedulerTest, TheHybridStepInTheLoopGivesThePerRequestLoopsGreedyTokens) {
  // The serving loop over the hybrid executor (here with its device half's host stand-in: CPU
  // dense ops and the host resident window; on a GPU `fluxion decode --device cuda` runs the same
  // executor over CUDA), with requests joining mid-stream and prompts past sinks + window.
  // With a window of 2 slots the third request waits for a slot (the scheduler keeps the batch
  // within the executor's max_batch) instead of failing.
  const std::vector<int64_t> lengths = {150, 90, 260};
  // hybrid 3: the ping-pong executor over two such pipelines of one slot each (the third request
  // waits for a slot there too).
  std::vector<std::vector<int32_t>> tokens[4];
  for (int hybrid = 0; hybrid < 4; ++hybrid) {
    SCOPED_TRACE(hybrid);
    MakeArena(growth_pages_ * 128);
    std::unique_ptr<StepExecutor> executor;
    if (hybrid == 3) {
      const WindowShape w = WindowShapeFor(shape_, 1);
      auto made = PingPongStepExecutor::Create(
          model_.get(),
          {std::make_unique<model::CpuDenseOps>(), *NewHostResidentWindow(w, kPageTokens)},
          {std::make_unique<model::CpuDenseOps>(), *NewHostResidentWindow(w, kPageTokens)},
          nullptr);
      ASSERT_TRUE(made.ok()) << made.status();
      executor = std::move(*made);
    } else if (hybrid) {
      const WindowShape w = WindowShapeFor(shape_, hybrid == 1 ? 4 : 2);
      auto made = HybridStepExecutor::Create(model_.get(), std::make_unique<model::CpuDenseOps>(),
                                             *NewHostResidentWindow(w, kPageTokens), nullptr);
      ASSERT_TRUE(made.ok()) << made.status();
      executor = std::move(*made);
    } else {
      executor = NewPerRequestStepExecutor(model_.get());
    }
    std::vector<std::shared_ptr<DecodeRequest>> requests;
    for (size_t i = 0; i < lengths.size(); ++i) {
      requests.push_back(MakeRequest(Prompt(lengths[i], 40 + i), 12 + 4 * i, i));
    }
    {
      BatchScheduler scheduler(model_.get(), admission_.get(), growth_pages_, kPageTokens,
                               nullptr, executor.get());
      scheduler.Join(requests[0]);
      RunToEnd(scheduler, {requests[1], requests[2]});
      WaitForEnd({requests[0]});
    }
    for (auto& r : requests) {
      absl::MutexLock lock(&r->mu);
      EXPECT_EQ(r->finish, Finish::kLength) << r->id << ": " << r->error;
      tokens[hybrid].push_back(r->pending);
    }
    EXPECT_EQ(arena_->counters().reserved, 0);
  }
  EXPECT_EQ(tokens[0], tokens[1]);
  EXPECT_EQ(tokens[0], tokens[2]);
  EXPECT_EQ(tokens[0], tokens[3]);
}

// The inner executor, whose first step waits until the test opens the gate.
class GatedExecutor : public StepExecutor {
 public:
  explicit GatedExecutor(StepExecutor* inner) : inner_(inner) {}
  absl::string_view name() const override { return "gated"; }
  int64_t max_batch() const override { return inner_->max_batch(); }
  void Step(absl::Span<const StepRequest> batch, std::vector<float>* logits,
            std::vector<absl::Status>* statuses) override {
    if (!entered_.HasBeenNotified()) entered_.Notify();
    open_.WaitForNotification();
    inner_->Step(batch, logits, statuses);
  }
  absl::Notification entered_, open_;

 private:
  StepExecutor* const inner_;
};

TEST_F(BatchSchedulerTest, ARequestWaitingForAWindowSlotWaitsAndCanBeAborted) {
  MakeArena(growth_pages_ * 128);
  const WindowShape w = WindowShapeFor(shape_, 1);
  auto made = HybridStepExecutor::Create(model_.get(), std::make_unique<model::CpuDenseOps>(),
                                         *NewHostResidentWindow(w, kPageTokens), nullptr);
  ASSERT_TRUE(made.ok()) << made.status();
  GatedExecutor gated(made->get());
  auto running = MakeRequest(Prompt(90, 7), 6, 1);
  auto waiting = MakeRequest(Prompt(90, 8), 6, 2);
  {
    BatchScheduler scheduler(model_.get(), admission_.get(), growth_pages_, kPageTokens,
                             nullptr, &gated);
    scheduler.JoinAll({running, waiting});
    // The first step holds the one slot; the other request waits for it instead of failing.
    gated.entered_.WaitForNotification();
    EXPECT_EQ(scheduler.running(), 1);
    waiting->abort = true;
    gated.open_.Notify();
    WaitForEnd({running, waiting});
  }
  {
    absl::MutexLock lock(&running->mu);
    EXPECT_EQ(running->finish, Finish::kLength) << running->error;
  }
  absl::MutexLock lock(&waiting->mu);
  EXPECT_EQ(waiting->finish, Finish::kAbort) << waiting->error;
  EXPECT_EQ(arena_->counters().reserved, 0);
}

// The inner executor with `places` reservations (as the hybrid executor's device-selection
// places) and a record of every step's batch size.
class ReservingExecutor : public StepExecutor {
 public:
  ReservingExecutor(StepExecutor* inner, int64_t places) : inner_(inner), places_(places) {}
  absl::string_view name() const override { return "reserving"; }
  bool Reserve(const SparseAttention& attention) override {
    if (holders_.contains(attention.id())) return true;
    if (static_cast<int64_t>(holders_.size()) >= places_) return false;
    holders_.insert(attention.id());
    return true;
  }
  void Forget(const SparseAttention& attention) override { holders_.erase(attention.id()); }
  void Step(absl::Span<const StepRequest> batch, std::vector<float>* logits,
            std::vector<absl::Status>* statuses) override {
    largest_batch_ = std::max<int64_t>(largest_batch_, static_cast<int64_t>(batch.size()));
    inner_->Step(batch, logits, statuses);
  }
  int64_t largest_batch_ = 0;  // read after the scheduler stopped

 private:
  StepExecutor* const inner_;
  const int64_t places_;
  absl::flat_hash_set<uint64_t> holders_;
};

TEST_F(BatchSchedulerTest, ARequestTheExecutorCannotReserveForWaitsWithThoseBehindIt) {
  // One place: the three requests decode one after another, never two in a step, and each
  // reservation goes back when its request ends.
  MakeArena(growth_pages_ * 128);
  std::unique_ptr<StepExecutor> cpu = NewCpuStepExecutor(model_.get(), nullptr);
  ReservingExecutor reserving(cpu.get(), 1);
  std::vector<std::shared_ptr<DecodeRequest>> requests;
  for (uint64_t i = 1; i <= 3; ++i) requests.push_back(MakeRequest(Prompt(40, 20 + i), 4, i));
  {
    BatchScheduler scheduler(model_.get(), admission_.get(), growth_pages_, kPageTokens,
                             nullptr, &reserving);
    RunToEnd(scheduler, requests);
  }
  for (auto& r : requests) {
    absl::MutexLock lock(&r->mu);
    EXPECT_EQ(r->finish, Finish::kLength) << r->id << ": " << r->error;
  }
  EXPECT_EQ(reserving.largest_batch_, 1);
  EXPECT_EQ(arena_->counters().reserved, 0);
}

TEST_F(BatchSchedulerTest, RequestsStartingAPageInOneStepPreemptTheYoungestFirst) {
  // Two prompts of 32 tokens join the same first step, where both start a new page. Pages for
  // the prompts plus exactly one request's growth: the younger request must be preempted before
  // the step (checking each request against the free pages alone lets both through, and the
  // batched step then runs out of pages for every request of the batch).
  const int64_t prompt_pages = growth_pages_ * (32 / kPageTokens);
  MakeArena(2 * prompt_pages + growth_pages_);
  auto older = MakeRequest(Prompt(32, 1), 4, 1);
  auto younger = MakeRequest(Prompt(32, 2), 4, 2);
  {
    BatchScheduler scheduler(model_.get(), admission_.get(), growth_pages_, kPageTokens);
    RunToEnd(scheduler, {older, younger});
    EXPECT_EQ(scheduler.preempted(), 1u);
  }
  {
    absl::MutexLock lock(&older->mu);
    EXPECT_EQ(older->finish, Finish::kLength) << older->error;
    EXPECT_EQ(older->pending.size(), 4u);
  }
  absl::MutexLock lock(&younger->mu);
  EXPECT_EQ(younger->finish, Finish::kError);
  EXPECT_EQ(younger->error.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(younger->error.message().find("preempted"), std::string::npos);
  EXPECT_TRUE(younger->preempted);
  EXPECT_TRUE(younger->resumable);  // the older one ran beside it: its pages come back
}

TEST_F(BatchSchedulerTest, ARequestThatOutgrowsTheArenaAloneIsNotResumable) {
  // Room for the prompt and nothing more: the request's first new page can never fit.
  MakeArena(growth_pages_ * (32 / kPageTokens));
  auto alone = MakeRequest(Prompt(32, 1), 4, 1);
  {
    BatchScheduler scheduler(model_.get(), admission_.get(), growth_pages_, kPageTokens);
    RunToEnd(scheduler, {alone});
  }
  absl::MutexLock lock(&alone->mu);
  EXPECT_EQ(alone->finish, Finish::kError);
  EXPECT_EQ(alone->error.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(alone->error.message().find("outgrew"), std::string::npos) << alone->error;
  EXPECT_TRUE(alone->preempted);
  EXPECT_FALSE(alone->resumable);
}

// Runs the batch; in its first step it fails request `fail` (every request when -1) with Internal.
class FailingExecutor : public StepExecutor {
 public:
  FailingExecutor(const model::Model* model, int64_t fail)
      : inner_(NewCpuStepExecutor(model)), fail_(fail) {}
  absl::string_view name() const override { return "failing"; }
  void Step(absl::Span<const StepRequest> batch, std::vector<float>* logits,
            std::vector<absl::Status>* statuses) override {
    inner_->Step(batch, logits, statuses);
    for (size_t i = 0; i < statuses->size() && first_; ++i) {
      if (fail_ < 0 || static_cast<int64_t>(i) == fail_) {
        (*statuses)[i] = absl::InternalError("injected");
      }
    }
    first_ = false;
  }

 private:
  std::unique_ptr<StepExecutor> inner_;
  const int64_t fail_;
  bool first_ = true;
};

TEST_F(BatchSchedulerTest, AnExecutorFailureEndsTheRequestsItConcernsAndFreesTheirPages) {
  for (int64_t fail : {int64_t{0}, int64_t{-1}}) {
    MakeArena(growth_pages_ * 64);
    FailingExecutor executor(model_.get(), fail);
    auto a = MakeRequest(Prompt(40, 3), 6, 1);
    auto b = MakeRequest(Prompt(60, 4), 6, 2);
    {
      BatchScheduler scheduler(model_.get(), admission_.get(), growth_pages_, kPageTokens,
                               nullptr, &executor);
      RunToEnd(scheduler, {a, b});
    }
    {
      absl::MutexLock lock(&a->mu);
      EXPECT_EQ(a->finish, Finish::kError);
      EXPECT_EQ(a->error.code(), absl::StatusCode::kInternal);
      EXPECT_NE(a->error.message().find("decode step failed: injected"), std::string::npos);
    }
    {
      absl::MutexLock lock(&b->mu);
      EXPECT_EQ(b->finish, fail < 0 ? Finish::kError : Finish::kLength) << fail;
    }
    EXPECT_EQ(arena_->counters().reserved, 0) << fail;
  }
}

}  // namespace
}  // namespace fluxion::decode

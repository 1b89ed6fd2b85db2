// The batched CPU executor (one attention problem per layer for the whole batch, built from the
// policies' plans) against the per-request loop (each request's SparseAttention::Forward), for
// every policy, over real host pages of a random tiny model: the same greedy tokens, logits equal
// up to the products' blocking, and every policy spending exactly the same rows.
#include "decode/step_executor.h"

#include <filesystem>
#include <random>

#include <unistd.h>

#include "decode/kv_arena.h"
#include "decode/paged_batch_attention.h"
#include "decode/sparse/policy.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_pool.h"
#include "model/dense_attention.h"
#include "model/random_model.h"

namespace fluxion::decode {
namespace {

constexpr int64_t kPageTokens = 16;
constexpr int64_t kTailQueries = 32;  // what LFPS / Fluxion capture from the prefill

class StepExecutorTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(::testing::TempDir() + "/step_executor_test_" +
                           std::to_string(getpid()));
    ASSERT_TRUE(model::WriteRandomModel(*model::PresetConfig("tiny"), 5, *dir_).ok());
    model_ = model::Model::Load(*dir_)->release();
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*dir_);
    delete model_;
    delete dir_;
  }

  struct Request {
    std::unique_ptr<model::Sequence> seq;
    SparseAttention* attention = nullptr;
    int32_t token = 0;
  };

  struct Prefill {
    std::unique_ptr<model::DenseAttention> cache;
    int32_t first_token = 0;
  };

  // The prompt prefilled on the dense cache, recording its tail queries; its first token greedy.
  static Prefill MakePrefill(const std::vector<int32_t>& prompt) {
    Prefill p;
    auto dense = std::make_unique<model::DenseAttention>(model_->attention_shape());
    const int64_t n = static_cast<int64_t>(prompt.size());
    dense->RecordQueries(std::max<int64_t>(0, n - kTailQueries), n);
    model::DenseAttention* raw = dense.get();
    model::Sequence seq(std::move(dense));
    std::vector<float> logits;
    EXPECT_TRUE(model_->Forward(seq, prompt, &logits).ok());
    p.cache = std::make_unique<model::DenseAttention>(*raw);
    p.first_token = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) -
                                         logits.begin());
    return p;
  }

  // `prefill` moved into pages of `arena` under `policy`.
  static Request MakeRequest(KvArena* arena, const Prefill& prefill,
                             const sparse::PolicyConfig& policy) {
    const model::AttentionShape shape = model_->attention_shape();
    auto attention =
        SparseAttention::FromDense(arena, shape, kPageTokens, *prefill.cache, policy);
    EXPECT_TRUE(attention.ok()) << attention.status();
    Request r;
    r.attention = attention->get();
    r.seq = std::make_unique<model::Sequence>(std::move(*attention), prefill.cache->length(0));
    r.token = prefill.first_token;
    return r;
  }

  static std::vector<int32_t> Prompt(int64_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<int32_t> p(n);
    for (auto& t : p) t = static_cast<int32_t>(rng() % 256);
    return p;
  }

  struct Run {
    std::vector<std::vector<int32_t>> tokens;  // [request][step]
    std::vector<std::vector<float>> logits;    // [step][batch * vocab]
    std::vector<int64_t> rows_attended;        // [request]
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
    }
    return run;
  }

  static std::string* dir_;
  static model::Model* model_;
};

std::string* StepExecutorTest::dir_ = nullptr;
model::Model* StepExecutorTest::model_ = nullptr;

TEST_F(StepExecutorTest, EveryPolicyDecodesTheBatchAsThePerRequestLoopDoes) {
  // 700 rows exceed the CPU backend's piece size (512): the long request is split and merged.
  // At budget 0.3 every context here leaves the policies middle rows to choose (0.3 x 260 > the
  // 68 rows of sinks + window).
  std::vector<Prefill> prefills;
  for (int64_t n : {260, 700, 400}) prefills.push_back(MakePrefill(Prompt(n, 100 + n)));
  const kernels::cpu::CpuPool pool(2);
  std::vector<std::string> names = {"fixed_32_0.3"};
  for (const std::string& n : sparse::PolicyNames()) {
    if (n.rfind("fixed_", 0) != 0) names.push_back(n);
  }
  for (const std::string& name : names) {
    SCOPED_TRACE(name);
    const sparse::PolicyConfig policy = *sparse::ParsePolicy(name, 0.3);
    std::unique_ptr<StepExecutor> batched = NewCpuStepExecutor(model_, &pool);
    std::unique_ptr<StepExecutor> loop = NewPerRequestStepExecutor(model_);
    const Run a = Decode(*batched, policy, prefills, 6);
    const Run b = Decode(*loop, policy, prefills, 6);
    EXPECT_EQ(a.tokens, b.tokens);
    EXPECT_EQ(a.rows_attended, b.rows_attended);
    for (size_t s = 0; s < a.logits.size(); ++s) {
      ASSERT_EQ(a.logits[s].size(), b.logits[s].size());
      float worst = 0;
      for (size_t j = 0; j < a.logits[s].size(); ++j) {
        worst = std::max(worst, std::abs(a.logits[s][j] - b.logits[s][j]));
      }
      // A GEMM over the batch's rows instead of one GEMV per request, and split-KV's merge:
      // float rounding only.
      EXPECT_LT(worst, 1e-3f) << "step " << s;
    }
  }
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

// The disaggregated pair end to end: real `fluxion prefill` and `fluxion decode` processes, real
// gRPC, real UCX (TCP on loopback, and shared memory), the trained tiny model. Checks that served
// tokens equal single-process generation under `full`, that requests batch with different
// policies, and the failure behaviour of issue 6: bad arguments, client cancellation, Abort, a
// prefill node killed mid-transfer, an incompatible prefill node, preemption. After every test
// the decode node's page counters are back at their start.
//
// No test asserts how fast something happened: each waits for the state it needs (a load report,
// a metric) with a generous deadline and checks what happened and in which order. Where a test
// needs something to last, a fault-injection flag gives it a lower bound no machine beats: the
// prefill node sleeps after each layer (--test-layer-delay-ms), the decode node after each step
// (--test-step-delay-ms).
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "decode/kv/kv_arena.h"
#include "decode/kv/paged_kv.h"
#include "decode/sparse/policy.h"
#include "common/metrics_testing.h"
#include "decode/step/sparse_attention.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "model/generator.h"
#include "model/model.h"
#include "tests/serving_cluster.h"

namespace fluxion::testing {
namespace {

using ::testing::HasSubstr;

namespace v1 = ::fluxion::v1;

const std::string kPromptText =
    "The key to the blue vault is 4417. Remember it. The weather today is mild and the river is "
    "calm. The key to the blue vault is";

// One prefill + one decode node on a UCX configuration, shared by the tests that use it.
struct Pair {
  std::unique_ptr<ServerProcess> prefill, decode;
  std::unique_ptr<DecodeClient> client;
};

Pair* PairFor(const std::string& tls) {
  // Destroyed at exit, which kills the servers (and they die with us anyway: PR_SET_PDEATHSIG).
  static std::map<std::string, std::unique_ptr<Pair>> pairs;
  auto& slot = pairs[tls];
  if (slot != nullptr) return slot.get();
  auto pair = std::make_unique<Pair>();
  std::vector<std::string> ucx = UcxArgs(tls);
  std::vector<std::string> pargs = {"--model", TinyModelDir()};
  pargs.insert(pargs.end(), ucx.begin(), ucx.end());
  pair->prefill = ServerProcess::Start("prefill", pargs);
  if (pair->prefill == nullptr) return nullptr;
  // 3 ms after every decode step: a request that is not stopped keeps its pages for at least
  // 3 ms a token (20000 tokens: a minute), so a test that waits for the pages to come back cannot
  // pass because the request ended by itself.
  std::vector<std::string> dargs = {"--model", TinyModelDir(), "--kv-pages", "4096",
                                    "--prefill-address", pair->prefill->address(),
                                    "--quarantine-ms", "1000", "--admission-timeout-ms", "500",
                                    "--nohuge-pages", "--test-step-delay-ms", "3"};
  dargs.insert(dargs.end(), ucx.begin(), ucx.end());
  pair->decode = ServerProcess::Start("decode", dargs);
  if (pair->decode == nullptr) return nullptr;
  pair->client = std::make_unique<DecodeClient>(pair->decode->address());
  slot = std::move(pair);
  return slot.get();
}

const model::Model& TinyModel() {
  static const model::Model* m = [] {
    kernels::cpu::SetNumThreads(1);
    auto loaded = model::Model::Load(TinyModelDir());
    if (!loaded.ok()) {
      ADD_FAILURE() << loaded.status();
      return static_cast<model::Model*>(nullptr);
    }
    return loaded->release();
  }();
  return *m;
}

std::vector<int32_t> Ints(const std::vector<uint32_t>& v) { return {v.begin(), v.end()}; }

// Single-process generation with the decode node's `full` path: prompt K/V in bf16 host pages.
std::vector<uint32_t> ReferenceTokens(const std::vector<uint32_t>& prompt, int64_t max_tokens,
                                      bool paged, const model::SamplingParams& sampling = {}) {
  const model::Model& m = TinyModel();
  model::GenerationOptions options;
  options.sampling = sampling;
  options.max_tokens = max_tokens;
  options.ignore_eos = true;
  const model::AttentionShape shape = m.attention_shape();
  auto arena = decode::KvArena::Create(
      decode::KvShape{shape.num_layers, shape.num_kv_heads, shape.head_dim, 16}.page_bytes(), 4096);
  EXPECT_TRUE(arena.ok());
  if (paged) {
    options.decode_attention = [&](const model::DenseAttention& prefilled)
        -> absl::StatusOr<std::unique_ptr<model::SequenceAttention>> {
      decode::sparse::PolicyConfig full;
      auto a = decode::SparseAttention::FromDense(arena->get(), shape, 16, prefilled, full);
      if (!a.ok()) return a.status();
      return std::unique_ptr<model::SequenceAttention>(std::move(*a));
    };
  }
  auto result = model::Generate(m, Ints(prompt), options);
  EXPECT_TRUE(result.ok()) << result.status();
  std::vector<uint32_t> out;
  if (result.ok()) out.assign(result->tokens.begin(), result->tokens.end());
  return out;
}

// Logit of `a` minus logit of `b` after `context` (fp32 model, full attention).
float LogitMargin(const std::vector<uint32_t>& context, uint32_t a, uint32_t b) {
  const model::Model& m = TinyModel();
  auto seq = m.NewSequence();
  std::vector<float> logits;
  EXPECT_TRUE(m.Forward(*seq, Ints(context), &logits).ok());
  return logits[a] - logits[b];
}

// No reservation of `decode` was ever held for the quarantine lease, and none is held now.
void ExpectNothingQuarantined(const ServerProcess& decode) {
  double held = 0;
  for (const char* reason : {"no_reply", "abort_unanswered", "peer_gave_up"}) {
    const double v = MetricOf(
        decode, absl::StrCat("fluxion_kv_quarantined_reservations_total{reason=\"", reason, "\"}"));
    if (!std::isnan(v)) held += v;
  }
  EXPECT_EQ(held, 0) << "reservations were quarantined";
  EXPECT_EQ(MetricOf(decode, "fluxion_kv_pages_quarantined"), 0);
}

void ExpectAllPagesFree(DecodeClient& client) {
  const v1::DecodeLoad load = client.WaitAllPagesFree();
  EXPECT_EQ(load.free_kv_pages(), load.total_kv_pages()) << "pages did not come back";
  EXPECT_GT(load.total_kv_pages(), 0u);
}

class ServingTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    pair_ = PairFor(GetParam());
    ASSERT_NE(pair_, nullptr) << "could not start the servers";
    ExpectAllPagesFree(*pair_->client);
  }
  void TearDown() override {
    if (pair_ != nullptr) ExpectAllPagesFree(*pair_->client);
  }
  Pair* pair_ = nullptr;
};

TEST_P(ServingTest, FullPolicyMatchesSingleProcessGeneration) {
  const std::vector<uint32_t> prompt = BytePrompt(kPromptText);
  GenerateResult r = pair_->client->Generate(GreedyRequest("full-1", prompt, 24, "full", ""));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  ASSERT_TRUE(r.has_complete);
  EXPECT_EQ(r.complete.finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(r.complete.usage().completion_tokens(), 24u);
  EXPECT_EQ(r.complete.usage().prompt_tokens(), prompt.size());
  EXPECT_EQ(r.complete.sparse_policy(), "full");
  EXPECT_GT(r.complete.timing().ttft_us(), 0u);
  EXPECT_GT(r.complete.timing().transfer_us(), 0u);
  // The same computation in one process (bf16 host pages, full attention): identical tokens.
  EXPECT_EQ(r.tokens, ReferenceTokens(prompt, 24, /*paged=*/true));
  // Against the model's own fp32 cache: equal, or the first difference is a near-tie.
  const std::vector<uint32_t> fp32 = ReferenceTokens(prompt, 24, /*paged=*/false);
  auto diff = std::mismatch(r.tokens.begin(), r.tokens.end(), fp32.begin(), fp32.end());
  if (diff.first != r.tokens.end()) {
    const size_t i = diff.first - r.tokens.begin();
    std::vector<uint32_t> context = prompt;
    context.insert(context.end(), r.tokens.begin(), r.tokens.begin() + i);
    const float margin = LogitMargin(context, fp32[i], r.tokens[i]);
    std::cout << "first difference from fp32 at token " << i << ", logit margin " << margin << "\n";
    EXPECT_LT(margin, 1e-3f) << "a real divergence from single-process generation";
  }
}

TEST_P(ServingTest, SeededSamplingMatchesSingleProcessGeneration) {
  const std::vector<uint32_t> prompt = BytePrompt(kPromptText);
  v1::GenerateRequest request = GreedyRequest("seeded", prompt, 24, "full", "");
  request.mutable_sampling()->set_temperature(0.8f);
  request.mutable_sampling()->set_top_k(20);
  request.mutable_sampling()->set_seed(1234);
  GenerateResult r = pair_->client->Generate(request);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  model::SamplingParams sampling{0.8, 20, 1.0, 1234};
  EXPECT_EQ(r.tokens, ReferenceTokens(prompt, 24, /*paged=*/true, sampling));
}

TEST_P(ServingTest, RequestsWithDifferentPoliciesBatchTogether) {
  const std::vector<uint32_t> prompt = BytePrompt(kPromptText);
  const std::vector<std::string> policies = {"full", "", "lfps", "quest"};
  std::vector<GenerateResult> results(policies.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < policies.size(); ++i) {
    threads.emplace_back([&, i] {
      results[i] = pair_->client->Generate(
          GreedyRequest("batch-" + std::to_string(i), prompt, 32, policies[i], ""));
    });
  }
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < policies.size(); ++i) {
    ASSERT_TRUE(results[i].status.ok()) << policies[i] << ": " << results[i].status.error_message();
    ASSERT_TRUE(results[i].has_complete);
    EXPECT_EQ(results[i].tokens.size(), 32u) << policies[i];
  }
  EXPECT_EQ(results[0].tokens, ReferenceTokens(prompt, 32, /*paged=*/true));
  EXPECT_EQ(results[1].complete.sparse_policy(), "fluxion@0.1");  // the node's default
  EXPECT_LE(results[1].complete.read_fraction(), 1.0f);
}

INSTANTIATE_TEST_SUITE_P(Ucx, ServingTest, ::testing::Values("tcp", "sm"),
                         [](const auto& info) { return info.param; });

// Failure behaviour, over TCP (the configuration with UCX peer-error handling).
class ServingFailureTest : public ::testing::Test {
 protected:
  void SetUp() override {
    pair_ = PairFor("tcp");
    ASSERT_NE(pair_, nullptr) << "could not start the servers";
    ExpectAllPagesFree(*pair_->client);
  }
  void TearDown() override {
    if (pair_ != nullptr) ExpectAllPagesFree(*pair_->client);
    if (trusting_ != nullptr) ExpectAllPagesFree(*trusting_->client);
    trusting_.reset();
  }
  // A decode node like the shared one that also trusts `prefill` (its --prefill-address lists the
  // shared prefill node first, then `prefill`), so that requests may name `prefill`: a decode node
  // refuses prefill addresses outside its configuration (docs/SECURITY.md). One per test.
  DecodeClient& Trusting(const ServerProcess& prefill) {
    auto node = std::make_unique<Pair>();
    std::vector<std::string> args = {
        "--model", TinyModelDir(), "--kv-pages", "4096", "--prefill-address",
        absl::StrCat(pair_->prefill->address(), ",", prefill.address()), "--quarantine-ms", "1000",
        "--admission-timeout-ms", "500", "--nohuge-pages", "--test-step-delay-ms", "3"};
    std::vector<std::string> ucx = UcxArgs("tcp");
    args.insert(args.end(), ucx.begin(), ucx.end());
    node->decode = ServerProcess::Start("decode", args);
    EXPECT_NE(node->decode, nullptr) << "could not start a decode node";
    node->client = std::make_unique<DecodeClient>(node->decode->address());
    trusting_ = std::move(node);
    return *trusting_->client;
  }
  // A prefill node that sleeps `delay_ms` after each of the 6 layers.
  std::unique_ptr<ServerProcess> SlowPrefill(int delay_ms, std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"--model", TinyModelDir(), "--test-layer-delay-ms",
                                     std::to_string(delay_ms)};
    std::vector<std::string> ucx = UcxArgs("tcp");
    args.insert(args.end(), ucx.begin(), ucx.end());
    args.insert(args.end(), extra.begin(), extra.end());
    return ServerProcess::Start("prefill", args);
  }
  Pair* pair_ = nullptr;
  std::unique_ptr<Pair> trusting_;
};

TEST_F(ServingFailureTest, BadArgumentsAreRejectedWithActionableMessages) {
  const std::vector<uint32_t> prompt = BytePrompt("hello");
  struct Case {
    std::string name;
    v1::GenerateRequest request;
    grpc::StatusCode code;
    std::string mentions;
  };
  std::vector<Case> cases;
  auto base = [&] { return GreedyRequest("bad", prompt, 4, "", ""); };
  {
    auto r = base();
    r.set_prompt_token_ids(1, 100000);
    cases.push_back({"token id", r, grpc::StatusCode::INVALID_ARGUMENT, "vocabulary"});
  }
  {
    auto r = base();
    r.clear_prompt_token_ids();
    cases.push_back({"empty prompt", r, grpc::StatusCode::INVALID_ARGUMENT, "empty"});
  }
  {
    auto r = base();
    r.mutable_sampling()->set_temperature(-1);
    cases.push_back({"temperature", r, grpc::StatusCode::INVALID_ARGUMENT, "temperature"});
  }
  {
    auto r = base();
    r.mutable_sampling()->set_top_p(1.5f);
    cases.push_back({"top_p", r, grpc::StatusCode::INVALID_ARGUMENT, "top_p"});
  }
  {
    auto r = base();
    r.mutable_sampling()->set_max_tokens(0);
    cases.push_back({"max_tokens", r, grpc::StatusCode::INVALID_ARGUMENT, "max_tokens"});
  }
  {
    auto r = base();
    r.mutable_sampling()->set_max_tokens(4294967295u);  // -1 from protobufjs
    cases.push_back({"max_tokens -1", r, grpc::StatusCode::INVALID_ARGUMENT, "at most"});
  }
  {
    auto r = base();
    r.set_prefill_address("10.1.2.3:7001");  // not a node this decode node trusts
    cases.push_back({"prefill_address", r, grpc::StatusCode::PERMISSION_DENIED,
                     "--prefill-address"});
  }
  {
    auto r = base();
    r.mutable_sparse()->set_policy("no_such_policy");
    cases.push_back({"policy", r, grpc::StatusCode::INVALID_ARGUMENT, "fluxion"});
  }
  {
    auto r = base();
    r.mutable_sparse()->set_policy("full");
    r.mutable_sparse()->set_budget(0.5f);
    cases.push_back({"budget with full", r, grpc::StatusCode::INVALID_ARGUMENT, "budget"});
  }
  {
    auto r = base();
    r.set_request_id("");
    cases.push_back({"request id", r, grpc::StatusCode::INVALID_ARGUMENT, "request_id"});
  }
  {
    // 4096 pages / (6 layers x 4 heads) hold 170 pages per head, 2720 tokens: never admissible.
    auto r = GreedyRequest("huge", std::vector<uint32_t>(3000, 65), 4, "full", "");
    cases.push_back({"oversize prompt", r, grpc::StatusCode::OUT_OF_RANGE, "--kv-pages"});
  }
  // A request running meanwhile is unaffected.
  GenerateResult running;
  std::thread t([&] {
    running = pair_->client->Generate(GreedyRequest("bystander", BytePrompt(kPromptText), 48, "full", ""));
  });
  for (const Case& c : cases) {
    GenerateResult r = pair_->client->Generate(c.request);
    EXPECT_EQ(r.status.error_code(), c.code) << c.name << ": " << r.status.error_message();
    EXPECT_NE(r.status.error_message().find(c.mentions), std::string::npos)
        << c.name << ": " << r.status.error_message();
    EXPECT_TRUE(r.tokens.empty()) << c.name;
  }
  t.join();
  EXPECT_TRUE(running.status.ok()) << running.status.error_message();
  EXPECT_EQ(running.tokens.size(), 48u);
}

TEST_F(ServingFailureTest, AbortEndsTheStreamWithItsReason) {
  // Start from an idle node (an earlier test's request may still be counted for a moment), wait
  // until the request decodes (running, none prefilling: its first token has been streamed), then
  // abort until the node reports it aborted. Waiting for a running count alone raced with the
  // admission (about 1 run in 15 aborted before the request existed).
  pair_->client->WaitAllPagesFree();
  GenerateResult r;
  absl::Mutex token_mu;
  std::string token;  // the call's abort token: Abort needs it with the id
  std::thread t([&] {
    r = pair_->client->Generate(
        GreedyRequest("to-abort", BytePrompt(kPromptText), 20000, "full", ""), absl::Seconds(60),
        [&](const std::string& t) {
          absl::MutexLock lock(&token_mu);
          token = t;
        });
  });
  EXPECT_TRUE(pair_->client->WaitForLoad([](const v1::DecodeLoad& load) {
    return load.running_requests() > 0 && load.prefilling_requests() == 0;
  })) << "the request never decoded";
  v1::AbortResponse response;
  const absl::Time deadline = absl::Now() + kGenerousWait;
  do {
    grpc::ClientContext context;
    v1::AbortRequest abort;
    abort.add_request_ids("unknown-id");
    abort.add_request_ids("to-abort");
    abort.add_abort_tokens("");
    {
      absl::MutexLock lock(&token_mu);
      abort.add_abort_tokens(token);
    }
    abort.set_reason("test says stop");
    response.Clear();
    ASSERT_TRUE(pair_->client->stub().Abort(&context, abort, &response).ok());
    if (response.aborted_request_ids_size() > 0) break;
    absl::SleepFor(absl::Milliseconds(5));
  } while (absl::Now() < deadline);
  t.join();
  ASSERT_EQ(response.aborted_request_ids_size(), 1);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  ASSERT_TRUE(r.has_complete);
  EXPECT_EQ(r.complete.finish_reason(), v1::FINISH_REASON_ABORT);
  EXPECT_EQ(r.complete.abort_reason(), "test says stop");
  EXPECT_GE(r.tokens.size(), 1u);
}

TEST_F(ServingFailureTest, TimeBudgetEndsTheStreamWithDeadlineExceededAndPartialUsage) {
  // Connections to the prefill node are set up by a short request first, so that the budget
  // below is spent decoding. The decode node sleeps 3 ms after every step, so in the 6 s budget
  // the request makes at most 2000 of its 20000 tokens on any machine: it can neither finish nor
  // outgrow the arena (4096 pages hold ~2700 tokens of it) before the budget ends it.
  ASSERT_TRUE(pair_->client->Generate(GreedyRequest("budget-warm-up", BytePrompt(kPromptText), 2,
                                                    "full", ""))
                  .status.ok());
  v1::GenerateRequest request = GreedyRequest("budget", BytePrompt(kPromptText), 20000, "full", "");
  request.set_timeout_ms(6000);
  GenerateResult r = pair_->client->Generate(request);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << r.status.error_message();
  ASSERT_TRUE(r.has_error);
  EXPECT_EQ(r.error.code(), static_cast<int>(grpc::StatusCode::DEADLINE_EXCEEDED));
  EXPECT_GT(r.tokens.size(), 0u);
  EXPECT_EQ(r.error.usage().completion_tokens(), r.tokens.size());
  EXPECT_GT(r.error.timing().ttft_us(), 0u);
}

// The attack of issue 12: requests whose deadline passes while the prefill node computes used to
// hold their pages for the whole quarantine lease. The decode node now aborts them at the deadline
// and the prefill node's CANCELLED answer (its writes stopped) frees the pages at once.
TEST_F(ServingFailureTest, DeadlineDuringPrefillFreesPagesAtOnceWhenThePrefillNodeStops) {
  auto slow = SlowPrefill(300);  // 6 layers x 300 ms: every deadline below passes mid-prefill
  ASSERT_NE(slow, nullptr);
  DecodeClient& node = Trusting(*slow);
  std::vector<std::thread> clients;
  std::vector<GenerateResult> results(4);
  for (int i = 0; i < 4; ++i) {
    clients.emplace_back([&, i] {
      v1::GenerateRequest r = GreedyRequest("short-" + std::to_string(i), BytePrompt(kPromptText),
                                            8, "", slow->address());  // default policy: + state
      r.set_timeout_ms(400);
      results[i] = node.Generate(r);
    });
  }
  for (auto& t : clients) t.join();
  for (const GenerateResult& r : results) {
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
        << r.status.error_message();
  }
  // At once, not after the lease (1 s here, 30 s by default): nothing was ever quarantined, so the
  // pages came back with the prefill node's answer, whenever this test looks.
  const v1::DecodeLoad load = node.WaitAllPagesFree();
  EXPECT_EQ(load.free_kv_pages(), load.total_kv_pages());
  ExpectNothingQuarantined(*trusting_->decode);
}

// A prefill node that cannot be reached never got the request: nothing is held.
TEST_F(ServingFailureTest, RefusedPrefillConnectionFreesPagesAtOnce) {
  std::string dead;
  DecodeClient* node = nullptr;
  {
    auto gone = SlowPrefill(0);
    ASSERT_NE(gone, nullptr);
    node = &Trusting(*gone);  // trusted, then gone: the address stays in the decode node's list
    dead = gone->address();
    gone->Kill();
  }
  GenerateResult r = node->Generate(
      GreedyRequest("refused", BytePrompt(kPromptText), 4, "full", dead));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE) << r.status.error_message();
  EXPECT_NE(r.status.error_message().find("not sent"), std::string::npos)
      << r.status.error_message();
  const v1::DecodeLoad load = node->WaitAllPagesFree();
  EXPECT_EQ(load.free_kv_pages(), load.total_kv_pages());
  ExpectNothingQuarantined(*trusting_->decode);
}

// Starts a Generate call, cancels it once `cancel_when(tokens received so far)` holds (polled,
// with a generous deadline), and returns when its stream ended; *cancelled_at is when it did.
grpc::Status GenerateAndCancel(DecodeClient& client, const v1::GenerateRequest& request,
                               const std::function<bool(int)>& cancel_when,
                               absl::Time* cancelled_at) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + 2 * kGenerousWait));
  auto reader = client.stub().Generate(&context, request);
  std::atomic<int> tokens{0};
  std::thread canceller([&] {
    EXPECT_TRUE(WaitFor([&] { return cancel_when(tokens.load()); })) << "cancelled anyway";
    *cancelled_at = absl::Now();
    context.TryCancel();
  });
  v1::GenerateResponse msg;
  while (reader->Read(&msg)) tokens += msg.chunk().token_ids_size();
  canceller.join();
  return reader->Finish();
}

// The client cancels while the prefill node computes (6 layers x 300 ms: the prefill takes at
// least 1.8 s, and the cancel comes once the node reports it running). Both nodes stop: the
// prefill node ends the request as cancelled instead of finishing its layers, and the decode node
// gets every page back without a quarantine.
TEST_F(ServingFailureTest, ClientCancelDuringPrefillStopsBothNodes) {
  auto slow = SlowPrefill(300);
  ASSERT_NE(slow, nullptr);
  DecodeClient& node = Trusting(*slow);
  absl::Time cancelled_at;
  grpc::Status s = GenerateAndCancel(
      node, GreedyRequest("cancel-prefill", BytePrompt(kPromptText), 8, "", slow->address()),
      [&](int) { return PrefillLoadOf(slow->address()).running_requests() == 1; },
      &cancelled_at);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED);
  const v1::DecodeLoad load = node.WaitAllPagesFree();
  EXPECT_EQ(load.free_kv_pages(), load.total_kv_pages());
  std::cout << "pages released " << absl::ToDoubleMilliseconds(absl::Now() - cancelled_at)
            << " ms after the client cancelled (during prefill; printed, not checked)\n";
  EXPECT_TRUE(WaitFor([&] {
    const v1::PrefillLoad pl = PrefillLoadOf(slow->address());
    return pl.running_requests() == 0 && pl.queued_requests() == 0;
  })) << "the prefill node kept the request";
  // Counted when its call returns, a moment after it left the load.
  EXPECT_TRUE(WaitFor([&] {
    return MetricOf(*slow, "fluxion_prefill_requests_total{code=\"CANCELLED\"}") == 1;
  })) << "the prefill node did not end the request as cancelled";
  const double ok = MetricOf(*slow, "fluxion_prefill_requests_total{code=\"OK\"}");
  EXPECT_TRUE(std::isnan(ok) || ok == 0) << "the prefill node finished the cancelled request";
  ExpectNothingQuarantined(*trusting_->decode);
}

// The client cancels once tokens stream. The decode node sleeps 3 ms a step, so the 20000-token
// request, had it not been stopped, would hold its pages for a minute: pages back means stopped.
TEST_F(ServingFailureTest, ClientCancelDuringDecodeReleasesThePages) {
  absl::Time cancelled_at;
  grpc::Status s = GenerateAndCancel(
      *pair_->client, GreedyRequest("cancel-decode", BytePrompt(kPromptText), 20000, "", ""),
      [](int tokens) { return tokens >= 2; }, &cancelled_at);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED);
  const v1::DecodeLoad load = pair_->client->WaitAllPagesFree();
  EXPECT_EQ(load.free_kv_pages(), load.total_kv_pages());
  EXPECT_EQ(load.running_requests(), 0u);
  std::cout << "pages released " << absl::ToDoubleMilliseconds(absl::Now() - cancelled_at)
            << " ms after the client cancelled (during decode; printed, not checked)\n";
}

TEST_F(ServingFailureTest, PrefillKilledMidTransferFailsUnavailableAndPagesComeBack) {
  auto slow = SlowPrefill(400);  // 6 layers x 400 ms
  ASSERT_NE(slow, nullptr);
  DecodeClient& node = Trusting(*slow);
  GenerateResult r;
  const absl::Time start = absl::Now();
  std::thread t([&] {
    r = node.Generate(
        GreedyRequest("victim", BytePrompt(kPromptText), 8, "", slow->address()));
  });
  // Killed once a layer's KV has been sent (the node's sent-bytes counter moved): mid-transfer,
  // with at least four more layers (1.6 s) to go.
  EXPECT_TRUE(WaitFor([&] {
    return MetricOf(*slow, "fluxion_transfer_bytes_total{direction=\"sent\"}") > 0;
  })) << "no KV was sent";
  const absl::Time killed = absl::Now();
  slow->Kill();
  t.join();
  const absl::Time failed = absl::Now();
  // A decode node that missed the death would wait for the call's 60 s deadline and say so
  // (DEADLINE_EXCEEDED); UNAVAILABLE naming the prefill node means it noticed.
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE) << r.status.error_message();
  EXPECT_NE(r.status.error_message().find("prefill node"), std::string::npos)
      << r.status.error_message();
  std::cout << "UNAVAILABLE " << absl::ToDoubleMilliseconds(failed - killed)
            << " ms after the prefill node was killed (" << absl::ToDoubleMilliseconds(killed - start)
            << " ms into the request; printed, not checked)\n";
  // The decode node keeps serving others (through the healthy prefill node) meanwhile.
  GenerateResult other =
      node.Generate(GreedyRequest("survivor", BytePrompt(kPromptText), 8, "full", ""));
  EXPECT_TRUE(other.status.ok()) << other.status.error_message();
  EXPECT_EQ(other.tokens.size(), 8u);
  // The victim's pages were quarantined (the peer may have been writing), then came back after
  // the 1 s lease; TearDown checks that every page is free again.
}

TEST_F(ServingFailureTest, IncompatiblePrefillNodeIsRefusedNamingTheField) {
  auto other = SlowPrefill(0, {"--page-tokens", "32"});
  ASSERT_NE(other, nullptr);
  DecodeClient& node = Trusting(*other);
  GenerateResult r = node.Generate(
      GreedyRequest("mismatch", BytePrompt(kPromptText), 4, "full", other->address()));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << r.status.error_message();
  EXPECT_NE(r.status.error_message().find("page_tokens"), std::string::npos)
      << r.status.error_message();
}

// Prefill batching (docs/SERVING.md "Batching"): requests that queue behind a running prefill
// go through one batched forward, and every request still gets its own KV, checksums, sparse state
// and reply. The proof of batching is the prefill node's GetLoad: running_requests counts the
// requests of the batch being computed (it never exceeded 1 before batching).
class ServingPrefillBatchTest : public ServingFailureTest {
 protected:
  // Polls the prefill node's load every 10 ms until stopped; the largest running_requests seen.
  class RunningPoller {
   public:
    explicit RunningPoller(const std::string& address)
        : thread_([this, address] {
            while (!stop_) {
              max_ = std::max(max_.load(), PrefillLoadOf(address).running_requests());
              absl::SleepFor(absl::Milliseconds(10));
            }
          }) {}
    uint32_t Stop() {
      stop_ = true;
      thread_.join();
      return max_;
    }

   private:
    std::atomic<bool> stop_{false};
    std::atomic<uint32_t> max_{0};
    std::thread thread_;
  };
};

TEST_F(ServingPrefillBatchTest, QueuedPromptsArePrefilledInOneBatchAndMatchSingleProcess) {
  // The first prompt computes for at least 6 x 300 ms; the others are sent once it runs and queue
  // behind it, then compute together (at least 1.8 s, seen by the poller every 10 ms).
  auto slow = SlowPrefill(300);
  ASSERT_NE(slow, nullptr);
  DecodeClient& node = Trusting(*slow);
  const std::vector<std::vector<uint32_t>> prompts = {
      BytePrompt(kPromptText), BytePrompt("x"), BytePrompt("Remember the river: it is calm."),
      BytePrompt(kPromptText + " The key to the red vault is 9902. The key to the red vault is")};
  constexpr uint32_t kTokens = 12;
  std::vector<GenerateResult> results(prompts.size());
  RunningPoller poller(slow->address());
  std::vector<std::thread> threads;
  auto start = [&](size_t i) {
    threads.emplace_back([&, i] {
      results[i] = node.Generate(GreedyRequest("batched-" + std::to_string(i),
                                                         prompts[i], kTokens, "full",
                                                         slow->address()));
    });
  };
  start(0);
  ASSERT_TRUE(WaitFor([&] { return PrefillLoadOf(slow->address()).running_requests() == 1; }));
  for (size_t i = 1; i < prompts.size(); ++i) start(i);
  for (auto& t : threads) t.join();
  const uint32_t max_running = poller.Stop();
  EXPECT_GE(max_running, 3u) << "the three queued prompts were not prefilled in one batch";
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_TRUE(results[i].status.ok()) << i << ": " << results[i].status.error_message();
    EXPECT_EQ(results[i].tokens, ReferenceTokens(prompts[i], kTokens, /*paged=*/true))
        << "prompt " << i << " (" << prompts[i].size() << " tokens)";
  }
  const v1::PrefillLoad pl = PrefillLoadOf(slow->address());
  EXPECT_EQ(pl.running_requests(), 0u);
  EXPECT_EQ(pl.queued_requests(), 0u);
}

TEST_F(ServingPrefillBatchTest, CancellingOneRequestOfABatchLeavesTheOthersCorrect) {
  // The delay is slept in each request's per-layer hook, so one layer of this batch of three takes
  // at least 3 x 150 ms and its forward at least 2.7 s. The test judges whether the cancelled
  // request left at its next layer (the node's running count drops from 3 to 2 while the other
  // two still compute) or only when the batch ended (from 3 straight to 0), not how fast either
  // happened.
  auto slow = SlowPrefill(150);
  ASSERT_NE(slow, nullptr);
  DecodeClient& node = Trusting(*slow);
  const std::vector<std::vector<uint32_t>> prompts = {
      BytePrompt(kPromptText), BytePrompt("Remember the river: it is calm."),
      BytePrompt("The key to the green vault is 1234. The key to the green vault is")};
  constexpr uint32_t kTokens = 12;
  std::vector<GenerateResult> results(prompts.size());
  RunningPoller poller(slow->address());
  std::vector<std::thread> threads;
  auto start = [&](size_t i) {
    threads.emplace_back([&, i] {
      results[i] = node.Generate(GreedyRequest("kept-" + std::to_string(i), prompts[i],
                                                         kTokens, "full", slow->address()));
    });
  };
  start(0);
  ASSERT_TRUE(WaitFor([&] { return PrefillLoadOf(slow->address()).running_requests() == 1; }));
  for (size_t i = 1; i < prompts.size(); ++i) start(i);
  // Queued with them; cancelled once the batch of three is seen computing.
  grpc::ClientContext cancel_context;
  grpc::Status cancelled;
  std::thread cancel_thread([&] {
    auto reader = node.stub().Generate(
        &cancel_context, GreedyRequest("cancelled-in-batch", BytePrompt(kPromptText + " and"),
                                       kTokens, "full", slow->address()));
    v1::GenerateResponse msg;
    while (reader->Read(&msg)) {
    }
    cancelled = reader->Finish();
  });
  ASSERT_TRUE(WaitFor([&] { return PrefillLoadOf(slow->address()).running_requests() >= 3; }))
      << "the batch of three never ran";
  const absl::Time cancelled_at = absl::Now();
  cancel_context.TryCancel();
  uint32_t running_after = 3;
  WaitFor([&] {
    running_after = PrefillLoadOf(slow->address()).running_requests();
    return running_after < 3;
  });
  std::cout << "cancelled request left its batch "
            << absl::ToDoubleMilliseconds(absl::Now() - cancelled_at)
            << " ms after the client cancelled (printed, not checked)\n";
  EXPECT_EQ(running_after, 2u) << "the cancelled request only left when its batch ended";
  cancel_thread.join();
  for (auto& t : threads) t.join();
  const uint32_t max_running = poller.Stop();
  EXPECT_EQ(cancelled.error_code(), grpc::StatusCode::CANCELLED) << cancelled.error_message();
  EXPECT_GE(max_running, 3u) << "the cancelled request was not batched with two others";
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_TRUE(results[i].status.ok()) << i << ": " << results[i].status.error_message();
    EXPECT_EQ(results[i].tokens, ReferenceTokens(prompts[i], kTokens, /*paged=*/true))
        << "prompt " << i;
  }
  // TearDown: every page of the cancelled request came back too.
}

// Prefill throughput for 4 concurrent 1K-token prompts, batching on (--max-batch-tokens 4096)
// against off (0), runs interleaved (alternating which goes first) because the machine is noisy.
// Not a test: run with --gtest_also_run_disabled_tests --gtest_filter='*PrefillBatchThroughput*'
// (FLUXION_BENCH_ROUNDS, default 5). Throughput = prompt tokens / wall time from sending the 4
// Generate calls (max_tokens 1, policy full) until the last returned.
TEST(ServingPrefillBatchBench, DISABLED_PrefillBatchThroughput) {
  const char* rounds_env = std::getenv("FLUXION_BENCH_ROUNDS");
  const int rounds = rounds_env != nullptr ? std::atoi(rounds_env) : 5;
  constexpr int kPrompts = 4, kTokens = 1024;
  std::map<std::string, std::unique_ptr<ServerProcess>> prefill;
  for (const std::string mode : {"on", "off"}) {
    std::vector<std::string> args = {"--model", TinyModelDir(), "--max-batch-tokens",
                                     mode == "on" ? "4096" : "0"};
    std::vector<std::string> ucx = UcxArgs("tcp");
    args.insert(args.end(), ucx.begin(), ucx.end());
    prefill[mode] = ServerProcess::Start("prefill", args);
    ASSERT_NE(prefill[mode], nullptr);
  }
  // Its own decode node, with room for all four prompts at once (each needs 1536 pages).
  std::vector<std::string> dargs = {"--model", TinyModelDir(), "--kv-pages", "16384",
                                    "--nohuge-pages"};
  std::vector<std::string> ucx = UcxArgs("tcp");
  dargs.insert(dargs.end(), ucx.begin(), ucx.end());
  auto decode = ServerProcess::Start("decode", dargs);
  ASSERT_NE(decode, nullptr);
  DecodeClient client(decode->address());
  std::vector<std::vector<uint32_t>> prompts;
  for (int i = 0; i < kPrompts; ++i) {
    std::string text;
    while (text.size() < kTokens) {
      text += "Request " + std::to_string(i) + ": the key to vault " + std::to_string(text.size()) +
              " is " + std::to_string(1000 + 7 * text.size() + i) + ". ";
    }
    prompts.push_back(BytePrompt(text.substr(0, kTokens)));
  }
  auto run = [&](const std::string& mode, int round, uint32_t* max_running) {
    std::atomic<bool> stop{false};
    std::atomic<uint32_t> seen{0};
    std::thread poller([&] {
      while (!stop) {
        seen = std::max(seen.load(), PrefillLoadOf(prefill[mode]->address()).running_requests());
        absl::SleepFor(absl::Milliseconds(5));
      }
    });
    std::vector<GenerateResult> results(kPrompts);
    std::vector<std::thread> threads;
    const absl::Time t0 = absl::Now();
    for (int i = 0; i < kPrompts; ++i) {
      threads.emplace_back([&, i] {
        results[i] = client.Generate(GreedyRequest(
            absl::StrCat("bench-", mode, "-", round, "-", i), prompts[i], 1, "full",
            prefill[mode]->address()), absl::Seconds(300));
      });
    }
    for (auto& t : threads) t.join();
    const double secs = absl::ToDoubleSeconds(absl::Now() - t0);
    stop = true;
    poller.join();
    for (const auto& r : results) EXPECT_TRUE(r.status.ok()) << r.status.error_message();
    *max_running = seen;
    return secs;
  };
  uint32_t ignored;
  run("on", -1, &ignored);  // warm-up of both
  run("off", -1, &ignored);
  std::map<std::string, std::vector<double>> tps;
  std::printf("round mode  wall_s  prompt_tok_per_s  max_batch\n");
  for (int r = 0; r < rounds; ++r) {
    for (const std::string& mode : r % 2 == 0 ? std::vector<std::string>{"on", "off"}
                                              : std::vector<std::string>{"off", "on"}) {
      uint32_t max_running = 0;
      const double secs = run(mode, r, &max_running);
      tps[mode].push_back(kPrompts * kTokens / secs);
      std::printf("%5d %-4s %7.3f %17.1f %10u\n", r, mode.c_str(), secs, tps[mode].back(),
                  max_running);
    }
  }
  for (auto& [mode, v] : tps) {
    std::sort(v.begin(), v.end());
    std::printf("batching %-3s median %.1f prompt tok/s (min %.1f, max %.1f, %zu runs)\n",
                mode.c_str(), v[v.size() / 2], v.front(), v.back(), v.size());
  }
}

TEST(ServingDrainTest, SigtermRefusesNewRequestsAndLetsRunningOnesFinish) {
  Pair* pair = PairFor("tcp");
  ASSERT_NE(pair, nullptr);
  // 10 ms after every decode step: the 200-token request runs for at least 2 s after its first
  // token, the time the test has to see the drain begin and be refused.
  std::vector<std::string> args = {"--model", TinyModelDir(), "--kv-pages", "4096",
                                   "--prefill-address", pair->prefill->address(), "--nohuge-pages",
                                   "--test-step-delay-ms", "10"};
  std::vector<std::string> ucx = UcxArgs("tcp");
  args.insert(args.end(), ucx.begin(), ucx.end());
  auto decode = ServerProcess::Start("decode", args);
  ASSERT_NE(decode, nullptr);
  DecodeClient client(decode->address());
  GenerateResult running;
  std::thread t([&] {
    running = client.Generate(GreedyRequest("long", BytePrompt(kPromptText), 200, "full", ""));
  });
  EXPECT_TRUE(client.WaitForLoad([](const v1::DecodeLoad& l) { return l.running_requests() > 0; }));
  decode->Signal(SIGTERM);
  EXPECT_TRUE(client.WaitForLoad([](const v1::DecodeLoad& l) { return l.draining(); }));
  GenerateResult refused = client.Generate(GreedyRequest("late", BytePrompt("hi"), 4, "full", ""));
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(refused.status.error_message().find("draining"), std::string::npos);
  t.join();
  EXPECT_TRUE(running.status.ok()) << running.status.error_message();
  EXPECT_EQ(running.tokens.size(), 200u);
  EXPECT_TRUE(decode->Terminate(kGenerousWait)) << "did not exit after draining";
}

TEST(ServingRestartTest, ARestartedDecodeNodeGetsFreshTransferState) {
  Pair* pair = PairFor("tcp");
  ASSERT_NE(pair, nullptr);
  std::vector<std::string> args = {"--model", TinyModelDir(), "--kv-pages", "4096",
                                   "--prefill-address", pair->prefill->address(), "--nohuge-pages"};
  std::vector<std::string> ucx = UcxArgs("tcp");
  args.insert(args.end(), ucx.begin(), ucx.end());
  const std::vector<uint32_t> prompt = BytePrompt(kPromptText);
  const std::vector<uint32_t> expected = ReferenceTokens(prompt, 8, /*paged=*/true);
  // The shared prefill node writes into one decode node, which then dies without closing
  // anything; a new decode process (new node name, worker address and key) must be served with
  // fresh UCX state, never the dead peer's endpoint or key.
  for (int incarnation = 0; incarnation < 2; ++incarnation) {
    auto decode = ServerProcess::Start("decode", args);
    ASSERT_NE(decode, nullptr);
    DecodeClient client(decode->address());
    GenerateResult r = client.Generate(
        GreedyRequest("restart-" + std::to_string(incarnation), prompt, 8, "full", ""));
    ASSERT_TRUE(r.status.ok()) << "incarnation " << incarnation << ": " << r.status.error_message();
    EXPECT_EQ(r.tokens, expected);
    ExpectAllPagesFree(client);
    decode->Kill();
  }
}

// Preemption is invisible to the client: the youngest request gives its pages up, waits for the
// older one to finish, has its KV recomputed by the prefill node (the prompt and what it had
// generated) and goes on where it stopped.
TEST(ServingPreemptionTest, YoungestRequestIsPreemptedWhenPagesRunOutAndResumes) {
  Pair* pair = PairFor("tcp");
  ASSERT_NE(pair, nullptr);
  // A decode node with room for ~2 prompts and little growth: 6 x 4 x 20 pages = 480. 10 ms after
  // every step: each request decodes for at least 1.2 s, so the two run side by side however the
  // machine schedules their starts.
  std::vector<std::string> args = {"--model", TinyModelDir(), "--kv-pages", "480",
                                   "--prefill-address", pair->prefill->address(),
                                   "--headroom-tokens", "16", "--nohuge-pages",
                                   "--test-step-delay-ms", "10"};
  std::vector<std::string> ucx = UcxArgs("tcp");
  args.insert(args.end(), ucx.begin(), ucx.end());
  auto decode = ServerProcess::Start("decode", args);
  ASSERT_NE(decode, nullptr);
  DecodeClient client(decode->address());
  const std::vector<uint32_t> prompt = BytePrompt(kPromptText);  // 8 pages per head
  // Both fit at admission (2 x 192 pages + headroom); growing to 120 tokens each does not.
  GenerateResult results[2];
  std::thread a([&] { results[0] = client.Generate(GreedyRequest("a", prompt, 120, "full", "")); });
  std::thread b([&] { results[1] = client.Generate(GreedyRequest("b", prompt, 120, "full", "")); });
  a.join();
  b.join();
  std::cout << "a: " << results[0].status.error_message() << " " << results[0].tokens.size()
            << " tokens; b: " << results[1].status.error_message() << " "
            << results[1].tokens.size() << " tokens\n";
  for (const GenerateResult& r : results) {
    EXPECT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_FALSE(r.has_error);
    EXPECT_EQ(r.tokens.size(), 120u);
    EXPECT_EQ(r.complete.usage().completion_tokens(), 120u);
    EXPECT_EQ(r.complete.usage().prompt_tokens(), prompt.size());
  }
  // Both greedy over the same prompt: the resumed request, decoding over KV the prefill node
  // recomputed, gives the tokens the older one decoded over its own.
  EXPECT_EQ(results[0].tokens, results[1].tokens);
  auto metrics = metrics::testing::HttpGet(decode->metrics_port(), "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_THAT(*metrics, HasSubstr("fluxion_decode_preemptions_total 1\n"));
  EXPECT_THAT(*metrics, HasSubstr("fluxion_decode_preemptions_resumed_total 1\n"));
  ExpectAllPagesFree(client);
}

}  // namespace
}  // namespace fluxion::testing

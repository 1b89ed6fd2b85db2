// What the HTTP API's in-process tests share: a fake DecodeService that streams fixed ids one per
// chunk and can hold its answer until released or cancelled, a tokenizer that blocks until
// released (a prompt stuck tokenizing), and a fixture running the HTTP server against the fake
// over the gRPC server's in-process channel. Header-only, for tests.
#ifndef FLUXION_CLUSTER_OPENAI_HTTP_TESTING_H_
#define FLUXION_CLUSTER_OPENAI_HTTP_TESTING_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "cluster/openai_http.h"
#include "fluxion/v1/decode.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "model/tokenizer.h"

namespace fluxion::cluster::openai::testing {

// How long a test waits for something that should happen at once: generous, so that a loaded
// machine never fails a test that is right.
inline constexpr absl::Duration kPatience = absl::Seconds(30);

// Streams `ids` one per chunk (or refuses with `reject`); counts calls started and cancelled.
class FakeDecode final : public v1::DecodeService::Service {
 public:
  std::vector<uint32_t> ids;
  grpc::Status reject = grpc::Status::OK;
  // Refuses only the calls whose request id ends with this (one choice of several): `reject`.
  std::string reject_only_suffix;
  bool hold_first = false;       // before the first id, wait for Release() or a cancel
  bool wait_for_cancel = false;  // after the ids, wait for a cancel before completing
  bool hold_status = false;      // after the complete message, wait for a cancel

  grpc::Status Generate(grpc::ServerContext* context, const v1::GenerateRequest* request,
                        grpc::ServerWriter<v1::GenerateResponse>* writer) override {
    {
      absl::MutexLock lock(&mu_);
      ++started_;
    }
    const std::string& id = request->request_id();
    const bool refused = reject_only_suffix.empty() ||
                         (id.size() >= reject_only_suffix.size() &&
                          id.compare(id.size() - reject_only_suffix.size(),
                                     reject_only_suffix.size(), reject_only_suffix) == 0);
    if (!reject.ok() && refused) return reject;
    if (hold_first) WaitFor(context, /*release=*/true);
    uint32_t sent = 0;
    for (uint32_t id : ids) {
      if (context->IsCancelled()) break;
      v1::GenerateResponse r;
      r.mutable_chunk()->add_token_ids(id);
      r.mutable_chunk()->set_completion_tokens(++sent);
      if (!writer->Write(r)) break;
    }
    if (wait_for_cancel) WaitFor(context, /*release=*/false);
    if (context->IsCancelled()) return CountCancel();
    v1::GenerateResponse done;
    done.mutable_complete()->set_finish_reason(v1::FINISH_REASON_LENGTH);
    done.mutable_complete()->mutable_usage()->set_completion_tokens(sent);
    writer->Write(done);
    if (hold_status) WaitFor(context, /*release=*/false);
    if (context->IsCancelled()) return CountCancel();
    return grpc::Status::OK;
  }

  void Release() {
    absl::MutexLock lock(&mu_);
    released_ = true;
  }
  int Cancelled() {
    absl::MutexLock lock(&mu_);
    return cancelled_;
  }
  int Started() {
    absl::MutexLock lock(&mu_);
    return started_;
  }
  // Whether `n` calls were cancelled / started within kPatience.
  bool AwaitCancelled(int n) { return Await(&cancelled_, n); }
  bool AwaitStarted(int n) { return Await(&started_, n); }

 private:
  grpc::Status CountCancel() {
    absl::MutexLock lock(&mu_);
    ++cancelled_;
    return grpc::Status::CANCELLED;
  }
  // Until cancelled (or released, when `release`), bounded by twice kPatience so that a test
  // waiting kPatience for a cancellation fails before the fake gives up.
  void WaitFor(grpc::ServerContext* context, bool release) {
    const absl::Time give_up = absl::Now() + 2 * kPatience;
    while (!context->IsCancelled() && absl::Now() < give_up) {
      absl::MutexLock lock(&mu_);
      if (release && released_) return;
      mu_.AwaitWithTimeout(absl::Condition(&released_), absl::Milliseconds(5));
    }
  }
  bool Await(int* count, int n) {
    absl::MutexLock lock(&mu_);
    auto reached = [count, n] { return *count >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&reached), kPatience);
  }

  absl::Mutex mu_;
  bool released_ ABSL_GUARDED_BY(mu_) = false;
  int started_ ABSL_GUARDED_BY(mu_) = 0;
  int cancelled_ ABSL_GUARDED_BY(mu_) = 0;
};

// The byte tokenizer, except that Encode blocks until Release(), honouring its check meanwhile
// (as a real tokenizer does between bounded pieces of work): a prompt stuck tokenizing.
class GatedTokenizer final : public model::Tokenizer {
 public:
  absl::StatusOr<std::vector<int32_t>> EncodeChecked(
      absl::string_view text, const model::EncodeCheck& check) const override {
    absl::MutexLock lock(&mu_);
    ++entered_;
    while (!released_) {
      if (check) {
        mu_.Unlock();
        absl::Status s = check();
        mu_.Lock();
        if (!s.ok()) {
          gave_up_.push_back(s);
          return s;
        }
      }
      mu_.AwaitWithTimeout(absl::Condition(&released_), absl::Milliseconds(5));
    }
    return inner_->EncodeChecked(text, check);
  }
  void AppendTokenBytes(int32_t id, bool skip_special, std::string* out) const override {
    inner_->AppendTokenBytes(id, skip_special, out);
  }
  std::optional<int32_t> TokenToId(absl::string_view token) const override {
    return inner_->TokenToId(token);
  }
  std::optional<std::string> IdToToken(int32_t id) const override { return inner_->IdToToken(id); }
  bool IsSpecial(int32_t id) const override { return inner_->IsSpecial(id); }
  int32_t vocab_size() const override { return inner_->vocab_size(); }

  void Release() {
    absl::MutexLock lock(&mu_);
    released_ = true;
  }
  // Whether `n` encodings are (or were) blocked, within kPatience.
  bool AwaitEntered(int n) const {
    absl::MutexLock lock(&mu_);
    auto reached = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return entered_ >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&reached), kPatience);
  }
  // The statuses with which blocked encodings gave up (their check failed), within kPatience
  // of the first.
  std::vector<absl::Status> AwaitGaveUp() const {
    absl::MutexLock lock(&mu_);
    auto some = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !gave_up_.empty(); };
    mu_.AwaitWithTimeout(absl::Condition(&some), kPatience);
    return gave_up_;
  }

 private:
  const std::unique_ptr<model::Tokenizer> inner_ = model::NewByteTokenizer();
  mutable absl::Mutex mu_;
  mutable bool released_ ABSL_GUARDED_BY(mu_) = false;
  mutable int entered_ ABSL_GUARDED_BY(mu_) = 0;
  mutable std::vector<absl::Status> gave_up_ ABSL_GUARDED_BY(mu_);
};

// The HTTP server (model "m") against `fake_`; StartHttp again for other options or tokenizer.
class OpenAiHttpFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.RegisterService(&fake_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    StartHttp(DefaultOptions());
  }
  void TearDown() override {
    http_.reset();
    server_->Shutdown();
  }
  HttpServerOptions DefaultOptions() {
    HttpServerOptions options;
    options.model_name = "m";
    options.registry = &registry_;
    return options;
  }
  // Replaces the HTTP server; `tokenizer` (nullptr: the byte tokenizer) must outlive it.
  void StartHttp(HttpServerOptions options, const model::Tokenizer* tokenizer = nullptr) {
    http_.reset();
    std::shared_ptr<grpc::Channel> channel = server_->InProcessChannel(grpc::ChannelArguments());
    channel_ = channel;
    auto http = HttpServer::Start("127.0.0.1:0", std::move(channel),
                                  tokenizer != nullptr ? tokenizer : tokenizer_.get(), nullptr,
                                  std::move(options));
    ASSERT_TRUE(http.ok()) << http.status();
    http_ = std::move(*http);
  }
  void StreamBytes(const std::string& text) {
    fake_.ids.clear();
    for (unsigned char c : text) fake_.ids.push_back(c);
  }

  FakeDecode fake_;
  metrics::Registry registry_;
  std::unique_ptr<grpc::Server> server_;
  std::weak_ptr<grpc::Channel> channel_;  // the HTTP server owns it
  std::unique_ptr<model::Tokenizer> tokenizer_ = model::NewByteTokenizer();
  std::unique_ptr<HttpServer> http_;
};

}  // namespace fluxion::cluster::openai::testing

#endif  // FLUXION_CLUSTER_OPENAI_HTTP_TESTING_H_

// HttpServer's insides, shared by its two source files: openai_http.cc (lifecycle,
// libmicrohttpd's connection callbacks, suspend/resume accounting, shutdown) and
// openai_http_requests.cc (answering a request: routing, the body, the worker, the answer).
// Internal to the HTTP API; include only from those two.
#ifndef FLUXION_CLUSTER_OPENAI_HTTP_IMPL_H_
#define FLUXION_CLUSTER_OPENAI_HTTP_IMPL_H_

#include <sys/socket.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "cluster/http_connection_limits.h"
#include "cluster/http_hangup_watcher.h"
#include "cluster/openai_call.h"
#include "cluster/openai_exchange.h"
#include "cluster/openai_http.h"
#include "cluster/worker_pool.h"
#include "microhttpd.h"

namespace fluxion::cluster::openai {

using Metadata = std::vector<std::pair<std::string, std::string>>;

class HttpServer::Impl {
 public:
  Impl(std::shared_ptr<grpc::Channel> channel, const model::Tokenizer* tokenizer, ChatRenderer chat,
       HttpServerOptions options, std::unique_ptr<HangupWatcher> watcher);

  // libmicrohttpd's callbacks (polling thread).
  MHD_Result Handle(MHD_Connection* connection, const char* url, const char* method,
                    const char* upload_data, size_t* upload_data_size, void** per_request);
  void Completed(void** per_request);
  bool Admit(const sockaddr* addr) { return limiter_.Admit(ConnectionLimiter::ClientKey(addr)); }
  void Opened(MHD_Connection* connection, void** socket_context);
  void Closed(void** socket_context);

  // Shutdown, with the daemon quiesced: refuses new requests (503), cancels every preparation
  // and call, and returns once every suspended connection was resumed (libmicrohttpd refuses to
  // stop with one still suspended) and the open requests were answered (a few seconds at most).
  void StopCalls();
  // After the daemon stopped: waits until every exchange is destroyed, so that the channel's
  // last reference is the stub's (ExchangeSet says why).
  void EndAllCalls();

 private:
  // One POST being answered; owned by libmicrohttpd's per-request pointer, deleted in Completed.
  struct Call {
    // What the body is for: a completion (a Generate call), or vLLM's tokenizer endpoints, which
    // the router answers itself (openai_tokenize.h).
    enum class Route { kGenerate, kTokenize, kDetokenize };
    MHD_Connection* connection = nullptr;
    Route route = Route::kGenerate;
    Endpoint endpoint = Endpoint::kCompletions;
    // The Generate request's id (the answer's `id`: unique here, the client's X-Request-Id in it
    // when given) and the X-Request-Id answered (the client's, else generate_id).
    std::string generate_id, id;
    std::string body;
    bool too_large = false;
    std::shared_ptr<CallState> state;  // from Submit on
    uint64_t state_id = 0;             // in calls_
    uint64_t watch_id = 0;             // in watcher_
    std::shared_ptr<Completion> completion;
  };
  // A streamed body's reader state; owned by the libmicrohttpd response (freed by FreeStream).
  struct StreamState {
    Impl* impl;
    std::shared_ptr<Completion> completion;
    MHD_Connection* connection;
  };

  MHD_Result Begin(MHD_Connection* connection, const char* url, const char* method,
                   void** per_request);
  absl::Status Submit(Call* call);
  // Whether the request carries `Authorization: Bearer <options_.api_key>`.
  bool Authorized(MHD_Connection* connection) const;
  void Prepare(const std::shared_ptr<CallState>& state, MHD_Connection* connection,
               Endpoint endpoint, const std::string& body, const std::string& id,
               const Metadata& metadata);
  // On a worker: /tokenize or /detokenize's answer, into the state.
  void AnswerTokenizer(const std::shared_ptr<CallState>& state, Call::Route route,
                       const std::string& body);
  MHD_Result Answer(Call* call);
  static ssize_t ReadStream(void* cls, uint64_t, char* buf, size_t max);
  static void FreeStream(void* cls) { delete static_cast<StreamState*>(cls); }
  // Every suspend and resume goes through these, so that StopCalls knows when none is left.
  void Suspend(MHD_Connection* connection);
  void Resume(MHD_Connection* connection);

  std::unique_ptr<v1::DecodeService::Stub> stub_;
  const std::shared_ptr<ExchangeSet> exchanges_ = std::make_shared<ExchangeSet>();
  const model::Tokenizer* const tokenizer_;
  const ChatRenderer chat_;
  const HttpServerOptions options_;
  const int64_t created_;
  Preparer preparer_;
  ConnectionLimiter limiter_;
  metrics::Counter* const requests_shed_;
  std::unique_ptr<HangupWatcher> watcher_;  // reset once the daemon stopped
  WorkerPool pool_;
  std::string id_prefix_;
  std::atomic<uint64_t> serial_{0};

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_state_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, std::weak_ptr<CallState>> calls_ ABSL_GUARDED_BY(mu_);
  absl::Mutex suspend_mu_;
  int64_t suspended_ ABSL_GUARDED_BY(suspend_mu_) = 0;
};

}  // namespace fluxion::cluster::openai

#endif  // FLUXION_CLUSTER_OPENAI_HTTP_IMPL_H_

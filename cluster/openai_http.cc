#include "cluster/openai_http.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <atomic>
#include <cstring>
#include <ctime>
#include <map>
#include <random>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/ipv4_address.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "cluster/openai_exchange.h"
#include "cluster/openai_http_framing.h"
#include "cluster/openai_response.h"
#include "cluster/prefill_pick.h"
#include "microhttpd.h"
#include "model/stream_detokenizer.h"

namespace fluxion::cluster::openai {
namespace {

constexpr char kJson[] = "application/json";

// `close`: the connection ends after the answer (its framing cannot be trusted for another).
MHD_Result Reply(MHD_Connection* connection, unsigned int code, const std::string& body,
                 int retry_after_s = 0, bool close = false) {
  MHD_Response* response = MHD_create_response_from_buffer(
      body.size(), const_cast<char*>(body.data()), MHD_RESPMEM_MUST_COPY);
  if (response == nullptr) return MHD_NO;
  MHD_add_response_header(response, "Content-Type", kJson);
  if (close) MHD_add_response_header(response, MHD_HTTP_HEADER_CONNECTION, "close");
  if (retry_after_s > 0) {
    MHD_add_response_header(response, "Retry-After", std::to_string(retry_after_s).c_str());
  }
  MHD_Result result = MHD_queue_response(connection, code, response);
  MHD_destroy_response(response);
  return result;
}

MHD_Result ReplyError(MHD_Connection* connection, const absl::Status& status) {
  ApiError error = ErrorFromStatus(status);
  return Reply(connection, error.http_status, ErrorJson(error), error.retry_after_s);
}

MHD_Result ReplyError(MHD_Connection* connection, int http_status, const std::string& type,
                      const std::string& message) {
  ApiError error;
  error.http_status = http_status;
  error.type = type;
  error.message = message;
  return Reply(connection, http_status, ErrorJson(error));
}

// "host:port" -> IPv4 socket address (the host may be a name).
absl::StatusOr<sockaddr_in> ParseAddress(const std::string& address) {
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) ||
      port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("http: '", address, "' is not host:port (e.g. 0.0.0.0:8000)"));
  }
  const std::string host = address.substr(0, colon);
  return ResolveIpv4(host, port, "http");
}

// A streamed body's reader state; owned by the MHD response (freed by FreeStream).
struct StreamState {
  std::shared_ptr<Exchange> exchange;
  MHD_Connection* connection;
};

ssize_t ReadStream(void* cls, uint64_t, char* buf, size_t max) {
  auto* state = static_cast<StreamState*>(cls);
  MHD_Connection* connection = state->connection;
  long n = state->exchange->ReadOrSuspend(buf, max,
                                          [connection] { MHD_suspend_connection(connection); });
  return n < 0 ? MHD_CONTENT_READER_END_OF_STREAM : static_cast<ssize_t>(n);
}

void FreeStream(void* cls) { delete static_cast<StreamState*>(cls); }

}  // namespace

class HttpServer::Impl {
 public:
  Impl(std::shared_ptr<grpc::Channel> channel, const model::Tokenizer* tokenizer, ChatRenderer chat,
       HttpServerOptions options)
      : stub_(v1::DecodeService::NewStub(channel)),
        tokenizer_(tokenizer),
        chat_(std::move(chat)),
        options_(std::move(options)),
        created_(std::time(nullptr)) {
    std::random_device random;
    id_prefix_ = absl::StrFormat("%08x%08x", random(), random());
  }

  // One POST being answered; owned by MHD's per-request pointer, deleted in Completed.
  struct Call {
    MHD_Connection* connection = nullptr;
    Endpoint endpoint = Endpoint::kCompletions;
    std::string body;
    bool too_large = false;
    std::shared_ptr<Exchange> exchange;
    uint64_t live_id = 0;
  };

  MHD_Result Handle(MHD_Connection* connection, const char* url, const char* method,
                    const char* upload_data, size_t* upload_data_size, void** per_request) {
    auto* call = static_cast<Call*>(*per_request);
    if (call == nullptr) return Begin(connection, url, method, per_request);
    if (*upload_data_size > 0) {
      if (!call->too_large && call->body.size() + *upload_data_size <= options_.max_body_bytes) {
        call->body.append(upload_data, *upload_data_size);
      } else {
        call->too_large = true;
        call->body.clear();
      }
      *upload_data_size = 0;
      return MHD_YES;
    }
    if (call->exchange == nullptr) {
      if (call->too_large) {
        return ReplyError(
            connection, MHD_HTTP_CONTENT_TOO_LARGE, "invalid_request_error",
            absl::StrCat("the request body exceeds ", options_.max_body_bytes, " bytes"));
      }
      if (absl::Status s = StartExchange(call); !s.ok()) return ReplyError(connection, s);
    }
    std::optional<Exchange::Head> head =
        call->exchange->HeadOrSuspend([connection] { MHD_suspend_connection(connection); });
    if (!head) return MHD_YES;  // resumed by the exchange when the head is decided
    if (!head->streaming)
      return Reply(connection, head->http_status, head->body, head->retry_after_s);
    MHD_Response* response =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, &ReadStream,
                                          new StreamState{call->exchange, connection}, &FreeStream);
    if (response == nullptr) return MHD_NO;
    MHD_add_response_header(response, "Content-Type", "text/event-stream");
    MHD_add_response_header(response, "Cache-Control", "no-cache");
    MHD_Result result = MHD_queue_response(connection, MHD_HTTP_OK, response);
    MHD_destroy_response(response);
    return result;
  }

  void Completed(void** per_request) {
    auto* call = static_cast<Call*>(*per_request);
    if (call == nullptr) return;
    if (call->exchange != nullptr) {
      // Normally a no-op (the call ended before the reply did); for a client that went away
      // mid-stream it cancels the Generate call, which the router relays downstream.
      call->exchange->Cancel();
      absl::MutexLock lock(&mu_);
      live_.erase(call->live_id);
    }
    delete call;
    *per_request = nullptr;
  }

  // Server shutdown: every live call is cancelled; the exchanges wake their connections, which
  // then answer and complete. Waits up to `timeout` for that.
  void CancelAll(absl::Duration timeout) {
    std::vector<std::shared_ptr<Exchange>> live;
    {
      absl::MutexLock lock(&mu_);
      for (auto& [id, weak] : live_) {
        if (auto e = weak.lock()) live.push_back(std::move(e));
      }
    }
    for (auto& e : live) e->Abandon();
    absl::MutexLock lock(&mu_);
    auto empty = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return live_.empty(); };
    mu_.AwaitWithTimeout(absl::Condition(&empty), timeout);
  }

  // After the daemon stopped: ends the calls that outlived their HTTP requests and waits until
  // every exchange is destroyed, so that the channel's last reference is the stub's (ExchangeSet
  // says why).
  void EndAllCalls() {
    exchanges_->CancelAll();
    exchanges_->AwaitEmpty();
  }

 private:
  MHD_Result Begin(MHD_Connection* connection, const char* url, const char* method,
                   void** per_request) {
    // Before anything else, and before the body is read: a request whose end we might find
    // elsewhere than a proxy in front of us is answered and the connection closed.
    if (absl::Status framing = CheckFraming(FramingHeadersOf(connection)); !framing.ok()) {
      return Reply(connection, MHD_HTTP_BAD_REQUEST, ErrorJson(ErrorFromStatus(framing)),
                   /*retry_after_s=*/0, /*close=*/true);
    }
    const bool get = std::strcmp(method, "GET") == 0 || std::strcmp(method, "HEAD") == 0;
    const bool post = std::strcmp(method, "POST") == 0;
    std::optional<Endpoint> endpoint;
    if (std::strcmp(url, "/v1/completions") == 0) endpoint = Endpoint::kCompletions;
    if (std::strcmp(url, "/v1/chat/completions") == 0) endpoint = Endpoint::kChatCompletions;
    if (endpoint) {
      if (!post) {
        return ReplyError(connection, MHD_HTTP_METHOD_NOT_ALLOWED, "invalid_request_error",
                          absl::StrCat(url, " takes POST"));
      }
      // A declared length over the limit is refused before the body is read.
      const char* length =
          MHD_lookup_connection_value(connection, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
      uint64_t declared = 0;
      if (length != nullptr && absl::SimpleAtoi(length, &declared) &&
          declared > options_.max_body_bytes) {
        return ReplyError(connection, MHD_HTTP_CONTENT_TOO_LARGE, "invalid_request_error",
                          absl::StrCat("the request body (", declared, " bytes) exceeds ",
                                       options_.max_body_bytes, " bytes"));
      }
      auto* call = new Call;
      call->connection = connection;
      call->endpoint = *endpoint;
      *per_request = call;
      return MHD_YES;
    }
    const bool models = std::strcmp(url, "/v1/models") == 0;
    const bool health = std::strcmp(url, "/health") == 0;
    if (!models && !health) {
      return ReplyError(connection, MHD_HTTP_NOT_FOUND, "invalid_request_error",
                        absl::StrCat("no such endpoint: ", url,
                                     " (served: POST /v1/completions, POST /v1/chat/completions, "
                                     "GET /v1/models, GET /health)"));
    }
    if (!get) {
      return ReplyError(connection, MHD_HTTP_METHOD_NOT_ALLOWED, "invalid_request_error",
                        absl::StrCat(url, " takes GET"));
    }
    if (models) return Reply(connection, MHD_HTTP_OK, ModelsJson(options_.model_name, created_));
    if (options_.ready()) return Reply(connection, MHD_HTTP_OK, "{\"status\":\"ok\"}");
    return ReplyError(connection, absl::UnavailableError("no healthy decode node"));
  }

  absl::Status StartExchange(Call* call) {
    auto request = ParseRequest(call->endpoint, call->body, options_.parse_limits);
    call->body.clear();
    if (!request.ok()) return request.status();
    if (request->model != options_.model_name) {
      return WithParam(absl::NotFoundError(absl::StrCat("The model `", request->model,
                                                        "` does not exist; this server serves `",
                                                        options_.model_name, "`")),
                       "model");
    }
    const bool chat = call->endpoint == Endpoint::kChatCompletions;
    const std::string id =
        absl::StrCat(chat ? "chatcmpl-" : "cmpl-", id_prefix_, "-", serial_.fetch_add(1));
    auto generate = PrepareGenerate(*request, *tokenizer_, chat_, id);
    if (!generate.ok()) return generate.status();
    model::StreamDetokenizerOptions detokenizer_options;
    detokenizer_options.stop = request->stop;
    auto detokenizer = model::StreamDetokenizer::Create(tokenizer_, detokenizer_options);
    if (!detokenizer.ok()) return WithParam(detokenizer.status(), "stop");
    ResponseMeta meta{call->endpoint, id, static_cast<int64_t>(std::time(nullptr)), request->model};
    MHD_Connection* connection = call->connection;
    // The gateway's prefill pick travels to the router as call metadata; the router maps it onto
    // its prefill nodes or refuses it (cluster/prefill_pick.h; INVALID_ARGUMENT -> 400).
    std::vector<std::pair<std::string, std::string>> metadata;
    for (const char* header : {kPrefillerHostPortHeader, kPrefillerUrlHeader}) {
      const char* value = MHD_lookup_connection_value(connection, MHD_HEADER_KIND, header);
      if (value == nullptr) continue;
      // gRPC refuses a metadata value with control characters; so does the pick.
      std::string v(value);
      for (char& c : v) {
        if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
      }
      metadata.emplace_back(header, std::move(v));
    }
    call->exchange = Exchange::Start(stub_.get(), tokenizer_, std::move(*generate), *request,
                                     std::move(meta), std::move(*detokenizer),
                                     [connection] { MHD_resume_connection(connection); },
                                     exchanges_, metadata);
    absl::MutexLock lock(&mu_);
    call->live_id = next_live_++;
    live_[call->live_id] = call->exchange;
    return absl::OkStatus();
  }

  std::unique_ptr<v1::DecodeService::Stub> stub_;
  const std::shared_ptr<ExchangeSet> exchanges_ = std::make_shared<ExchangeSet>();
  const model::Tokenizer* const tokenizer_;
  const ChatRenderer chat_;
  const HttpServerOptions options_;
  const int64_t created_;
  std::string id_prefix_;
  std::atomic<uint64_t> serial_{0};
  absl::Mutex mu_;
  uint64_t next_live_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, std::weak_ptr<Exchange>> live_ ABSL_GUARDED_BY(mu_);
};

namespace {

MHD_Result HandleRequest(void* cls, MHD_Connection* connection, const char* url, const char* method,
                         const char*, const char* upload_data, size_t* upload_data_size,
                         void** per_request) {
  return static_cast<HttpServer::Impl*>(cls)->Handle(connection, url, method, upload_data,
                                                     upload_data_size, per_request);
}

void RequestCompleted(void* cls, MHD_Connection*, void** per_request, MHD_RequestTerminationCode) {
  static_cast<HttpServer::Impl*>(cls)->Completed(per_request);
}

}  // namespace

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(
    const std::string& address, std::shared_ptr<grpc::Channel> channel,
    const model::Tokenizer* tokenizer, ChatRenderer chat, HttpServerOptions options) {
  auto addr = ParseAddress(address);
  if (!addr.ok()) return addr.status();
  const unsigned int max_connections = options.max_connections;
  std::unique_ptr<HttpServer> server(new HttpServer(
      std::make_unique<Impl>(std::move(channel), tokenizer, std::move(chat), std::move(options))));
  // One polling thread for every connection (epoll); a connection waiting for tokens is
  // suspended, so streams hold no thread. The stack size is explicit for the reason
  // common/metrics_http.cc gives (static TLS of the binary's libraries).
  const unsigned int flags =
      MHD_USE_INTERNAL_POLLING_THREAD | MHD_ALLOW_SUSPEND_RESUME |
      (MHD_is_feature_supported(MHD_FEATURE_EPOLL) == MHD_YES ? MHD_USE_EPOLL : MHD_USE_POLL);
  server->daemon_ = MHD_start_daemon(
      flags, 0, nullptr, nullptr, &HandleRequest, server->impl_.get(), MHD_OPTION_SOCK_ADDR, &*addr,
      MHD_OPTION_THREAD_STACK_SIZE, static_cast<size_t>(1) << 20, MHD_OPTION_NOTIFY_COMPLETED,
      &RequestCompleted, server->impl_.get(), MHD_OPTION_CONNECTION_TIMEOUT, 60u,
      MHD_OPTION_CONNECTION_LIMIT, max_connections, MHD_OPTION_END);
  if (server->daemon_ == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("http: cannot listen on '", address, "' (port in use?)"));
  }
  const MHD_DaemonInfo* info = MHD_get_daemon_info(server->daemon_, MHD_DAEMON_INFO_BIND_PORT);
  server->port_ = info != nullptr ? info->port : ntohs(addr->sin_port);
  return server;
}

HttpServer::~HttpServer() {
  if (daemon_ == nullptr) return;
  MHD_quiesce_daemon(daemon_);  // no new connections
  impl_->CancelAll(absl::Seconds(5));
  MHD_stop_daemon(daemon_);
  impl_->EndAllCalls();
}

}  // namespace fluxion::cluster::openai

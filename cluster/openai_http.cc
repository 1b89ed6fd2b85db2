#include "cluster/openai_http.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <ctime>
#include <iostream>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cluster/openai_http_impl.h"
#include "common/ipv4_address.h"
#include "common/metrics_names.h"
#include "microhttpd.h"

namespace fluxion::cluster::openai {
namespace {

void LogToStderr(const std::string& line) { std::cerr << line << std::endl; }

// How long a stopping server lets its connections write their last answers.
constexpr absl::Duration kAnswerGrace = absl::Seconds(5);

// What open requests are answered (503) when the server stops.
absl::Status ShuttingDown() { return absl::UnavailableError("the router is shutting down"); }

// "host:port" -> IPv4 socket address (the host may be a name).
absl::StatusOr<sockaddr_in> ParseAddress(const std::string& address) {
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) ||
      port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("http: '", address, "' is not host:port (e.g. 0.0.0.0:8000)"));
  }
  return ResolveIpv4(address.substr(0, colon), port, "http");
}

}  // namespace

HttpServer::Impl::Impl(std::shared_ptr<grpc::Channel> channel, const model::Tokenizer* tokenizer,
                       ChatRenderer chat, HttpServerOptions options,
                       std::unique_ptr<HangupWatcher> watcher)
    : stub_(v1::DecodeService::NewStub(channel)),
      tokenizer_(tokenizer),
      chat_(std::move(chat)),
      options_(std::move(options)),
      created_(std::time(nullptr)),
      limiter_(options_.limits, options_.registry, options_.log ? options_.log : LogToStderr),
      requests_shed_(options_.registry->AddCounter(
          metrics::names::kRouterHttpRequestsShedTotal,
          "HTTP API requests answered 429 because the queue for their CPU work (parsing, "
          "tokenization; --http-max-queued) was full.",
          {{"reason", "work_queue_full"}})),
      watcher_(std::move(watcher)),
      pool_(options_.workers, options_.max_queued) {
  preparer_ = {tokenizer_,
               &chat_,
               options_.model_name,
               options_.parse_limits,
               options_.tokenize_timeout,
               options_.max_context_tokens,
               options_.generation_defaults};
  std::random_device random;
  id_prefix_ = absl::StrFormat("%08x%08x", random(), random());
}

void HttpServer::Impl::Suspend(MHD_Connection* connection) {
  {
    absl::MutexLock lock(&suspend_mu_);
    ++suspended_;
  }
  MHD_suspend_connection(connection);
}

void HttpServer::Impl::Resume(MHD_Connection* connection) {
  MHD_resume_connection(connection);
  absl::MutexLock lock(&suspend_mu_);
  --suspended_;
}

void HttpServer::Impl::Completed(void** per_request) {
  auto* call = static_cast<Call*>(*per_request);
  if (call == nullptr) return;
  *per_request = nullptr;
  if (call->state != nullptr) {
    watcher_->Unwatch(call->watch_id);  // before libmicrohttpd closes the socket
    // Normally a no-op (the call ended before the answer did); for a client that went away
    // mid-stream it cancels the Generate call, which the router relays downstream.
    call->state->Detach();
    absl::MutexLock lock(&mu_);
    calls_.erase(call->state_id);
  }
  delete call;
}

void HttpServer::Impl::Opened(MHD_Connection* connection, void** socket_context) {
  const MHD_ConnectionInfo* info =
      MHD_get_connection_info(connection, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
  // Owned by libmicrohttpd's socket context until Closed.
  auto* client =
      new std::string(ConnectionLimiter::ClientKey(info != nullptr ? info->client_addr : nullptr));
  limiter_.Opened(*client);
  *socket_context = client;
}

void HttpServer::Impl::Closed(void** socket_context) {
  auto* client = static_cast<std::string*>(*socket_context);
  if (client == nullptr) return;
  limiter_.Closed(*client);
  delete client;
  *socket_context = nullptr;
}

void HttpServer::Impl::StopCalls() {
  std::vector<std::shared_ptr<CallState>> states;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    for (auto& [id, weak] : calls_) {
      if (auto s = weak.lock()) states.push_back(std::move(s));
    }
  }
  for (auto& s : states) s->Cancel(ShuttingDown());
  pool_.Stop();  // the queued preparations see their cancellation and resume their connections
  exchanges_->CancelAll(ShuttingDown());
  {
    absl::MutexLock lock(&suspend_mu_);
    auto none = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(suspend_mu_) { return suspended_ == 0; };
    suspend_mu_.Await(absl::Condition(&none));
  }
  // Resumed connections still have their answers (503, the end of a stream) to write: a grace
  // period for that, bounded since a client that does not read would hold it.
  absl::MutexLock lock(&mu_);
  auto answered = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return calls_.empty(); };
  mu_.AwaitWithTimeout(absl::Condition(&answered), kAnswerGrace);
}

void HttpServer::Impl::EndAllCalls() {
  watcher_.reset();  // every socket was unwatched in Completed; no callback runs after this
  exchanges_->CancelAll(ShuttingDown());
  exchanges_->AwaitEmpty();
}

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

MHD_Result AcceptPolicy(void* cls, const sockaddr* addr, socklen_t) {
  return static_cast<HttpServer::Impl*>(cls)->Admit(addr) ? MHD_YES : MHD_NO;
}

void NotifyConnection(void* cls, MHD_Connection* connection, void** socket_context,
                      MHD_ConnectionNotificationCode code) {
  auto* impl = static_cast<HttpServer::Impl*>(cls);
  if (code == MHD_CONNECTION_NOTIFY_STARTED) {
    impl->Opened(connection, socket_context);
  } else {
    impl->Closed(socket_context);
  }
}

absl::Status CheckOptions(const HttpServerOptions& o) {
  if (o.workers < 1 || o.limits.total < 1 || o.idle_timeout_s < 1) {
    return absl::InvalidArgumentError(
        "http: workers, the connection limit and the idle timeout must be at least 1");
  }
  return absl::OkStatus();
}

}  // namespace

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(
    const std::string& address, std::shared_ptr<grpc::Channel> channel,
    const model::Tokenizer* tokenizer, ChatRenderer chat, HttpServerOptions options) {
  auto addr = ParseAddress(address);
  if (!addr.ok()) return addr.status();
  if (absl::Status s = CheckOptions(options); !s.ok()) return s;
  auto watcher = HangupWatcher::Start();
  if (!watcher.ok()) return watcher.status();
  std::unique_ptr<metrics::Registry> own_registry;
  if (options.registry == nullptr) {
    own_registry = std::make_unique<metrics::Registry>();
    options.registry = own_registry.get();
  }
  const ConnectionLimits limits = options.limits;
  const unsigned int idle_timeout_s = options.idle_timeout_s;
  std::unique_ptr<HttpServer> server(new HttpServer(std::make_unique<Impl>(
      std::move(channel), tokenizer, std::move(chat), std::move(options), std::move(*watcher))));
  server->own_registry_ = std::move(own_registry);
  Impl* impl = server->impl_.get();
  // One polling thread for every connection (epoll); a connection waiting for anything is
  // suspended, so it holds no thread. The stack size is explicit for the reason
  // common/metrics_http.cc gives (static TLS of the binary's libraries). libmicrohttpd's own
  // connection limit sits above ours, so that AcceptPolicy (which counts and logs) refuses first.
  const unsigned int flags =
      MHD_USE_INTERNAL_POLLING_THREAD | MHD_ALLOW_SUSPEND_RESUME |
      (MHD_is_feature_supported(MHD_FEATURE_EPOLL) == MHD_YES ? MHD_USE_EPOLL : MHD_USE_POLL);
  server->daemon_ = MHD_start_daemon(
      flags, 0, &AcceptPolicy, impl, &HandleRequest, impl, MHD_OPTION_SOCK_ADDR, &*addr,
      MHD_OPTION_THREAD_STACK_SIZE, static_cast<size_t>(1) << 20, MHD_OPTION_NOTIFY_COMPLETED,
      &RequestCompleted, impl, MHD_OPTION_NOTIFY_CONNECTION, &NotifyConnection, impl,
      MHD_OPTION_CONNECTION_TIMEOUT, idle_timeout_s, MHD_OPTION_CONNECTION_LIMIT, limits.total + 16,
      MHD_OPTION_END);
  if (server->daemon_ == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("http: cannot listen on '", address, "' (port in use?)"));
  }
  const MHD_DaemonInfo* info = MHD_get_daemon_info(server->daemon_, MHD_DAEMON_INFO_BIND_PORT);
  server->port_ = info != nullptr ? info->port : ntohs(addr->sin_port);
  return server;
}

HttpServer::~HttpServer() {
  if (daemon_ != nullptr) {
    // No new connections; the listening socket is ours to close once the daemon stopped.
    const MHD_socket listening = MHD_quiesce_daemon(daemon_);
    impl_->StopCalls();
    MHD_stop_daemon(daemon_);
    if (listening != MHD_INVALID_SOCKET) close(listening);
  }
  impl_->EndAllCalls();
}

}  // namespace fluxion::cluster::openai

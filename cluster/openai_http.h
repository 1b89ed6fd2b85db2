// The router's OpenAI-compatible HTTP API (docs/PROTOCOL.md, "OpenAI-compatible HTTP API"):
// POST /v1/completions, POST /v1/chat/completions (whole or streamed as server-sent events),
// GET /v1/models, GET /health; served with GNU libmicrohttpd (docs/DEPENDENCIES.md).
//
// Each request becomes a Generate call on the router's own DecodeService through `channel` (the
// gRPC server's in-process channel). Threads:
// - one polling thread (libmicrohttpd, epoll) for every connection, streams included: it only
//   moves bytes and never waits or computes. A connection waiting for anything is suspended.
// - a bounded pool of workers for each POST's CPU work (parsing, chat template, tokenization:
//   openai_call.h); when its queue is full the request gets 429 with Retry-After.
// - a hang-up watcher (http_hangup_watcher.h): a client that disconnects while its connection is
//   suspended (preparing, before the first token, during a whole answer's generation) cancels its
//   preparation or its call at once; the router relays the cancel to the decode node.
// Connections are limited in all and per client address, and closed when idle
// (http_connection_limits.h; a suspended connection never times out). Ambiguous framing is
// refused before the body (openai_http_framing.h).
//
// Thread-safe. The tokenizer and the chat renderer must outlive the server.
#ifndef FLUXION_CLUSTER_OPENAI_HTTP_H_
#define FLUXION_CLUSTER_OPENAI_HTTP_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cluster/http_connection_limits.h"
#include "cluster/openai_generate.h"
#include "cluster/openai_request.h"
#include "model/generation_config.h"
#include "common/metrics.h"
#include "grpcpp/grpcpp.h"
#include "model/tokenizer.h"

struct MHD_Daemon;

namespace fluxion::cluster::openai {

struct HttpServerOptions {
  // The model id clients must name (and /v1/models lists).
  std::string model_name = "fluxion";
  // Request bodies beyond this get 413 (a 1 MiB body is a ~250K-token prompt).
  size_t max_body_bytes = 1u << 20;
  ParseLimits parse_limits;
  // Connections beyond these are closed at accept, counted and logged.
  ConnectionLimits limits;
  // A connection idle this long is closed: request headers or body not arriving, a keep-alive
  // connection without a next request, an answer the client does not read. A connection waiting
  // for its preparation or for the router is suspended and never times out.
  unsigned int idle_timeout_s = 10;
  // Worker threads for the requests' CPU work, and how many requests may wait for one (beyond:
  // 429 with Retry-After).
  int workers = 2;
  size_t max_queued = 64;
  // Rendering and tokenizing one prompt may take this long; then 400 saying so.
  absl::Duration tokenize_timeout = absl::Seconds(10);
  // Bearer key every /v1/ request must carry (`Authorization: Bearer KEY`); empty: none. A request
  // without it gets 401 before its body is read. /health and /version stay open (probes).
  std::string api_key;
  // The model's context in tokens: a longer request gets OpenAI's context_length_exceeded 400
  // here, before it reaches a node; 0: unknown (the decode node refuses it, 400 too).
  int64_t max_context_tokens = 0;
  // generation_config.json's sampling defaults, for requests that leave a field unset.
  model::GenerationDefaults generation_defaults;
  // Whether the router can serve (a healthy decode node): GET /health answers 200 or 503.
  std::function<bool()> ready = [] { return true; };
  // Where the counters go (fluxion_router_http_*); nullptr: a registry of the server's own.
  metrics::Registry* registry = nullptr;
  // Operational lines (connections refused, rate-limited); empty: stderr.
  std::function<void(const std::string&)> log;
};

class HttpServer {
 public:
  // Listens on `address` ("host:port", port 0 picks a free one). UNAVAILABLE when the port
  // cannot be bound, INVALID_ARGUMENT for a malformed address or options. `chat` may be empty
  // (no chat template: chat requests get 400).
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const std::string& address,
                                                           std::shared_ptr<grpc::Channel> channel,
                                                           const model::Tokenizer* tokenizer,
                                                           ChatRenderer chat,
                                                           HttpServerOptions options);
  // Stops taking connections, cancels every preparation and call (open requests are answered
  // 503 or end their streams), stops, and returns once no call is left.
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const { return port_; }

  class Impl;

 private:
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<metrics::Registry> own_registry_;  // when the options name none
  std::unique_ptr<Impl> impl_;
  MHD_Daemon* daemon_ = nullptr;
  int port_ = 0;
};

}  // namespace fluxion::cluster::openai

#endif  // FLUXION_CLUSTER_OPENAI_HTTP_H_

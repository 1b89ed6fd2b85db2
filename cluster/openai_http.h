// The router's OpenAI-compatible HTTP API (docs/PROTOCOL.md, "OpenAI-compatible HTTP API"):
// POST /v1/completions, POST /v1/chat/completions (whole or streamed as server-sent events),
// GET /v1/models, GET /health; served with GNU libmicrohttpd (docs/DEPENDENCIES.md).
//
// Each request becomes a Generate call on the router's own DecodeService through `channel` (the
// gRPC server's in-process channel). Connections waiting for the router are suspended, not
// parked on a thread: one polling thread serves every connection, streams included. A client that
// disconnects cancels its call, and the router cancels the decode node's stream.
//
// A suspended connection is not polled, so a client that goes away while no token arrives is
// noticed at the next token (or the end of the request), not at once.
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
#include "cluster/openai_generate.h"
#include "cluster/openai_request.h"
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
  unsigned int max_connections = 1024;
  // Whether the router can serve (a healthy decode node): GET /health answers 200 or 503.
  std::function<bool()> ready = [] { return true; };
};

class HttpServer {
 public:
  // Listens on `address` ("host:port", port 0 picks a free one). UNAVAILABLE when the port
  // cannot be bound, INVALID_ARGUMENT for a malformed address. `chat` may be empty (no chat
  // template: chat requests get 400).
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const std::string& address,
                                                           std::shared_ptr<grpc::Channel> channel,
                                                           const model::Tokenizer* tokenizer,
                                                           ChatRenderer chat,
                                                           HttpServerOptions options);
  // Cancels the calls in flight, then stops listening.
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const { return port_; }

  class Impl;

 private:
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  MHD_Daemon* daemon_ = nullptr;
  int port_ = 0;
};

}  // namespace fluxion::cluster::openai

#endif  // FLUXION_CLUSTER_OPENAI_HTTP_H_

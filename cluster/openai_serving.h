// `fluxion router`'s OpenAI HTTP API switch: its flags, and starting the server with the model's
// tokenizer and chat template next to the router's gRPC server. Kept apart from router_command.cc
// so that the command stays one list of steps.
#ifndef FLUXION_CLUSTER_OPENAI_SERVING_H_
#define FLUXION_CLUSTER_OPENAI_SERVING_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "cluster/openai_http.h"
#include "common/flag_set.h"
#include "common/served_model_name.h"
#include "grpcpp/grpcpp.h"
#include "model/tokenizer.h"

namespace fluxion::cluster {

struct OpenAiFlags {
  std::string http_listen;  // empty: no HTTP API
  std::string http_port_file;
  std::string model_dir;  // the router's --model-dir (router_command.cc registers it once)
  // Its tokenizer, loaded once by the router for both text front ends; required with
  // http_listen.
  std::shared_ptr<const model::Tokenizer> tokenizer;
  std::string served_model_name;
  // --chat-template: a Jinja chat template file used instead of the model's (empty: the model's
  // tokenizer_config.json chat_template).
  std::string chat_template;
  // The longest context the HTTP API lets a request reach (--max-model-len): 0 = the model's
  // max_position_embeddings. The decode nodes hold gRPC clients to their own.
  int64_t max_model_len = 0;
  int64_t max_body_bytes = 1 << 20;
  // Connection limits, idle timeout, CPU workers and their queue, the tokenization bound
  // (openai::HttpServerOptions says what each does).
  int64_t max_connections = 1024;
  int64_t max_connections_per_client = 256;
  int64_t idle_timeout_s = 10;
  int64_t workers = 2;
  int64_t max_queued = 64;
  int64_t tokenize_timeout_ms = 10000;
  // Bearer key the /v1/ endpoints require (empty: none); --api-key, else $FLUXION_API_KEY.
  std::string api_key;
};

void RegisterOpenAiFlags(FlagSet& flags, OpenAiFlags* out);

// The running API and what it borrows (tokenizer, chat template).
class OpenAiServing {
 public:
  ~OpenAiServing();
  int port() const;

 private:
  friend absl::StatusOr<std::unique_ptr<OpenAiServing>> StartOpenAiHttp(const OpenAiFlags&,
                                                                        grpc::Server*,
                                                                        std::function<bool()>);
  OpenAiServing() = default;
  std::shared_ptr<const model::Tokenizer> tokenizer_;
  std::unique_ptr<openai::HttpServer> server_;  // destroyed first: it uses the tokenizer
};

// nullptr when --http-listen is empty. Prints the address. `ready`: a healthy decode node.
absl::StatusOr<std::unique_ptr<OpenAiServing>> StartOpenAiHttp(const OpenAiFlags& flags,
                                                               grpc::Server* server,
                                                               std::function<bool()> ready);

}  // namespace fluxion::cluster

#endif  // FLUXION_CLUSTER_OPENAI_SERVING_H_

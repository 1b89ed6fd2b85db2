#include "cluster/openai_serving.h"

#include <cstdlib>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "common/metrics.h"
#include "common/server_main.h"
#include "model/chat_template.h"
#include "model/config.h"
#include "model/generation_config.h"

namespace fluxion::cluster {

namespace {

absl::Status CheckLimitFlags(const OpenAiFlags& f) {
  struct Bound {
    const char* flag;
    int64_t value, low, high;
  };
  for (const Bound& b :
       {Bound{"--http-max-connections", f.max_connections, 1, 1 << 20},
        Bound{"--http-max-connections-per-client", f.max_connections_per_client, 0, 1 << 20},
        Bound{"--http-idle-timeout-s", f.idle_timeout_s, 1, 86400},
        Bound{"--http-workers", f.workers, 1, 256},
        Bound{"--http-max-queued", f.max_queued, 0, 1 << 20},
        Bound{"--http-tokenize-timeout-ms", f.tokenize_timeout_ms, 1, int64_t{3600} * 1000}}) {
    if (b.value < b.low || b.value > b.high) {
      return absl::InvalidArgumentError(
          absl::StrCat(b.flag, " must be in [", b.low, ", ", b.high, "], got ", b.value));
    }
  }
  return absl::OkStatus();
}

// The context the HTTP API checks requests against, for OpenAI's context_length_exceeded answer:
// --max-model-len, else the model's max_position_embeddings; 0 (a directory without a readable
// config.json and no flag) leaves the check to the decode node.
absl::StatusOr<int64_t> ContextLimit(const OpenAiFlags& f) {
  if (f.max_model_len < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-model-len must be >= 0 (0 = the model's), got ", f.max_model_len));
  }
  auto config = model::LoadModelConfig(f.model_dir + "/config.json");
  if (!config.ok()) return f.max_model_len;
  if (f.max_model_len > config->max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-model-len ", f.max_model_len, " exceeds the model's max_position_embeddings (",
        config->max_position_embeddings, ")"));
  }
  return f.max_model_len > 0 ? f.max_model_len : config->max_position_embeddings;
}

}  // namespace

void RegisterOpenAiFlags(FlagSet& flags, OpenAiFlags* out) {
  flags.String("http-listen", &out->http_listen,
               "address of the OpenAI-compatible HTTP API, host:port (port 0 picks a free one; "
               "empty: off). Needs --model-dir (docs/PROTOCOL.md)");
  flags.String("http-port-file", &out->http_port_file,
               "write the bound HTTP API port into this file once serving");
  flags.String("chat-template", &out->chat_template,
               "a Jinja chat template file for /v1/chat/completions instead of the model's "
               "tokenizer_config.json chat_template (docs/CHAT.md)");
  flags.String("served-model-name", &out->served_model_name,
               "model id the HTTP API answers to (default: the model directory's name)");
  flags.Int("max-model-len", &out->max_model_len,
            "longest context (prompt plus max_tokens) the HTTP API accepts, at most the model's "
            "max_position_embeddings (0: that); longer requests get OpenAI's "
            "context_length_exceeded 400. Give the decode nodes the same --max-model-len");
  flags.Int("http-max-body-bytes", &out->max_body_bytes,
            "largest HTTP request body accepted (413 beyond)");
  flags.Int("http-max-connections", &out->max_connections,
            "HTTP connections held at once; more are closed at accept (counted in "
            "fluxion_router_http_connections_refused_total, logged)");
  flags.Int("http-max-connections-per-client", &out->max_connections_per_client,
            "HTTP connections held at once from one client address, so that one client cannot "
            "take them all (0: no per-client limit; raise it, or 0, behind a proxy that sends "
            "everything from one address)");
  flags.Int("http-idle-timeout-s", &out->idle_timeout_s,
            "close an HTTP connection idle this long: headers or body not arriving, a keep-alive "
            "connection without a next request, an answer not read (never one waiting for its "
            "tokens)");
  flags.Int("http-workers", &out->workers,
            "threads for the HTTP requests' CPU work (JSON parsing, chat template, tokenization), "
            "off the connection-polling thread");
  flags.Int("http-max-queued", &out->max_queued,
            "HTTP requests that may wait for a worker; more get 429 with Retry-After");
  flags.Int("http-tokenize-timeout-ms", &out->tokenize_timeout_ms,
            "longest one request's prompt may take to render and tokenize; then 400 saying so "
            "(bounds what a hostile text or tokenizer.json costs)");
  flags.String("api-key", &out->api_key,
               "key the HTTP API's /v1/ endpoints require as `Authorization: Bearer KEY` (401 "
               "otherwise; /health and /version stay open), as vLLM's --api-key; default: "
               "$FLUXION_API_KEY, else none (a key on the command line is visible in ps: prefer "
               "the environment)");
}

OpenAiServing::~OpenAiServing() { server_.reset(); }

int OpenAiServing::port() const { return server_->port(); }

absl::StatusOr<std::unique_ptr<OpenAiServing>> StartOpenAiHttp(const OpenAiFlags& flags,
                                                               grpc::Server* server,
                                                               std::function<bool()> ready) {
  if (flags.http_listen.empty()) return nullptr;
  if (flags.model_dir.empty()) {
    return absl::InvalidArgumentError("--http-listen needs --model-dir (the tokenizer's model)");
  }
  if (flags.max_body_bytes < 1024 || flags.max_body_bytes > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError("--http-max-body-bytes must be in [1024, 1073741824]");
  }
  if (absl::Status s = CheckLimitFlags(flags); !s.ok()) return s;
  if (flags.tokenizer == nullptr) {
    return absl::InvalidArgumentError("--http-listen needs --model-dir's tokenizer");
  }
  std::unique_ptr<OpenAiServing> serving(new OpenAiServing());
  serving->tokenizer_ = flags.tokenizer;
  // The model's chat template (model/chat_template.h). Without one the API still serves
  // completions, and chat requests get 400 saying why.
  openai::ChatRenderer chat;
  std::string chat_name;
  auto chat_template = model::ChatTemplate::Load(flags.model_dir, flags.chat_template);
  if (!chat_template.ok() && !flags.chat_template.empty()) {
    return chat_template.status();  // a template asked for by flag must work
  }
  if (chat_template.ok()) {
    auto shared = std::make_shared<const model::ChatTemplate>(std::move(*chat_template));
    chat_name = shared->name();
    chat = [shared](const std::vector<openai::Message>& messages,
                    const nlohmann::json& kwargs) -> absl::StatusOr<std::string> {
      std::vector<model::ChatMessage> converted;
      converted.reserve(messages.size());
      for (const openai::Message& m : messages) converted.push_back({m.role, m.content, m.name});
      // The template sees the kwargs in the request's order (ordered_json keeps it).
      return shared->Render(converted, /*add_generation_prompt=*/true,
                            nlohmann::ordered_json::parse(kwargs.dump()));
    };
  } else {
    const std::string why(chat_template.status().message());
    chat_name = "none: " + why;
    chat = [why](const std::vector<openai::Message>&,
                 const nlohmann::json&) -> absl::StatusOr<std::string> {
      return absl::InvalidArgumentError(
          absl::StrCat("chat completions are not available for this model: ", why));
    };
  }
  openai::HttpServerOptions options;
  options.model_name = ServedModelName(flags.served_model_name, flags.model_dir);
  options.max_body_bytes = static_cast<size_t>(flags.max_body_bytes);
  options.limits.total = static_cast<unsigned int>(flags.max_connections);
  options.limits.per_client = static_cast<unsigned int>(flags.max_connections_per_client);
  options.idle_timeout_s = static_cast<unsigned int>(flags.idle_timeout_s);
  options.workers = static_cast<int>(flags.workers);
  options.max_queued = static_cast<size_t>(flags.max_queued);
  options.tokenize_timeout = absl::Milliseconds(flags.tokenize_timeout_ms);
  options.api_key = flags.api_key;
  if (const char* env = std::getenv("FLUXION_API_KEY"); options.api_key.empty() && env != nullptr) {
    options.api_key = env;
  }
  auto limit = ContextLimit(flags);
  if (!limit.ok()) return limit.status();
  options.max_context_tokens = *limit;
  auto defaults = model::LoadGenerationConfig(flags.model_dir);
  if (!defaults.ok()) return defaults.status();
  options.generation_defaults = *defaults;
  options.registry = &metrics::Registry::Default();
  options.ready = std::move(ready);
  auto started = openai::HttpServer::Start(flags.http_listen,
                                           server->InProcessChannel(grpc::ChannelArguments()),
                                           serving->tokenizer_.get(), chat, options);
  if (!started.ok()) return started.status();
  serving->server_ = std::move(*started);
  serving::WritePortFile(flags.http_port_file, serving->server_->port());
  std::cout << "router: OpenAI-compatible HTTP API on port " << serving->server_->port()
            << " (model \"" << options.model_name << "\", chat template " << chat_name << ")"
            << std::endl;
  return serving;
}

}  // namespace fluxion::cluster

// Answering one request of the HTTP API (openai_http_impl.h): routing and framing checks, the
// body, the worker that prepares it, the head and the stream.
#include <algorithm>
#include <cstring>
#include <ctime>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "cluster/openai_http_framing.h"
#include "cluster/openai_http_impl.h"
#include "cluster/openai_response.h"
#include "cluster/openai_tokenize.h"
#include "common/build_version.h"
#include "common/secret_token.h"
#include "cluster/prefill_pick.h"
#include "microhttpd.h"

namespace fluxion::cluster::openai {
namespace {

constexpr char kJson[] = "application/json";
constexpr char kRequestIdHeader[] = "X-Request-Id";
constexpr size_t kMaxRequestId = 128;

// A client's X-Request-Id, when it is one we echo and log: 1-128 characters of [A-Za-z0-9._:-]
// (no room for header or log injection). Empty when absent; *valid false when present and not.
std::string ClientRequestId(MHD_Connection* connection, bool* valid) {
  *valid = true;
  const char* value = MHD_lookup_connection_value(connection, MHD_HEADER_KIND, kRequestIdHeader);
  if (value == nullptr) return "";
  const absl::string_view v(value);
  *valid = !v.empty() && v.size() <= kMaxRequestId &&
           std::all_of(v.begin(), v.end(), [](char c) {
             return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' ||
                    c == ':' || c == '-';
           });
  return *valid ? std::string(v) : "";
}

// `close`: the connection ends after the answer (its framing cannot be trusted for another).
// `request_id`: the X-Request-Id answered (empty: the client's own, when it sent a valid one).
MHD_Result Reply(MHD_Connection* connection, unsigned int code, const std::string& body,
                 int retry_after_s = 0, bool close = false, const std::string& request_id = "") {
  MHD_Response* response = MHD_create_response_from_buffer(
      body.size(), const_cast<char*>(body.data()), MHD_RESPMEM_MUST_COPY);
  if (response == nullptr) return MHD_NO;
  MHD_add_response_header(response, "Content-Type", kJson);
  bool valid = true;
  const std::string echoed = request_id.empty() ? ClientRequestId(connection, &valid) : request_id;
  if (!echoed.empty()) MHD_add_response_header(response, kRequestIdHeader, echoed.c_str());
  if (close) MHD_add_response_header(response, MHD_HTTP_HEADER_CONNECTION, "close");
  if (retry_after_s > 0) {
    MHD_add_response_header(response, "Retry-After", std::to_string(retry_after_s).c_str());
  }
  MHD_Result result = MHD_queue_response(connection, code, response);
  MHD_destroy_response(response);
  return result;
}

MHD_Result ReplyError(MHD_Connection* connection, const absl::Status& status,
                      const std::string& request_id = "") {
  ApiError error = ErrorFromStatus(status);
  return Reply(connection, error.http_status, ErrorJson(error), error.retry_after_s,
               /*close=*/false, request_id);
}

MHD_Result ReplyError(MHD_Connection* connection, int http_status, const std::string& message) {
  ApiError error;
  error.http_status = http_status;
  error.type = "invalid_request_error";
  error.message = message;
  return Reply(connection, http_status, ErrorJson(error));
}

// The gateway's prefill pick, which travels to the router as call metadata; the router maps it
// onto its prefill nodes or refuses it (cluster/prefill_pick.h; INVALID_ARGUMENT -> 400).
Metadata PrefillPickMetadata(MHD_Connection* connection) {
  Metadata metadata;
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
  return metadata;
}

}  // namespace

bool HttpServer::Impl::Authorized(MHD_Connection* connection) const {
  const char* value = MHD_lookup_connection_value(connection, MHD_HEADER_KIND,
                                                  MHD_HTTP_HEADER_AUTHORIZATION);
  if (value == nullptr) return false;
  absl::string_view v(value);
  if (!absl::ConsumePrefix(&v, "Bearer ")) return false;
  return TokensEqual(std::string(v), options_.api_key);  // no early exit on a partial match
}

MHD_Result HttpServer::Impl::Handle(MHD_Connection* connection, const char* url, const char* method,
                                    const char* upload_data, size_t* upload_data_size,
                                    void** per_request) {
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
  if (call->state == nullptr) {
    if (call->too_large) {
      return ReplyError(
          connection, MHD_HTTP_CONTENT_TOO_LARGE,
          absl::StrCat("the request body exceeds ", options_.max_body_bytes, " bytes"));
    }
    if (absl::Status s = Submit(call); !s.ok()) return ReplyError(connection, s, call->id);
  }
  if (call->completion == nullptr) {
    std::optional<CallState::Outcome> outcome =
        call->state->OutcomeOrSuspend([this, connection] { Suspend(connection); });
    if (!outcome) return MHD_YES;  // the worker resumes the connection
    if (!outcome->ok()) return ReplyError(connection, outcome->status(), call->id);
    if ((*outcome)->completion == nullptr) {
      return Reply(connection, MHD_HTTP_OK, (*outcome)->body, 0, /*close=*/false, call->id);
    }
    call->completion = (*outcome)->completion;
  }
  return Answer(call);
}

MHD_Result HttpServer::Impl::Begin(MHD_Connection* connection, const char* url, const char* method,
                                   void** per_request) {
  // Before anything else, and before the body is read: a request whose end we might find
  // elsewhere than a proxy in front of us is answered and the connection closed.
  if (absl::Status framing = CheckFraming(FramingHeadersOf(connection)); !framing.ok()) {
    return Reply(connection, MHD_HTTP_BAD_REQUEST, ErrorJson(ErrorFromStatus(framing)),
                 /*retry_after_s=*/0, /*close=*/true);
  }
  const bool tokenize = std::strcmp(url, "/tokenize") == 0;
  const bool detokenize = std::strcmp(url, "/detokenize") == 0;
  // vLLM's tokenizer endpoints cost CPU like a prompt does: they need the key as /v1/ does.
  const bool keyed = absl::StartsWith(url, "/v1/") || tokenize || detokenize;
  if (!options_.api_key.empty() && keyed && !Authorized(connection)) {
    return ReplyError(connection,
                      WithCode(absl::UnauthenticatedError(
                                   "Incorrect or missing API key: send `Authorization: Bearer "
                                   "<key>` with the key this server was started with"),
                               "invalid_api_key"));
  }
  const bool get = std::strcmp(method, "GET") == 0 || std::strcmp(method, "HEAD") == 0;
  const bool post = std::strcmp(method, "POST") == 0;
  std::optional<Endpoint> endpoint;
  if (std::strcmp(url, "/v1/completions") == 0) endpoint = Endpoint::kCompletions;
  if (std::strcmp(url, "/v1/chat/completions") == 0) endpoint = Endpoint::kChatCompletions;
  if (endpoint || tokenize || detokenize) {
    if (!post) {
      return ReplyError(connection, MHD_HTTP_METHOD_NOT_ALLOWED, absl::StrCat(url, " takes POST"));
    }
    // A declared length over the limit is refused before the body is read.
    const char* length =
        MHD_lookup_connection_value(connection, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    uint64_t declared = 0;
    if (length != nullptr && absl::SimpleAtoi(length, &declared) &&
        declared > options_.max_body_bytes) {
      return ReplyError(connection, MHD_HTTP_CONTENT_TOO_LARGE,
                        absl::StrCat("the request body (", declared, " bytes) exceeds ",
                                     options_.max_body_bytes, " bytes"));
    }
    bool valid_id = true;
    const std::string client_id = ClientRequestId(connection, &valid_id);
    if (!valid_id) {
      return ReplyError(connection, MHD_HTTP_BAD_REQUEST,
                        absl::StrCat("X-Request-Id must be 1-", kMaxRequestId,
                                     " characters of letters, digits and . _ : -"));
    }
    auto* call = new Call;
    call->connection = connection;
    call->route = tokenize     ? Call::Route::kTokenize
                  : detokenize ? Call::Route::kDetokenize
                               : Call::Route::kGenerate;
    call->endpoint = endpoint.value_or(Endpoint::kCompletions);
    // Ours, unique on this router; it carries the client's X-Request-Id, which is echoed as given.
    const bool chat = call->endpoint == Endpoint::kChatCompletions;
    call->generate_id =
        absl::StrCat(chat ? "chatcmpl-" : "cmpl-", client_id.empty() ? id_prefix_ : client_id, "-",
                     serial_.fetch_add(1));
    call->id = client_id.empty() ? call->generate_id : client_id;
    *per_request = call;
    return MHD_YES;
  }
  const bool models = std::strcmp(url, "/v1/models") == 0;
  const bool health = std::strcmp(url, "/health") == 0;
  const bool version = std::strcmp(url, "/version") == 0;
  if (!models && !health && !version) {
    return ReplyError(connection, MHD_HTTP_NOT_FOUND,
                      absl::StrCat("no such endpoint: ", url,
                                   " (served: POST /v1/completions, POST /v1/chat/completions, "
                                   "GET /v1/models, POST /tokenize, POST /detokenize, "
                                   "GET /health, GET /version)"));
  }
  if (!get) {
    return ReplyError(connection, MHD_HTTP_METHOD_NOT_ALLOWED, absl::StrCat(url, " takes GET"));
  }
  if (models) {
    return Reply(connection, MHD_HTTP_OK,
                 ModelsJson(options_.model_name, created_, options_.max_context_tokens));
  }
  // vLLM's shape: {"version": "..."}.
  if (version) return Reply(connection, MHD_HTTP_OK, VersionJson(BuildVersion()));
  if (options_.ready()) return Reply(connection, MHD_HTTP_OK, "{\"status\":\"ok\"}");
  return ReplyError(connection, absl::UnavailableError("no healthy decode node"));
}

// Hands the body to a worker and watches the socket meanwhile; RESOURCE_EXHAUSTED (429) when the
// queue is full.
absl::Status HttpServer::Impl::Submit(Call* call) {
  MHD_Connection* connection = call->connection;
  auto state = std::make_shared<CallState>([this, connection] { Resume(connection); });
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("the router is shutting down");
    call->state_id = next_state_++;
    calls_.emplace(call->state_id, state);
  }
  call->state = state;  // from here on Completed cleans up
  const MHD_ConnectionInfo* fd =
      MHD_get_connection_info(connection, MHD_CONNECTION_INFO_CONNECTION_FD);
  call->watch_id = watcher_->Watch(fd != nullptr ? fd->connect_fd : -1, [state] {
    state->Cancel(absl::CancelledError("the client closed the connection"));
  });
  auto job = [this, state, connection, route = call->route, endpoint = call->endpoint,
              body = std::move(call->body), id = call->generate_id,
              metadata = PrefillPickMetadata(connection)] {
    if (route == Call::Route::kGenerate) {
      Prepare(state, connection, endpoint, body, id, metadata);
    } else {
      AnswerTokenizer(state, route, body);
    }
  };
  if (!pool_.TrySubmit(std::move(job))) {
    requests_shed_->Increment();
    return absl::ResourceExhaustedError(
        absl::StrCat("the router's queue for request preparation (parsing, tokenization) is full (",
                     options_.max_queued, " waiting; --http-max-queued); retry later"));
  }
  return absl::OkStatus();
}

// On a worker: the CPU work, then the Generate call; the state resumes the connection.
void HttpServer::Impl::Prepare(const std::shared_ptr<CallState>& state, MHD_Connection* connection,
                               Endpoint endpoint, const std::string& body, const std::string& id,
                               const Metadata& metadata) {
  const model::EncodeCheck cancelled = [&state] { return state->CancelledWhy(); };
  const absl::Status why = state->CancelledWhy();
  absl::StatusOr<Prepared> prepared =
      why.ok() ? openai::Prepare(preparer_, endpoint, body, id, cancelled)
               : absl::StatusOr<Prepared>(why);
  state->Finish(prepared.status(), [&] {
    return Completion::Start(
        stub_.get(), *std::move(prepared), [this, connection] { Resume(connection); },
        exchanges_, metadata);
  });
}

void HttpServer::Impl::AnswerTokenizer(const std::shared_ptr<CallState>& state, Call::Route route,
                                       const std::string& body) {
  const model::EncodeCheck cancelled = [&state] { return state->CancelledWhy(); };
  state->FinishWithBody(route == Call::Route::kTokenize
                            ? TokenizeAnswer(preparer_, body, cancelled)
                            : DetokenizeAnswer(preparer_, body));
}

MHD_Result HttpServer::Impl::Answer(Call* call) {
  MHD_Connection* connection = call->connection;
  std::optional<Completion::Head> head =
      call->completion->HeadOrSuspend([this, connection] { Suspend(connection); });
  if (!head) return MHD_YES;  // resumed by the exchange when the head is decided
  if (!head->streaming) {
    return Reply(connection, head->http_status, head->body, head->retry_after_s, /*close=*/false,
                 call->id);
  }
  MHD_Response* response = MHD_create_response_from_callback(
      MHD_SIZE_UNKNOWN, 16 * 1024, &ReadStream, new StreamState{this, call->completion, connection},
      &FreeStream);
  if (response == nullptr) return MHD_NO;
  MHD_add_response_header(response, "Content-Type", "text/event-stream");
  MHD_add_response_header(response, "Cache-Control", "no-cache");
  MHD_add_response_header(response, kRequestIdHeader, call->id.c_str());
  MHD_Result result = MHD_queue_response(connection, MHD_HTTP_OK, response);
  MHD_destroy_response(response);
  return result;
}

ssize_t HttpServer::Impl::ReadStream(void* cls, uint64_t, char* buf, size_t max) {
  auto* s = static_cast<StreamState*>(cls);
  long n = s->completion->ReadOrSuspend(
      buf, max, [impl = s->impl, connection = s->connection] { impl->Suspend(connection); });
  return n < 0 ? MHD_CONTENT_READER_END_OF_STREAM : static_cast<ssize_t>(n);
}

}  // namespace fluxion::cluster::openai

// A small blocking HTTP client for the router's OpenAI API on loopback, so that `fluxion local`
// can show one answer of the cluster it started, and tests can call the API. libcurl underneath
// (docs/DEPENDENCIES.md): HTTP/1.1, chunked answers, timeouts. Not for production traffic: one
// request per handle, the whole answer read into memory.
//
// Thread-safe: a pure function (libcurl's global init runs once, under std::call_once).
#ifndef FLUXION_CLUSTER_OPENAI_CLIENT_H_
#define FLUXION_CLUSTER_OPENAI_CLIENT_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace fluxion::cluster::openai {

// POSTs `json` to http://127.0.0.1:<port><path>; the body of a 200 answer, else an error carrying
// the status line and body. Answers beyond 16 MiB are DATA_LOSS.
// `headers` are sent as given ({"x-prefiller-host-port", "10.0.0.5:8000"}).
absl::StatusOr<std::string> PostJsonToLoopback(
    int port, const std::string& path, const std::string& json, absl::Duration timeout,
    const std::vector<std::pair<std::string, std::string>>& headers = {});

// The text of one chat (when `chat`) or completion answer of the API on `port`, or why not.
absl::StatusOr<std::string> AskOnce(int port, const std::string& model, const std::string& text,
                                    bool chat, int max_tokens, absl::Duration timeout);

}  // namespace fluxion::cluster::openai

#endif  // FLUXION_CLUSTER_OPENAI_CLIENT_H_

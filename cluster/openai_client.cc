#include "cluster/openai_client.h"

#include <curl/curl.h>

#include <memory>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "model/json_text.h"
#include "nlohmann/json.hpp"

namespace fluxion::cluster::openai {

namespace {

constexpr size_t kMaxAnswer = 16u << 20;

struct Answer {
  std::string body;
  bool too_large = false;
};

size_t Append(char* data, size_t size, size_t count, void* user) {
  auto* answer = static_cast<Answer*>(user);
  const size_t n = size * count;
  if (answer->body.size() + n > kMaxAnswer) {
    answer->too_large = true;
    return 0;  // libcurl stops with CURLE_WRITE_ERROR
  }
  answer->body.append(data, n);
  return n;
}

}  // namespace

absl::StatusOr<std::string> PostJsonToLoopback(
    int port, const std::string& path, const std::string& json, absl::Duration timeout,
    const std::vector<std::pair<std::string, std::string>>& headers) {
  // curl_global_init is not thread-safe: once per process, before the first handle.
  static std::once_flag global_init;
  static CURLcode global_rc = CURLE_OK;
  std::call_once(global_init, [] { global_rc = curl_global_init(CURL_GLOBAL_DEFAULT); });
  if (global_rc != CURLE_OK) {
    return absl::InternalError(
        absl::StrCat("curl_global_init failed: ", curl_easy_strerror(global_rc)));
  }
  std::unique_ptr<CURL, void (*)(CURL*)> curl(curl_easy_init(), curl_easy_cleanup);
  if (curl == nullptr) return absl::InternalError("curl_easy_init failed");
  std::unique_ptr<curl_slist, void (*)(curl_slist*)> list(nullptr, curl_slist_free_all);
  auto add_header = [&list](const std::string& line) {
    curl_slist* grown = curl_slist_append(list.get(), line.c_str());
    if (grown == nullptr) return false;
    list.release();
    list.reset(grown);
    return true;
  };
  // "Expect:" off: no 100-continue round trip for a body this small.
  bool ok = add_header("Content-Type: application/json") && add_header("Expect:");
  for (const auto& [name, value] : headers) ok = ok && add_header(absl::StrCat(name, ": ", value));
  if (!ok) return absl::InternalError("curl_slist_append failed");

  const std::string url = absl::StrCat("http://127.0.0.1:", port, path);
  Answer answer;
  char error[CURL_ERROR_SIZE] = {0};
  CURL* c = curl.get();
  curl_easy_setopt(c, CURLOPT_URL, url.c_str());
  curl_easy_setopt(c, CURLOPT_NOPROXY, "*");  // loopback: never through an http_proxy
  curl_easy_setopt(c, CURLOPT_POST, 1L);
  curl_easy_setopt(c, CURLOPT_POSTFIELDS, json.data());
  curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(json.size()));
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, list.get());
  curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, static_cast<long>(absl::ToInt64Milliseconds(timeout)));
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);  // threads: no SIGALRM for timeouts
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, &Append);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &answer);
  curl_easy_setopt(c, CURLOPT_ERRORBUFFER, error);
  const CURLcode rc = curl_easy_perform(c);
  const std::string why = error[0] != 0 ? std::string(error) : curl_easy_strerror(rc);
  switch (rc) {
    case CURLE_OK:
      break;
    case CURLE_COULDNT_CONNECT:
      return absl::UnavailableError(absl::StrCat("cannot connect to 127.0.0.1:", port, ": ", why));
    case CURLE_OPERATION_TIMEDOUT:
      return absl::DeadlineExceededError(absl::StrCat("HTTP API: no answer in time: ", why));
    case CURLE_WRITE_ERROR:
      if (answer.too_large) return absl::DataLossError("HTTP answer over 16 MiB");
      [[fallthrough]];
    default:
      return absl::UnavailableError(absl::StrCat("HTTP API at ", url, ": ", why));
  }
  long status = 0;
  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
  if (status != 200) {
    return absl::UnknownError(absl::StrCat("HTTP ", status, ": ", answer.body));
  }
  return std::move(answer.body);
}

absl::StatusOr<std::string> AskOnce(int port, const std::string& model, const std::string& text,
                                    bool chat, int max_tokens, absl::Duration timeout) {
  nlohmann::json request = {{"model", model}, {"max_tokens", max_tokens}, {"temperature", 0}};
  if (chat) {
    request["messages"] = nlohmann::json::array({{{"role", "user"}, {"content", text}}});
  } else {
    request["prompt"] = text;
  }
  auto body = PostJsonToLoopback(port, chat ? "/v1/chat/completions" : "/v1/completions",
                                 request.dump(), timeout);
  if (!body.ok()) return body.status();
  auto json = model::ParseJsonText(*body, "the HTTP API's answer", {});
  if (!json.ok()) return json.status();
  const nlohmann::json& choices = (*json)["choices"];
  if (!choices.is_array() || choices.empty()) {
    return absl::DataLossError("the HTTP API's answer has no choices");
  }
  const nlohmann::json& choice = choices[0];
  const nlohmann::json& answer = chat ? choice["message"]["content"] : choice["text"];
  if (!answer.is_string()) return absl::DataLossError("the HTTP API's answer has no text");
  return answer.get<std::string>();
}

}  // namespace fluxion::cluster::openai

#include "cluster/openai_client.h"

#include <arpa/inet.h>
#include <sys/socket.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "model/json_text.h"
#include "nlohmann/json.hpp"

namespace fluxion::cluster::openai {

absl::StatusOr<std::string> PostJsonToLoopback(
    int port, const std::string& path, const std::string& json, absl::Duration timeout,
    const std::vector<std::pair<std::string, std::string>>& headers) {
  constexpr size_t kMaxAnswer = 16u << 20;
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError("socket() failed");
  timeval tv = absl::ToTimeval(timeout);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("cannot connect to 127.0.0.1:", port));
  }
  const std::string request = absl::StrCat(
      "POST ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n",
      [&] {
        std::string lines;
        for (const auto& [name, value] : headers) absl::StrAppend(&lines, name, ": ", value, "\r\n");
        return lines;
      }(),
      "Content-Length: ", json.size(), "\r\nConnection: close\r\n\r\n", json);
  size_t sent = 0;
  while (sent < request.size()) {
    ssize_t n = write(fd, request.data() + sent, request.size() - sent);
    if (n <= 0) {
      close(fd);
      return absl::UnavailableError("write to the HTTP API failed");
    }
    sent += static_cast<size_t>(n);
  }
  std::string answer;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0 && answer.size() <= kMaxAnswer) {
    answer.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  if (answer.size() > kMaxAnswer) return absl::DataLossError("HTTP answer over 16 MiB");
  const size_t header_end = answer.find("\r\n\r\n");
  if (header_end == std::string::npos) {
    return absl::DataLossError(n < 0 ? "HTTP API: no answer in time" : "HTTP API: no header");
  }
  const std::string body = answer.substr(header_end + 4);
  if (answer.compare(9, 3, "200") != 0) {
    return absl::UnknownError(absl::StrCat(answer.substr(0, answer.find("\r\n")), ": ", body));
  }
  return body;
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

// Raw loopback sockets for the HTTP API's tests: what libcurl will not send (malformed framing),
// connections held open or dropped at a chosen moment, and connections from another loopback
// source address (127.0.0.2 is loopback too on Linux). Header-only, for tests.
#ifndef FLUXION_CLUSTER_HTTP_TESTING_H_
#define FLUXION_CLUSTER_HTTP_TESTING_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace fluxion::cluster::openai::testing {

// A connected socket to 127.0.0.1:<port>, bound first to `source` (an IPv4 loopback address)
// when given; -1 on failure.
inline int ConnectLoopback(int port, const char* source = nullptr) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  if (source != nullptr) {
    sockaddr_in local{};
    local.sin_family = AF_INET;
    inet_pton(AF_INET, source, &local.sin_addr);
    if (bind(fd, reinterpret_cast<sockaddr*>(&local), sizeof(local)) != 0) {
      close(fd);
      return -1;
    }
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

inline bool SendAll(int fd, const std::string& data) {
  size_t sent = 0;
  while (sent < data.size()) {
    const ssize_t n = send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return false;
    sent += static_cast<size_t>(n);
  }
  return true;
}

// What the peer sends until `needle` appears in it (never, for an empty needle), it closes, or
// `timeout` passes (for answers on a connection the server keeps open).
inline std::string ReadUntil(int fd, const std::string& needle, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  std::string out;
  char buf[4096];
  while (needle.empty() || out.find(needle) == std::string::npos) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) break;
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1) <= 0) continue;
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

// Everything the peer sends until it closes the connection, or until `timeout` passes.
inline std::string ReadUntilClose(int fd, absl::Duration timeout) {
  return ReadUntil(fd, "", timeout);
}

// The status line of a raw answer ("HTTP/1.1 400 Bad Request"), or what came instead.
inline std::string StatusLine(const std::string& answer) {
  return answer.substr(0, answer.find("\r\n"));
}

}  // namespace fluxion::cluster::openai::testing

#endif  // FLUXION_CLUSTER_HTTP_TESTING_H_

// Test helpers for /metrics endpoints: a minimal HTTP GET over loopback, reading one sample of an
// exposition, and a promtool check.
// Header-only, for tests (common/, cluster/ and the services' suites) only.
#ifndef FLUXION_COMMON_METRICS_TESTING_H_
#define FLUXION_COMMON_METRICS_TESTING_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace fluxion::metrics::testing {

// GET http://127.0.0.1:<port><path>; returns the body of a 200 answer. Every socket operation has
// a timeout of `io_timeout` (whole seconds).
inline absl::StatusOr<std::string> HttpGet(int port, const std::string& path,
                                           absl::Duration io_timeout = absl::Seconds(5)) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError("socket");
  timeval tv{static_cast<time_t>(absl::ToInt64Seconds(io_timeout)), 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("connect to port ", port));
  }
  std::string request =
      absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  if (write(fd, request.data(), request.size()) != static_cast<ssize_t>(request.size())) {
    close(fd);
    return absl::UnavailableError("write");
  }
  std::string response;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) response.append(buf, n);
  close(fd);
  size_t header_end = response.find("\r\n\r\n");
  if (header_end == std::string::npos) return absl::DataLossError("no HTTP header in answer");
  if (response.compare(0, 12, "HTTP/1.1 200") != 0 && response.compare(0, 12, "HTTP/1.0 200") != 0) {
    return absl::UnknownError(absl::StrCat("HTTP answer: ", response.substr(0, header_end)));
  }
  return response.substr(header_end + 4);
}

// The value of the sample whose name and labels are exactly `series` in the exposition `text` (as
// rendered, e.g. `fluxion_decode_requests_total{code="OK"}`); NaN when there is none.
inline double SampleValue(const std::string& text, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.size() > series.size() && line.substr(0, series.size()) == series &&
        line[series.size()] == ' ') {
      double v;
      if (absl::SimpleAtod(line.substr(series.size() + 1), &v)) return v;
    }
  }
  return std::numeric_limits<double>::quiet_NaN();
}

// True when Prometheus' promtool is on PATH (Debian package `prometheus`).
inline bool HavePromtool() { return std::system("command -v promtool >/dev/null 2>&1") == 0; }

// Runs `promtool check metrics` on `exposition`; OK when it passes, otherwise the linter's output.
inline absl::Status PromtoolCheck(const std::string& exposition) {
  char path[] = "/tmp/fluxion_metrics_XXXXXX";
  int fd = mkstemp(path);
  if (fd < 0) return absl::InternalError("mkstemp");
  ssize_t written = write(fd, exposition.data(), exposition.size());
  close(fd);
  if (written != static_cast<ssize_t>(exposition.size())) return absl::InternalError("write");
  std::string command = absl::StrCat("promtool check metrics < ", path, " 2>&1");
  FILE* pipe = popen(command.c_str(), "r");
  std::string output;
  char buf[512];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) output.append(buf, n);
  int rc = pclose(pipe);
  unlink(path);
  if (rc != 0) return absl::InvalidArgumentError(absl::StrCat("promtool: ", output));
  return absl::OkStatus();
}

}  // namespace fluxion::metrics::testing

#endif  // FLUXION_COMMON_METRICS_TESTING_H_

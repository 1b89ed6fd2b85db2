#include "cluster/openai_http_framing.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "microhttpd.h"

namespace fluxion::cluster::openai {
namespace {

MHD_Result Collect(void* cls, MHD_ValueKind, const char* key, const char* value) {
  auto* headers = static_cast<FramingHeaders*>(cls);
  if (key == nullptr) return MHD_YES;
  const std::string v = value != nullptr ? value : "";
  if (absl::EqualsIgnoreCase(key, MHD_HTTP_HEADER_CONTENT_LENGTH)) {
    headers->content_length.push_back(v);
  } else if (absl::EqualsIgnoreCase(key, MHD_HTTP_HEADER_TRANSFER_ENCODING)) {
    headers->transfer_encoding.push_back(v);
  }
  return MHD_YES;
}

}  // namespace

absl::Status CheckFraming(const FramingHeaders& headers) {
  if (!headers.transfer_encoding.empty() && !headers.content_length.empty()) {
    return absl::InvalidArgumentError(
        "the request has both Content-Length and Transfer-Encoding; send one of them (RFC 9112 "
        "section 6.1: a proxy could read such a body differently)");
  }
  if (headers.transfer_encoding.size() > 1 ||
      (headers.transfer_encoding.size() == 1 &&
       !absl::EqualsIgnoreCase(absl::StripAsciiWhitespace(headers.transfer_encoding[0]),
                               "chunked"))) {
    std::string sent;
    for (const std::string& v : headers.transfer_encoding) {
      absl::StrAppend(&sent, sent.empty() ? "" : ", ", v);
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "Transfer-Encoding '", sent, "' is not accepted: only 'chunked', or a Content-Length"));
  }
  for (const std::string& v : headers.content_length) {
    if (absl::StripAsciiWhitespace(v) != absl::StripAsciiWhitespace(headers.content_length[0])) {
      return absl::InvalidArgumentError(absl::StrCat("conflicting Content-Length headers ('",
                                                     headers.content_length[0], "' and '", v,
                                                     "'); send one"));
    }
  }
  return absl::OkStatus();
}

FramingHeaders FramingHeadersOf(MHD_Connection* connection) {
  FramingHeaders headers;
  MHD_get_connection_values(connection, MHD_HEADER_KIND, &Collect, &headers);
  return headers;
}

}  // namespace fluxion::cluster::openai

// How an HTTP request says where its body ends (RFC 9112 section 6), checked before the body is
// read. A request that a proxy in front of the router could frame differently from us is refused
// (request smuggling): conflicting Content-Length headers, a Transfer-Encoding other than plain
// "chunked" (libmicrohttpd would read such a body until the connection closes), or both
// Content-Length and Transfer-Encoding. Identical repeated Content-Length headers are accepted,
// as RFC 9112 section 6.3 allows.
//
// Thread-safe: pure functions.
#ifndef FLUXION_CLUSTER_OPENAI_HTTP_FRAMING_H_
#define FLUXION_CLUSTER_OPENAI_HTTP_FRAMING_H_

#include <string>
#include <vector>

#include "absl/status/status.h"

struct MHD_Connection;

namespace fluxion::cluster::openai {

// The framing headers of one request, each line's value as sent.
struct FramingHeaders {
  std::vector<std::string> content_length;
  std::vector<std::string> transfer_encoding;
};

// InvalidArgument saying what is wrong and what is accepted.
absl::Status CheckFraming(const FramingHeaders& headers);

// The framing headers of the request `connection` is receiving (from libmicrohttpd's header
// list, which keeps repeated headers apart).
FramingHeaders FramingHeadersOf(MHD_Connection* connection);

}  // namespace fluxion::cluster::openai

#endif  // FLUXION_CLUSTER_OPENAI_HTTP_FRAMING_H_

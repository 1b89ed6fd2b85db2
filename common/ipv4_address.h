// host -> IPv4 socket address for the project's HTTP listeners (/metrics, the OpenAI API):
// a dotted quad as is, otherwise the first IPv4 address the resolver gives for the name.
//
// Thread-safe: a pure function (getaddrinfo is).
#ifndef FLUXION_COMMON_IPV4_ADDRESS_H_
#define FLUXION_COMMON_IPV4_ADDRESS_H_

#include <netinet/in.h>

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace fluxion {

// `port` must be in [0, 65535] (the callers parse it). InvalidArgument "<who>: cannot resolve
// '<host>'" when the name has no IPv4 address.
absl::StatusOr<sockaddr_in> ResolveIpv4(const std::string& host, int port, absl::string_view who);

}  // namespace fluxion

#endif  // FLUXION_COMMON_IPV4_ADDRESS_H_

// How a decode node names the prefill node behind a failure, so that the router can tell a
// prefill peer's failure from the decode node's own (docs/PROTOCOL.md, "caller's reaction").
//
// The decode node (decode/serving/prefill_client.cc) prefixes every error of its call to a prefill
// node with "prefill node <address>: ". A router whose attempt failed with UNAVAILABLE and no
// message used to eject the decode node as unreachable; when the message names the attempt's
// prefill node instead, the decode node answered and the prefill node is what failed (a killed
// prefill node had the router eject every healthy decode node it was paired with, so a burst's
// retries found none: tests/cluster_faults_test.cc).
#ifndef FLUXION_COMMON_PEER_FAILURE_H_
#define FLUXION_COMMON_PEER_FAILURE_H_

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace fluxion {

inline std::string PrefillFailureMessage(absl::string_view address, absl::string_view message) {
  return absl::StrCat("prefill node ", address, ": ", message);
}

// Whether `message` (possibly wrapped by later prefixes) reports a failure of the prefill node
// at `address`.
inline bool NamesPrefillFailure(absl::string_view message, absl::string_view address) {
  return !address.empty() && absl::StrContains(message, PrefillFailureMessage(address, ""));
}

}  // namespace fluxion

#endif  // FLUXION_COMMON_PEER_FAILURE_H_

// The gateway's prefill pick: llm-d's endpoint picker, with a prefill/decode profile, names the
// prefill pod for a request in the `x-prefiller-host-port` header ("10.0.3.7:8000"; older
// releases: `x-prefiller-url`, "http://10.0.3.7:8000"), for the decode pod's sidecar to use. The
// router (the Fluxion sidecar) honours it on its OpenAI HTTP API (the header) and its gRPC services
// (the same key as call metadata), mapping it onto one of its own prefill nodes: an exact
// host:port match, else the one prefill node on that host (the picker names the pod's
// InferencePool target port, not the prefill node's gRPC port). Never a node outside --prefill /
// --prefill-dns, the set the decode node trusts too (docs/SECURITY.md): anything else is
// INVALID_ARGUMENT (HTTP 400) naming the header, so a misconfigured picker shows at once.
//
// Pure functions; thread-safe.
#ifndef FLUXION_CLUSTER_PREFILL_PICK_H_
#define FLUXION_CLUSTER_PREFILL_PICK_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cluster/backends.h"

namespace fluxion::cluster {

inline constexpr char kPrefillerHostPortHeader[] = "x-prefiller-host-port";
inline constexpr char kPrefillerUrlHeader[] = "x-prefiller-url";  // older llm-d releases

// The address of `prefills` that `pick` (a header value) names, or INVALID_ARGUMENT: malformed,
// naming no known prefill node, or a host with several and no exact port match. `header` names
// the header in the message.
absl::StatusOr<std::string> MapPrefillerPick(absl::string_view header, absl::string_view pick,
                                             const std::vector<BackendState>& prefills);

}  // namespace fluxion::cluster

#endif  // FLUXION_CLUSTER_PREFILL_PICK_H_

// How the router picks a decode node and a prefill node for a request: pure functions over the
// backends' last known state, so the rules are tested without servers. docs/CLUSTER.md explains them.
//
// Thread-compatible: pure functions.
#ifndef FLUXION_CLUSTER_ROUTER_POLICY_H_
#define FLUXION_CLUSTER_ROUTER_POLICY_H_

#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cluster/backends.h"

namespace fluxion::cluster {

// Score of a healthy decode node; higher is better: the estimated free fraction of its KV pages
// (after the pages of requests the router sent since its last load answer) divided by
// 1 + its requests (running, prefilling, waiting, and sent since the last answer).
double DecodeScore(const BackendState& node);

// The decode node for a prompt of `prompt_tokens`, never one in `exclude`.
// - UNAVAILABLE: no healthy decode node outside `exclude` (the message lists why each is out).
// - RESOURCE_EXHAUSTED: every healthy candidate's kv_usage is at or above `shed_kv_usage`
//   (load shedding: the client should back off rather than queue).
// Among the rest, nodes that report room for the prompt (admittable_prompt_tokens) come first,
// then the highest DecodeScore, then the address (deterministic).
absl::StatusOr<std::string> PickDecode(const std::vector<BackendState>& decodes,
                                       int64_t prompt_tokens, double shed_kv_usage,
                                       const std::set<std::string>& exclude);

// The prefill node with the fewest queued prompt tokens (its load answer's queued_prompt_tokens
// plus what the router sent since), then fewest running prompt tokens, then the address.
// Nodes in `exclude` are used only when no other healthy node is left. UNAVAILABLE when none is
// healthy.
absl::StatusOr<std::string> PickPrefill(const std::vector<BackendState>& prefills,
                                        const std::set<std::string>& exclude);

}  // namespace fluxion::cluster

#endif  // FLUXION_CLUSTER_ROUTER_POLICY_H_

// `fluxion router`: serves fluxion.v1.DecodeService to clients and forwards to prefill/decode
// pairs (docs/CLUSTER.md).
#ifndef FLUXION_CLUSTER_ROUTER_COMMAND_H_
#define FLUXION_CLUSTER_ROUTER_COMMAND_H_

#include <string>
#include <vector>

namespace fluxion::cluster {

// Runs until SIGINT or SIGTERM, then drains. Returns the exit code (0 after a clean shutdown,
// 1 when it cannot start, 2 for usage errors).
int RunRouterCommand(const std::vector<std::string>& args);

}  // namespace fluxion::cluster

#endif  // FLUXION_CLUSTER_ROUTER_COMMAND_H_

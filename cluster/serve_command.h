// `fluxion serve [MODEL_DIR]`: the whole system on this machine, serving the OpenAI API until
// stopped, the way `vllm serve` is used: a router (HTTP API on --host:--port), prefill and
// decode nodes as child processes, each restarted on its own ports if it dies (docs/CLUSTER.md,
// "fluxion serve").
#ifndef FLUXION_CLUSTER_SERVE_COMMAND_H_
#define FLUXION_CLUSTER_SERVE_COMMAND_H_

#include <string>
#include <vector>

namespace fluxion::cluster {

// Returns 0 after SIGINT/SIGTERM once every process has stopped, 1 when the cluster could not
// start, 2 for usage errors, 130 when stopped while starting.
int RunServeCommand(const std::vector<std::string>& args);

}  // namespace fluxion::cluster

#endif  // FLUXION_CLUSTER_SERVE_COMMAND_H_

// `fluxion local`: a router, prefill and decode nodes as separate processes on this machine, a
// short replayed trace, the report, a clean shutdown (docs/CLUSTER.md).
#ifndef FLUXION_CLUSTER_LOCAL_COMMAND_H_
#define FLUXION_CLUSTER_LOCAL_COMMAND_H_

#include <string>
#include <vector>

namespace fluxion::cluster {

// Returns 0 when every replayed request succeeded, 1 on failures, 2 for usage errors, 130 after
// Ctrl-C (the nodes are shut down in every case).
int RunLocalCommand(const std::vector<std::string>& args);

}  // namespace fluxion::cluster

#endif  // FLUXION_CLUSTER_LOCAL_COMMAND_H_

// `fluxion replay`: load-tests a router or decode node from a Mooncake trace or synthetic load and
// reports latency, throughput and goodput (docs/REPLAY.md).
#ifndef FLUXION_CLUSTER_REPLAY_COMMAND_H_
#define FLUXION_CLUSTER_REPLAY_COMMAND_H_

#include <string>
#include <vector>

namespace fluxion::cluster {

// Returns the exit code: 0 when every request succeeded, 1 when some failed or the run could not
// start, 2 for usage errors.
int RunReplayCommand(const std::vector<std::string>& args);

}  // namespace fluxion::cluster

#endif  // FLUXION_CLUSTER_REPLAY_COMMAND_H_

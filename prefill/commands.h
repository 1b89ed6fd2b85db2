// `fluxion prefill`: the prefill node (PrefillService over gRPC, KV written over UCX).
#ifndef FLUXION_PREFILL_COMMANDS_H_
#define FLUXION_PREFILL_COMMANDS_H_

#include <string>
#include <vector>

namespace fluxion::prefill {

int RunPrefillCommand(const std::vector<std::string>& args);

}  // namespace fluxion::prefill

#endif  // FLUXION_PREFILL_COMMANDS_H_

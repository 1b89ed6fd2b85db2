// `fluxion generate`: single-process generation with the CPU runtime, decoding with the model's
// own cache (`--policy full`) or a sparse policy over host KV pages.
#ifndef FLUXION_DECODE_SERVING_COMMANDS_H_
#define FLUXION_DECODE_SERVING_COMMANDS_H_

#include <string>
#include <vector>

namespace fluxion::decode {

// Returns the exit code (0 ok, 1 runtime error, 2 usage error).
int RunGenerateCommand(const std::vector<std::string>& args);

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_SERVING_COMMANDS_H_

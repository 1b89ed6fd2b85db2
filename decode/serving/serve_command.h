// `fluxion decode`: the decode node (DecodeService over gRPC, host KV arena registered with UCX).
#ifndef FLUXION_DECODE_SERVING_SERVE_COMMAND_H_
#define FLUXION_DECODE_SERVING_SERVE_COMMAND_H_

#include <string>
#include <vector>

namespace fluxion::decode {

int RunDecodeCommand(const std::vector<std::string>& args);

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_SERVING_SERVE_COMMAND_H_

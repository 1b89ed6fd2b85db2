// `fluxion prefill`: the prefill node (PrefillService over gRPC, KV written over UCX).
#ifndef FLUXION_PREFILL_COMMANDS_H_
#define FLUXION_PREFILL_COMMANDS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace fluxion::prefill {

int RunPrefillCommand(const std::vector<std::string>& args);

// --malloc-arena-max: caps glibc's malloc arenas (mallopt M_ARENA_MAX) before any thread starts.
// Why: every gRPC server thread that runs a Prefill call allocates the request's staging buffer
// and activations, and glibc gives each new thread its own arena (up to 8 per core) and keeps the
// memory freed into it; the soak saw the prefill node's RSS swing between ~720 and ~1,340 MiB
// with the default and stay at 372-383 MiB with 2 arenas (docs/FAULTS.md, "Soak"). `requested`
// 0 leaves glibc's default; otherwise it must be in [1, 64]. The environment's MALLOC_ARENA_MAX
// (`env_value`, null when unset), read by glibc itself at startup, wins over the flag: the
// function then changes nothing. Returns the cap now in effect (0: glibc's default), or
// INVALID_ARGUMENT.
absl::StatusOr<int64_t> ApplyMallocArenaMax(int64_t requested, const char* env_value);
inline constexpr int64_t kDefaultMallocArenaMax = 2;

}  // namespace fluxion::prefill

#endif  // FLUXION_PREFILL_COMMANDS_H_

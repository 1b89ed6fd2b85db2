// Capabilities handed to clients (abort tokens, docs/SECURITY.md): unguessable random tokens and
// a comparison whose time does not depend on how much of a guess was right. One copy for the
// decode service and the router.
//
// Thread-safe: pure functions (getrandom is thread-safe).
#ifndef FLUXION_COMMON_SECRET_TOKEN_H_
#define FLUXION_COMMON_SECRET_TOKEN_H_

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"

namespace fluxion {

// `bytes` bytes from the kernel's CSPRNG (getrandom), hex-encoded (2 * bytes characters).
// absl's generators do not promise unpredictability, hence the kernel's. Internal when the
// kernel refuses.
absl::StatusOr<std::string> RandomHexToken(size_t bytes);

// True when a and b are equal and non-empty; no early exit on the first differing byte.
bool TokensEqual(const std::string& a, const std::string& b);

}  // namespace fluxion

#endif  // FLUXION_COMMON_SECRET_TOKEN_H_

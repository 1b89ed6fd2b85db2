// Sealed prefill requests (docs/SECURITY.md, "Sealed prefill requests"): the decode node seals
// every PrefillRequest with an HMAC-SHA256 under a secret it shares with its prefill nodes
// (--transfer-secret-file), bound to the whole request (request id, worker address, keys, ranges,
// pages) and an expiry; the prefill node verifies the seal before it acts on any address in it.
// So a descriptor re-wrapped with a wider key scope, a range moved beyond the arena or a target
// made up from scratch is refused with PERMISSION_DENIED before the transport sees a byte, and a
// captured request cannot be used after its expiry (nor twice: prefill/seal_replay_guard.h).
//
// Why a shared secret in a file and not the mTLS session: the seal must hold on every deployment,
// including the plaintext loopback cluster, and a file is what a Kubernetes Secret mounts.
//
// Thread-safe: TransferSecret is immutable; the functions are pure.
#ifndef FLUXION_PROTO_PREFILL_SEAL_H_
#define FLUXION_PROTO_PREFILL_SEAL_H_

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "fluxion/v1/prefill.pb.h"

namespace fluxion::proto {

// A secret shorter than this is refused: 32 bytes is HMAC-SHA256's key strength.
inline constexpr size_t kMinTransferSecretBytes = 32;
// A file larger than this is not a secret (and is not read further).
inline constexpr size_t kMaxTransferSecretBytes = 4096;
// A seal valid for longer than this is refused: it bounds how long the prefill node remembers
// seals it has used (the replay guard), whatever the decode node's clock says.
inline constexpr absl::Duration kMaxSealLifetime = absl::Hours(1);
// Added to the decode node's own deadline when it seals, so that prefill nodes whose clocks run
// this much ahead still accept the request.
inline constexpr absl::Duration kSealClockSkew = absl::Seconds(30);
// Bytes of a seal's MAC (HMAC-SHA256).
inline constexpr size_t kSealMacBytes = 32;

class TransferSecret {
 public:
  // Reads the secret from `path`: its bytes, less one trailing newline (so `openssl rand -hex 32
  // > file` works). InvalidArgument when the file is missing, unreadable, shorter than
  // kMinTransferSecretBytes or longer than kMaxTransferSecretBytes, naming the path and the flag.
  static absl::StatusOr<TransferSecret> FromFile(const std::string& path);
  // The same checks on bytes already in memory.
  static absl::StatusOr<TransferSecret> FromBytes(std::string bytes);

  // Hex of the first 8 bytes of SHA-256(secret): names the secret in seals and errors without
  // revealing it.
  const std::string& key_id() const { return key_id_; }
  // HMAC-SHA256 of `message` under the secret (kSealMacBytes bytes).
  std::string Mac(absl::string_view message) const;

 private:
  explicit TransferSecret(std::string secret);
  std::string secret_;
  std::string key_id_;
};

// Writes a fresh secret (32 random bytes from the kernel, hex: 64 characters and a newline) to
// `path`, created with mode 0600 (an existing file is replaced). For `fluxion local` and tests.
absl::Status WriteNewTransferSecret(const std::string& path);

// Sets request->seal for `secret`, valid until `expires`. Every other field must be final.
void SealPrefillRequest(const TransferSecret& secret, absl::Time expires,
                        fluxion::v1::PrefillRequest* request);

// OK when `request` carries a seal made with `secret` over exactly these contents, not expired at
// `now` and valid for at most kMaxSealLifetime. PermissionDenied otherwise, with what to change:
// no seal (the decode node runs without --transfer-secret-file), another key id (the two nodes
// read different secrets), expired, or a MAC that does not match (altered or forged).
absl::Status CheckPrefillSeal(const TransferSecret& secret,
                              const fluxion::v1::PrefillRequest& request, absl::Time now);

}  // namespace fluxion::proto

#endif  // FLUXION_PROTO_PREFILL_SEAL_H_

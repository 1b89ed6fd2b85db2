// The wire format of target-checked landings (docs/TRANSFER.md, "Target-checked landings"): what
// the UCX transport puts inside a remote-key envelope, and the headers of the three active
// messages that carry a batch. Pure functions over bytes, no UCX, so that the parsers the target
// runs on every message a peer sends are fuzzed with the descriptor checks
// (transfer/descriptor_fuzz.cc).
//
// A landing is a registration that peers may write into: a random 128-bit token the target maps
// to [base, base + length). A writer names the token and the destination address in each write
// message; the target's handler looks the token up, checks the range, and only then copies.
//
// Every integer is little-endian; every header has a magic, a version and reserved bytes that must
// be 0, and exactly its size (a longer or shorter header is refused, not truncated).
// Thread-safe: pure functions.
#ifndef FLUXION_TRANSFER_LANDING_WIRE_H_
#define FLUXION_TRANSFER_LANDING_WIRE_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace fluxion::transfer::landing {

// The capability that names one landing. 128 bits from the kernel's CSPRNG: unguessable, so a
// peer can write only into landings whose descriptor it was given.
using Token = std::array<uint8_t, 16>;

// A fresh token from getrandom(). Internal when the kernel refuses.
absl::StatusOr<Token> NewToken();

// The remote_key payload (inside the FXBE envelope):
//   magic "FXLK" | version u8 = 1 | reserved 3 bytes = 0 | token 16 bytes      (24 bytes)
inline constexpr size_t kKeyBytes = 24;
std::string PackKey(const Token& token);
// InvalidArgument saying what is wrong (size, magic, version, reserved bytes). A packed UCX rkey
// (what decode nodes built before landings sent) fails on its size or magic, and the message
// says so.
absl::StatusOr<Token> ParseKey(absl::string_view payload);

// Active message ids (ucp_worker_set_am_recv_handler): a write, the fence that ends a batch, and
// the target's answer to a fence.
inline constexpr uint16_t kWriteAmId = 17;
inline constexpr uint16_t kFenceAmId = 18;
inline constexpr uint16_t kAckAmId = 19;

// One write message's header; its data is the bytes to land at `remote_addr`.
//   magic "FXLW" | version u16 = 1 | reserved u16 = 0 | token | stream u64 | batch u64 |
//   remote_addr u64                                                              (48 bytes)
// `stream` is random per writer transport and `batch` counts that writer's batches, so the pair
// names one batch at the target.
struct WriteHeader {
  Token token = {};
  uint64_t stream = 0;
  uint64_t batch = 0;
  uint64_t remote_addr = 0;
};
inline constexpr size_t kWriteHeaderBytes = 48;
using WriteHeaderBytes = std::array<uint8_t, kWriteHeaderBytes>;
WriteHeaderBytes PackWriteHeader(const WriteHeader& h);
absl::StatusOr<WriteHeader> ParseWriteHeader(absl::string_view bytes);

// The fence that ends a batch (no data; sent with UCP_AM_SEND_FLAG_REPLY once every write message
// of the batch completed at the writer). `messages` and `bytes`: what the batch sent. A batch of
// 0 messages is Connect()'s round trip.
//   magic "FXLF" | version u16 = 1 | reserved u16 = 0 | stream | batch | messages u64 |
//   bytes u64                                                                    (40 bytes)
struct FenceHeader {
  uint64_t stream = 0;
  uint64_t batch = 0;
  uint64_t messages = 0;
  uint64_t bytes = 0;
};
inline constexpr size_t kFenceHeaderBytes = 40;
using FenceHeaderBytes = std::array<uint8_t, kFenceHeaderBytes>;
FenceHeaderBytes PackFenceHeader(const FenceHeader& h);
absl::StatusOr<FenceHeader> ParseFenceHeader(absl::string_view bytes);

// Why a write message was refused (the first refusal of a batch travels in its ack).
enum class Refusal : uint32_t {
  kNone = 0,
  kUnknownToken = 1,   // no live landing has this token: revoked, or never issued here
  kOutOfRange = 2,     // [remote_addr, remote_addr + length) not inside the landing
  kMalformed = 3,      // header of the wrong size, magic, version or reserved bytes
  kTableFull = 4,      // the target tracks too many batches or receives; try again later
  kReceiveFailed = 5,  // a rendezvous receive into the landing failed (the peer went away)
};
// "landing revoked or never issued" etc., for messages.
const char* RefusalText(Refusal r);

// The target's answer to a fence: what it did with the batch's messages so far.
//   magic "FXLA" | version u16 = 1 | reserved u16 = 0 | stream | batch | accepted u64 |
//   accepted_bytes u64 | refused u64 | in_flight u64 | first_refusal u32 | reserved u32 = 0
//                                                                                (64 bytes)
// `accepted`: messages whose bytes landed; `refused`: dropped without touching memory (or whose
// rendezvous receive failed); `in_flight`: rendezvous receives started and not finished. The
// batch is complete at the target when in_flight is 0 and accepted + refused is what the fence
// counted.
struct Ack {
  uint64_t stream = 0;
  uint64_t batch = 0;
  uint64_t accepted = 0;
  uint64_t accepted_bytes = 0;
  uint64_t refused = 0;
  uint64_t in_flight = 0;
  Refusal first_refusal = Refusal::kNone;
};
inline constexpr size_t kAckBytes = 64;
using AckBytes = std::array<uint8_t, kAckBytes>;
AckBytes PackAck(const Ack& a);
absl::StatusOr<Ack> ParseAck(absl::string_view bytes);

}  // namespace fluxion::transfer::landing

#endif  // FLUXION_TRANSFER_LANDING_WIRE_H_

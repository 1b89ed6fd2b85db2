#include "transfer/landing_wire.h"

#include <sys/random.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace fluxion::transfer::landing {
namespace {

constexpr char kKeyMagic[4] = {'F', 'X', 'L', 'K'};
constexpr char kWriteMagic[4] = {'F', 'X', 'L', 'W'};
constexpr char kFenceMagic[4] = {'F', 'X', 'L', 'F'};
constexpr char kAckMagic[4] = {'F', 'X', 'L', 'A'};
constexpr uint16_t kVersion = 1;

void PutLe(uint8_t* p, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

uint64_t GetLe(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

// Writes magic, version and reserved bytes; returns where the body starts (offset 8).
template <size_t N>
uint8_t* Frame(std::array<uint8_t, N>& out, const char (&magic)[4]) {
  out.fill(0);
  std::memcpy(out.data(), magic, 4);
  PutLe(out.data() + 4, kVersion, 2);
  return out.data() + 8;
}

// Checks size, magic, version and reserved bytes of a header named `what`; returns the body.
absl::StatusOr<const uint8_t*> Unframe(absl::string_view bytes, size_t size,
                                       const char (&magic)[4], const char* what) {
  if (bytes.size() != size) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " has ", bytes.size(), " bytes, expected ", size));
  }
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  if (std::memcmp(p, magic, 4) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": bad magic"));
  }
  if (const uint64_t v = GetLe(p + 4, 2); v != kVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " version ", v, " (this build reads ", kVersion, ")"));
  }
  if (GetLe(p + 6, 2) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": reserved bytes are not 0"));
  }
  return p + 8;
}

}  // namespace

absl::StatusOr<Token> NewToken() {
  Token t;
  size_t got = 0;
  while (got < t.size()) {
    const ssize_t n = getrandom(t.data() + got, t.size() - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::InternalError(absl::StrCat("getrandom failed: errno ", errno));
    got += static_cast<size_t>(n);
  }
  return t;
}

std::string PackKey(const Token& token) {
  std::string out(kKeyBytes, '\0');
  std::memcpy(out.data(), kKeyMagic, 4);
  out[4] = static_cast<char>(kVersion);
  std::memcpy(out.data() + 8, token.data(), token.size());
  return out;
}

absl::StatusOr<Token> ParseKey(absl::string_view payload) {
  if (payload.size() != kKeyBytes || std::memcmp(payload.data(), kKeyMagic, 4) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "not a landing key (", payload.size(), " bytes, expected ", kKeyBytes,
        " starting with FXLK; a packed UCX rkey comes from a decode node built before "
        "target-checked landings: upgrade both)"));
  }
  const auto* p = reinterpret_cast<const uint8_t*>(payload.data());
  if (p[4] != kVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("landing key version ", p[4], " (this build reads ", kVersion, ")"));
  }
  if (p[5] != 0 || p[6] != 0 || p[7] != 0) {
    return absl::InvalidArgumentError("landing key: reserved bytes are not 0");
  }
  Token t;
  std::memcpy(t.data(), p + 8, t.size());
  return t;
}

WriteHeaderBytes PackWriteHeader(const WriteHeader& h) {
  WriteHeaderBytes out;
  uint8_t* p = Frame(out, kWriteMagic);
  std::memcpy(p, h.token.data(), h.token.size());
  PutLe(p + 16, h.stream, 8);
  PutLe(p + 24, h.batch, 8);
  PutLe(p + 32, h.remote_addr, 8);
  return out;
}

absl::StatusOr<WriteHeader> ParseWriteHeader(absl::string_view bytes) {
  absl::StatusOr<const uint8_t*> p =
      Unframe(bytes, kWriteHeaderBytes, kWriteMagic, "landing write header");
  if (!p.ok()) return p.status();
  WriteHeader h;
  std::memcpy(h.token.data(), *p, h.token.size());
  h.stream = GetLe(*p + 16, 8);
  h.batch = GetLe(*p + 24, 8);
  h.remote_addr = GetLe(*p + 32, 8);
  return h;
}

FenceHeaderBytes PackFenceHeader(const FenceHeader& h) {
  FenceHeaderBytes out;
  uint8_t* p = Frame(out, kFenceMagic);
  PutLe(p, h.stream, 8);
  PutLe(p + 8, h.batch, 8);
  PutLe(p + 16, h.messages, 8);
  PutLe(p + 24, h.bytes, 8);
  return out;
}

absl::StatusOr<FenceHeader> ParseFenceHeader(absl::string_view bytes) {
  absl::StatusOr<const uint8_t*> p =
      Unframe(bytes, kFenceHeaderBytes, kFenceMagic, "landing fence header");
  if (!p.ok()) return p.status();
  FenceHeader h;
  h.stream = GetLe(*p, 8);
  h.batch = GetLe(*p + 8, 8);
  h.messages = GetLe(*p + 16, 8);
  h.bytes = GetLe(*p + 24, 8);
  return h;
}

const char* RefusalText(Refusal r) {
  switch (r) {
    case Refusal::kNone:
      return "none";
    case Refusal::kUnknownToken:
      return "landing revoked or never issued by the target";
    case Refusal::kOutOfRange:
      return "range outside the landing";
    case Refusal::kMalformed:
      return "malformed landing message";
    case Refusal::kTableFull:
      return "target tracks too many batches or receives";
    case Refusal::kReceiveFailed:
      return "rendezvous receive into the landing failed";
  }
  return "unknown refusal";
}

AckBytes PackAck(const Ack& a) {
  AckBytes out;
  uint8_t* p = Frame(out, kAckMagic);
  PutLe(p, a.stream, 8);
  PutLe(p + 8, a.batch, 8);
  PutLe(p + 16, a.accepted, 8);
  PutLe(p + 24, a.accepted_bytes, 8);
  PutLe(p + 32, a.refused, 8);
  PutLe(p + 40, a.in_flight, 8);
  PutLe(p + 48, static_cast<uint32_t>(a.first_refusal), 4);
  return out;
}

absl::StatusOr<Ack> ParseAck(absl::string_view bytes) {
  absl::StatusOr<const uint8_t*> p = Unframe(bytes, kAckBytes, kAckMagic, "landing ack");
  if (!p.ok()) return p.status();
  if (GetLe(*p + 52, 4) != 0) {
    return absl::InvalidArgumentError("landing ack: reserved bytes are not 0");
  }
  const uint64_t refusal = GetLe(*p + 48, 4);
  if (refusal > static_cast<uint32_t>(Refusal::kReceiveFailed)) {
    return absl::InvalidArgumentError(absl::StrCat("landing ack: unknown refusal ", refusal));
  }
  Ack a;
  a.stream = GetLe(*p, 8);
  a.batch = GetLe(*p + 8, 8);
  a.accepted = GetLe(*p + 16, 8);
  a.accepted_bytes = GetLe(*p + 24, 8);
  a.refused = GetLe(*p + 32, 8);
  a.in_flight = GetLe(*p + 40, 8);
  a.first_refusal = static_cast<Refusal>(refusal);
  return a;
}

}  // namespace fluxion::transfer::landing

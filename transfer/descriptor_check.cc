#include "transfer/descriptor_check.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "transfer/crc32c.h"
#include "transfer/transport_internal.h"

namespace fluxion::transfer {
namespace {

// --- Envelope -------------------------------------------------------------------------------

constexpr char kEnvelopeMagic[4] = {'F', 'X', 'B', 'E'};
constexpr uint8_t kEnvelopeVersion = 1;
// magic 4 | version 1 | field 1 | reserved 2 | payload length 4 | scope base 8 | scope length 8
constexpr size_t kEnvelopeHeaderBytes = 28;
constexpr size_t kEnvelopeCrcBytes = 4;
static_assert(kEnvelopeHeaderBytes + kEnvelopeCrcBytes == kEnvelopeOverheadBytes);

const char* FieldName(BlobField field) {
  return field == BlobField::kWorkerAddress ? "worker_address" : "remote_key";
}

void PutLe(std::string* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint64_t GetLe(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}

// A peer-supplied string, safe to put in an error message.
std::string Printable(absl::string_view s) {
  constexpr size_t kMax = 64;
  std::string out = absl::CHexEscape(s.substr(0, kMax));
  if (s.size() > kMax) absl::StrAppend(&out, "...");
  return out;
}

// --- UCX 1.13 worker address format (src/ucp/wireup/address.c at v1.13.1) ----------------------

// Address header: low nibble of byte 0 is the format version (ucp_object_version_t).
constexpr uint8_t kAddrVersionV1 = 0;
constexpr uint8_t kAddrVersionV2 = 1;
// Header flags (UCP_ADDRESS_HEADER_FLAG_*).
constexpr uint8_t kHdrDebugInfo = 0x01;
constexpr uint8_t kHdrWorkerUuid = 0x02;
constexpr uint8_t kHdrClientId = 0x04;
constexpr uint8_t kHdrAmOnly = 0x08;
constexpr uint8_t kHdrKnown = kHdrDebugInfo | kHdrWorkerUuid | kHdrClientId | kHdrAmOnly;
// The byte that stands for an empty address list (UCP_NULL_RESOURCE).
constexpr uint8_t kNullResource = 0xff;
// md_index byte: UCP_ADDRESS_FLAG_MD_EMPTY_DEV, and the index masks (v1 also carries two unused
// flag bits; v2 extends to a second byte when the masked value equals the mask).
constexpr uint8_t kMdEmptyDev = 0x80;
constexpr uint8_t kMdMaskV1 = 0x1f;
constexpr uint8_t kMdMaskV2 = 0x7f;
// Device address length byte: flags and length mask (UCP_ADDRESS_DEVICE_LEN_MASK).
constexpr uint8_t kFlagLast = 0x80;
constexpr uint8_t kDevFlagNumPaths = 0x40;
constexpr uint8_t kDevFlagSysDevice = 0x20;
constexpr uint8_t kDevLenMask = 0x1f;
// Interface address length byte (UCP_ADDRESS_IFACE_LEN_MASK) and UCP_ADDRESS_FLAG_HAS_EP_ADDR.
constexpr uint8_t kIfaceFlagHasEpAddr = 0x40;
constexpr uint8_t kIfaceLenMask = 0x3f;
// Packed interface attributes: v1 ucp_address_packed_iface_attr_t (3 floats + uint32), v2
// ucp_address_v2_packed_iface_attr_t (4 x fp8/uint8 + 2 x uint16).
constexpr size_t kIfaceAttrBytesV1 = 16;
constexpr size_t kIfaceAttrBytesV2 = 8;
// UCP_MAX_RESOURCES, UCP_MD_INDEX_BITS.
constexpr size_t kMaxResources = 128;
constexpr uint32_t kMdIndexBits = 64;

// Bounded reader over a UCX blob: every read checks the remaining length, and errors name the
// offset, so that a refusal says where the blob went wrong.
class Cursor {
 public:
  Cursor(absl::string_view what, absl::string_view in) : what_(what), in_(in) {}
  size_t pos() const { return pos_; }
  size_t left() const { return in_.size() - pos_; }
  absl::Status Need(size_t n, absl::string_view item) const {
    if (left() >= n) return absl::OkStatus();
    return Error(absl::StrCat(item, " needs ", n, " bytes, ", left(), " left (truncated)"));
  }
  absl::Status U8(absl::string_view item, uint8_t* v) {
    if (absl::Status s = Need(1, item); !s.ok()) return s;
    *v = static_cast<uint8_t>(in_[pos_++]);
    return absl::OkStatus();
  }
  absl::Status Bytes(absl::string_view item, size_t n, absl::string_view* out = nullptr) {
    if (absl::Status s = Need(n, item); !s.ok()) return s;
    if (out != nullptr) *out = in_.substr(pos_, n);
    pos_ += n;
    return absl::OkStatus();
  }
  absl::Status Error(absl::string_view why) const {
    return absl::InvalidArgumentError(
        absl::StrCat(what_, " (", in_.size(), " bytes) is malformed at offset ", pos_, ": ", why));
  }

 private:
  const absl::string_view what_;
  const absl::string_view in_;
  size_t pos_ = 0;
};

#define FLUXION_RETURN_IF_ERROR(expr)      \
  do {                                     \
    if (absl::Status _s = (expr); !_s.ok()) \
      return _s;                           \
  } while (0)

// A v2 value that does not fit its partial byte is the mask value followed by a full byte
// (ucp_address_unpack_byte_extended).
absl::Status ExtendedValue(Cursor& c, absl::string_view item, uint8_t first, uint8_t mask,
                           bool v2, uint32_t* value) {
  *value = first & mask;
  if (v2 && *value == mask) {
    uint8_t next;
    FLUXION_RETURN_IF_ERROR(c.U8(item, &next));
    *value = next;
  }
  return absl::OkStatus();
}

absl::Status CheckIfaceAttrV1(Cursor& c, absl::string_view attr) {
  float overhead, bandwidth, lat_ovh;
  std::memcpy(&overhead, attr.data(), 4);
  std::memcpy(&bandwidth, attr.data() + 4, 4);
  std::memcpy(&lat_ovh, attr.data() + 8, 4);
  if (!std::isfinite(overhead) || !std::isfinite(bandwidth) || !std::isfinite(lat_ovh) ||
      bandwidth == 0.0f) {
    return c.Error("interface attributes are not finite numbers or bandwidth is 0");
  }
  return absl::OkStatus();
}

// One device's transport records (the caller consumed the device header).
absl::Status ParseTransports(Cursor& c, bool v2, uint32_t md_index, size_t device_address_bytes,
                             std::vector<UcxAddressRecord>* records) {
  for (bool last = false; !last;) {
    if (records->size() >= kMaxResources) {
      return c.Error(absl::StrCat("more than ", kMaxResources, " transport resources"));
    }
    UcxAddressRecord r;
    r.md_index = md_index;
    r.device_address_bytes = device_address_bytes;
    absl::string_view csum;
    FLUXION_RETURN_IF_ERROR(c.Bytes("transport name checksum", 2, &csum));
    r.tl_name_checksum = static_cast<uint16_t>(GetLe(csum.data(), 2));
    absl::string_view attr;
    FLUXION_RETURN_IF_ERROR(
        c.Bytes("interface attributes", v2 ? kIfaceAttrBytesV2 : kIfaceAttrBytesV1, &attr));
    if (!v2) FLUXION_RETURN_IF_ERROR(CheckIfaceAttrV1(c, attr));
    uint8_t len_byte;
    FLUXION_RETURN_IF_ERROR(c.U8("interface address length", &len_byte));
    last = (len_byte & kFlagLast) != 0;
    if (len_byte & kIfaceFlagHasEpAddr) {
      // ucp_worker_get_address() packs without an endpoint, so it never carries endpoint
      // addresses; a worker address that claims some was not made by ucp_worker_get_address.
      return c.Error("worker address carries endpoint addresses");
    }
    uint32_t iface_len;
    FLUXION_RETURN_IF_ERROR(
        ExtendedValue(c, "interface address length", len_byte, kIfaceLenMask, v2, &iface_len));
    FLUXION_RETURN_IF_ERROR(c.Bytes("interface address", iface_len));
    r.iface_address_bytes = iface_len;
    records->push_back(r);
  }
  return absl::OkStatus();
}

}  // namespace

// --- Descriptor fields ------------------------------------------------------------------------

absl::Status ValidatePeerDescriptor(const PeerDescriptor& d) {
  const std::string who = absl::StrCat("descriptor of peer '", Printable(d.peer_name), "': ");
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(who, why));
  };
  if (d.peer_name.empty() || d.peer_name.size() > kMaxPeerNameBytes) {
    return bad(absl::StrCat("peer_name has ", d.peer_name.size(), " bytes (1 to ",
                            kMaxPeerNameBytes, " allowed)"));
  }
  if (d.transport.empty() || d.transport.size() > kMaxTransportNameBytes) {
    return bad(absl::StrCat("transport has ", d.transport.size(), " bytes (1 to ",
                            kMaxTransportNameBytes, " allowed)"));
  }
  if (d.compat.model_id.size() > kMaxModelIdBytes) {
    return bad(absl::StrCat("model_id has ", d.compat.model_id.size(), " bytes (at most ",
                            kMaxModelIdBytes, ")"));
  }
  if (d.worker_address.empty() || d.worker_address.size() > kMaxWorkerAddressFieldBytes) {
    return bad(absl::StrCat("worker_address has ", d.worker_address.size(), " bytes (1 to ",
                            kMaxWorkerAddressFieldBytes, " allowed)"));
  }
  if (d.remote_key.empty() || d.remote_key.size() > kMaxRemoteKeyFieldBytes) {
    return bad(absl::StrCat("remote_key has ", d.remote_key.size(), " bytes (1 to ",
                            kMaxRemoteKeyFieldBytes, " allowed)"));
  }
  if (d.length == 0) return bad("length is 0");
  if (d.base_address < kMinUserAddress) {
    return bad(absl::StrCat("base_address 0x", absl::Hex(d.base_address),
                            " lies below the lowest mappable user address 0x",
                            absl::Hex(kMinUserAddress)));
  }
  if (d.base_address % kRegionAlignment != 0) {
    return bad(absl::StrCat("base_address 0x", absl::Hex(d.base_address), " is not ",
                            kRegionAlignment, "-byte aligned"));
  }
  if (!internal::RangeInside(d.base_address, d.length, 0, kUserAddressLimit)) {
    return bad(absl::StrCat("range [0x", absl::Hex(d.base_address), ", +", d.length,
                            ") does not fit below the end of user address space 0x",
                            absl::Hex(kUserAddressLimit), " (overflow or non-canonical)"));
  }
  return absl::OkStatus();
}

// --- Envelope ---------------------------------------------------------------------------------

std::string WrapBlob(BlobField field, absl::string_view payload, uint64_t scope_base,
                     uint64_t scope_length) {
  std::string out(kEnvelopeMagic, sizeof(kEnvelopeMagic));
  out.reserve(kEnvelopeOverheadBytes + payload.size());
  out.push_back(static_cast<char>(kEnvelopeVersion));
  out.push_back(static_cast<char>(field));
  PutLe(&out, 0, 2);
  PutLe(&out, payload.size(), 4);
  PutLe(&out, scope_base, 8);
  PutLe(&out, scope_length, 8);
  out.append(payload.data(), payload.size());
  PutLe(&out, Crc32c(out.data(), out.size()), 4);
  return out;
}

absl::StatusOr<UnwrappedBlob> UnwrapBlob(BlobField field, absl::string_view envelope,
                                         size_t max_payload) {
  const char* name = FieldName(field);
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(name, " (", envelope.size(), " bytes) ", why));
  };
  if (envelope.size() < kEnvelopeOverheadBytes) {
    return bad(absl::StrCat("is shorter than the ", kEnvelopeOverheadBytes,
                            "-byte envelope (truncated, or not made by this build's Describe())"));
  }
  if (envelope.substr(0, 4) != absl::string_view(kEnvelopeMagic, 4)) {
    return bad("has no FXBE envelope (corrupted, or from a build older than issue 12)");
  }
  const auto version = static_cast<uint8_t>(envelope[4]);
  if (version != kEnvelopeVersion) {
    return bad(absl::StrCat("has envelope version ", version, "; this build reads ",
                            kEnvelopeVersion));
  }
  if (static_cast<uint8_t>(envelope[5]) != static_cast<uint8_t>(field)) {
    return bad(absl::StrCat("holds field ", static_cast<uint8_t>(envelope[5]), ", expected ",
                            static_cast<uint8_t>(field), " (worker address and key swapped?)"));
  }
  if (envelope[6] != 0 || envelope[7] != 0) return bad("has non-zero reserved bytes");
  const uint64_t length = GetLe(envelope.data() + 8, 4);
  if (length == 0 || length > max_payload) {
    return bad(absl::StrCat("declares a ", length, "-byte payload (1 to ", max_payload,
                            " allowed)"));
  }
  if (envelope.size() != kEnvelopeOverheadBytes + length) {
    return bad(absl::StrCat("should be ", kEnvelopeOverheadBytes + length, " bytes for its ",
                            length, "-byte payload (",
                            envelope.size() < kEnvelopeOverheadBytes + length ? "truncated"
                                                                              : "trailing bytes",
                            ")"));
  }
  const size_t body = envelope.size() - kEnvelopeCrcBytes;
  const uint32_t want = static_cast<uint32_t>(GetLe(envelope.data() + body, 4));
  const uint32_t got = Crc32c(envelope.data(), body);
  if (want != got) {
    return bad(absl::StrCat("fails its CRC-32C (carried 0x", absl::Hex(want), ", computed 0x",
                            absl::Hex(got), "): corrupted in transit"));
  }
  UnwrappedBlob out;
  out.scope_base = GetLe(envelope.data() + 12, 8);
  out.scope_length = GetLe(envelope.data() + 20, 8);
  out.payload.assign(envelope.data() + kEnvelopeHeaderBytes, length);
  if (field == BlobField::kWorkerAddress && (out.scope_base != 0 || out.scope_length != 0)) {
    return bad("carries a key scope (a worker address has none)");
  }
  return out;
}

absl::Status CheckKeyScope(const PeerDescriptor& d, const UnwrappedBlob& key) {
  if (key.scope_length == 0 ||
      !internal::RangeInside(d.base_address, d.length, key.scope_base, key.scope_length)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "descriptor of peer '", Printable(d.peer_name), "': range [0x", absl::Hex(d.base_address),
        ", +", d.length, ") lies outside the range its remote_key was issued for [0x",
        absl::Hex(key.scope_base), ", +", key.scope_length, ")"));
  }
  return absl::OkStatus();
}

// --- UCX worker address -----------------------------------------------------------------------

absl::StatusOr<std::vector<UcxAddressRecord>> ParseUcxWorkerAddress(absl::string_view blob) {
  if (blob.size() > kMaxUcxWorkerAddressBytes) {
    return absl::InvalidArgumentError(absl::StrCat("UCX worker address has ", blob.size(),
                                                   " bytes (at most ",
                                                   kMaxUcxWorkerAddressBytes, ")"));
  }
  Cursor c("UCX worker address", blob);
  uint8_t b0;
  FLUXION_RETURN_IF_ERROR(c.U8("header", &b0));
  const uint8_t version = b0 & 0x0f;
  uint8_t flags;
  if (version == kAddrVersionV1) {
    flags = b0 >> 4;
  } else if (version == kAddrVersionV2) {
    if ((b0 >> 4) != 0) return c.Error("v2 header has bits set in its upper nibble");
    FLUXION_RETURN_IF_ERROR(c.U8("header flags", &flags));
  } else {
    // ucp_address_unpack_header asserts on this (ucs_assertv_always): the crash of issue 12.
    return c.Error(absl::StrCat("unknown address format version ", version,
                                " (UCX 1.13 packs 0 or 1)"));
  }
  const bool v2 = version == kAddrVersionV2;
  if (flags & ~kHdrKnown) {
    return c.Error(absl::StrCat("unknown header flags 0x", absl::Hex(flags)));
  }
  // v1 always carries the uuid (it predates the flag); v2 when flagged.
  if (!v2 || (flags & kHdrWorkerUuid)) FLUXION_RETURN_IF_ERROR(c.Bytes("worker uuid", 8));
  if (flags & kHdrClientId) FLUXION_RETURN_IF_ERROR(c.Bytes("client id", 8));
  if (flags & kHdrDebugInfo) {
    uint8_t name_len;
    FLUXION_RETURN_IF_ERROR(c.U8("worker name length", &name_len));
    FLUXION_RETURN_IF_ERROR(c.Bytes("worker name", name_len));
  }
  FLUXION_RETURN_IF_ERROR(c.Need(1, "device list"));
  std::vector<UcxAddressRecord> records;
  size_t devices = 0;
  for (bool last_device = false; !last_device;) {
    if (++devices > kMaxResources) {
      return c.Error(absl::StrCat("more than ", kMaxResources, " devices"));
    }
    uint8_t md_byte;
    FLUXION_RETURN_IF_ERROR(c.U8("md index", &md_byte));
    if (devices == 1 && md_byte == kNullResource) {
      return c.Error("the address lists no transports");
    }
    const bool empty_device = (md_byte & kMdEmptyDev) != 0;
    uint32_t md_index;
    FLUXION_RETURN_IF_ERROR(
        ExtendedValue(c, "md index", md_byte, v2 ? kMdMaskV2 : kMdMaskV1, v2, &md_index));
    if (md_index >= kMdIndexBits) {
      // UCX builds md maps with UCS_BIT(md_index): an index of 64 or more is undefined behaviour.
      return c.Error(absl::StrCat("md index ", md_index, " (at most ", kMdIndexBits - 1, ")"));
    }
    uint8_t len_byte;
    FLUXION_RETURN_IF_ERROR(c.U8("device address length", &len_byte));
    last_device = (len_byte & kFlagLast) != 0;
    uint32_t device_len;
    FLUXION_RETURN_IF_ERROR(
        ExtendedValue(c, "device address length", len_byte, kDevLenMask, v2, &device_len));
    if (len_byte & kDevFlagNumPaths) {
      uint8_t paths;
      FLUXION_RETURN_IF_ERROR(c.U8("device path count", &paths));
      if (paths == 0) return c.Error("device has 0 paths");
    }
    if (len_byte & kDevFlagSysDevice) FLUXION_RETURN_IF_ERROR(c.Bytes("system device", 1));
    FLUXION_RETURN_IF_ERROR(c.Bytes("device address", device_len));
    if (!empty_device) {
      FLUXION_RETURN_IF_ERROR(ParseTransports(c, v2, md_index, device_len, &records));
    }
  }
  if (records.empty()) return c.Error("the address lists no transports");
  if (c.left() != 0) return c.Error(absl::StrCat(c.left(), " trailing bytes"));
  return records;
}

absl::Status ValidateUcxWorkerAddress(absl::string_view blob,
                                      const std::vector<UcxAddressRecord>& local) {
  absl::StatusOr<std::vector<UcxAddressRecord>> records = ParseUcxWorkerAddress(blob);
  if (!records.ok()) return records.status();
  for (size_t i = 0; i < records->size(); ++i) {
    const UcxAddressRecord& r = (*records)[i];
    bool known = false;
    size_t min_device = SIZE_MAX, min_iface = SIZE_MAX;
    for (const UcxAddressRecord& l : local) {
      if (l.tl_name_checksum != r.tl_name_checksum) continue;
      known = true;
      min_device = std::min(min_device, l.device_address_bytes);
      min_iface = std::min(min_iface, l.iface_address_bytes);
    }
    if (!known) continue;  // a transport we lack: UCX never interprets the record
    if (r.device_address_bytes < min_device || r.iface_address_bytes < min_iface) {
      return absl::InvalidArgumentError(absl::StrCat(
          "UCX worker address: transport record ", i, " (checksum 0x",
          absl::Hex(r.tl_name_checksum), ") has a ", r.device_address_bytes,
          "-byte device and a ", r.iface_address_bytes,
          "-byte interface address; this node's UCX packs at least ", min_device, " and ",
          min_iface, " for that transport"));
    }
  }
  return absl::OkStatus();
}

}  // namespace fluxion::transfer

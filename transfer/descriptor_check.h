// Validation of everything a peer hands us in a PeerDescriptor, before any transport library sees
// it. A descriptor arrives inside a Prefill request (KvTarget), so every field is untrusted input:
// one malformed byte must give InvalidArgument naming the field, never a crash (issue 12).
//
// Three layers, all pure functions (no UCX context; transfer/descriptor_fuzz.cc fuzzes them):
//   1. ValidatePeerDescriptor: sizes, base/length, address-range sanity.
//   2. The blob envelope (WrapBlob/UnwrapBlob): our own framing around the opaque worker address
//      and remote key (magic, version, field, length, the key's scope, CRC-32C), so that a
//      corrupted blob is refused before the transport library parses it.
//   3. Structural checks of UCX 1.13's packed worker address (ValidateUcxWorkerAddress): a
//      bounded re-implementation of the grammar ucp_address_unpack() walks without any length, so
//      no byte string that passes can make it read past the blob or hit an assertion. (The UCX
//      transport's remote key is its own landing key, transfer/landing_wire.h: UCX never parses
//      it.)
// docs/TRANSFER.md ("Validating peer descriptors") gives the formats and the reasons for each
// limit. Thread-safe: pure functions.
#ifndef FLUXION_TRANSFER_DESCRIPTOR_CHECK_H_
#define FLUXION_TRANSFER_DESCRIPTOR_CHECK_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "transfer/transport.h"

namespace fluxion::transfer {

// Size limits of descriptor fields, in bytes. Each is well above anything a real node produces
// and small enough that a hostile descriptor cannot make us allocate or hash much.
// Node names are "<role>-<host>-<pid>"-like strings; 256 is DNS's name limit rounded up.
inline constexpr size_t kMaxPeerNameBytes = 256;
// "ucx" or "loopback".
inline constexpr size_t kMaxTransportNameBytes = 32;
// "sha256:<64 hex>" or a model id such as "org/model-name".
inline constexpr size_t kMaxModelIdBytes = 1024;
// UCX payloads (inside the envelope). A UCX 1.13 worker address is ~20 bytes of header plus, per
// transport resource, ~30 bytes; this host's full address (tcp x2, sysv, posix, cma, self) is
// under 200 bytes and a 16-NIC RDMA host stays under 2 KiB. UCX itself caps an address at
// UCP_MAX_RESOURCES (128) resources.
inline constexpr size_t kMaxUcxWorkerAddressBytes = 8192;
// The UCX transport's remote-key payload: a landing key, 24 bytes (transfer/landing_wire.h).
// The field limit stays generous so that the format can grow without changing it.
inline constexpr size_t kMaxUcxRemoteKeyBytes = 4096;
// Whole envelopes: payload plus framing.
inline constexpr size_t kEnvelopeOverheadBytes = 32;
inline constexpr size_t kMaxWorkerAddressFieldBytes =
    kMaxUcxWorkerAddressBytes + kEnvelopeOverheadBytes;
inline constexpr size_t kMaxRemoteKeyFieldBytes = kMaxUcxRemoteKeyBytes + kEnvelopeOverheadBytes;

// Address-range sanity for a peer's registered range (see ValidatePeerDescriptor).
// Linux never maps below vm.mmap_min_addr (65536 by default on Debian and most distributions):
// a base inside the first 64 KiB is a forged or zeroed descriptor (0x1000 made the decode node
// segfault while UCX served Connect's probe read).
inline constexpr uint64_t kMinUserAddress = 64 * 1024;
// End of the user half of the address space with 48-bit virtual addresses (x86-64 4-level
// paging, aarch64 48-bit VA). With 5-level paging Linux still hands out addresses above this
// only to mmap calls that ask for them with a hint, which nothing here does; anything above is
// non-canonical or kernel space.
inline constexpr uint64_t kUserAddressLimit = uint64_t{1} << 47;
// Every range we register starts on an 8-byte boundary: arenas are page-aligned, per-reservation
// ranges are page runs, and heap buffers are 16-byte aligned. A misaligned base is a hand-made
// descriptor.
inline constexpr uint64_t kRegionAlignment = 8;

// Checks every field of `d` before a transport library sees it: string sizes against the limits
// above, transport/peer name present, worker address and remote key present and within their
// limits, base and length non-zero, base aligned, and [base, base + length) inside
// [kMinUserAddress, kUserAddressLimit) without overflow. InvalidArgument naming the field
// ("descriptor of peer 'decode-0': base_address 0x1000 lies below ...").
// It does not look inside the blobs; UnwrapBlob and the transport do.
absl::Status ValidatePeerDescriptor(const PeerDescriptor& d);

// Which descriptor field an envelope belongs to (so a worker address cannot pass as a key).
enum class BlobField : uint8_t { kWorkerAddress = 1, kRemoteKey = 2 };

// What an envelope carries besides the transport's own bytes.
struct UnwrappedBlob {
  std::string payload;
  // For a remote key: the range the key was issued for (the registration). 0/0 for a worker
  // address. Connect() refuses a descriptor whose [base, base + length) is not inside it.
  uint64_t scope_base = 0;
  uint64_t scope_length = 0;
};

// Our envelope around an opaque transport blob (docs/PROTOCOL.md, "KvTarget blobs"):
//   magic "FXBE" | version u8 = 1 | field u8 | reserved u16 = 0 | payload length u32 |
//   scope base u64 | scope length u64 | payload | CRC-32C u32 of everything before it
// Integers little-endian. This is what Describe() puts in worker_address / remote_key.
std::string WrapBlob(BlobField field, absl::string_view payload, uint64_t scope_base = 0,
                     uint64_t scope_length = 0);

// Inverse of WrapBlob. InvalidArgument naming the field for a bad magic, version, field, length
// (truncated, extended, or above `max_payload`), non-zero reserved bytes, or checksum mismatch.
absl::StatusOr<UnwrappedBlob> UnwrapBlob(BlobField field, absl::string_view envelope,
                                         size_t max_payload);

// OK when the remote key's scope contains the descriptor's [base, base + length).
absl::Status CheckKeyScope(const PeerDescriptor& d, const UnwrappedBlob& key);

// One transport record of a UCX worker address, as the structural check found it.
struct UcxAddressRecord {
  uint16_t tl_name_checksum = 0;  // which transport (a checksum of its name, e.g. "tcp")
  uint32_t md_index = 0;
  size_t device_address_bytes = 0;
  size_t iface_address_bytes = 0;
};

// The structure of a UCX 1.13 packed worker address (ucp_worker_get_address(), non-unified
// mode, address format v1 or v2): header, uuid, client id, debug name, then devices and their
// transport records, every length checked against the blob. Also refuses what would make UCX
// misbehave later: an unknown format version (ucp_address_unpack asserts), an md index >= 64
// (UCX shifts 1 by it), 0 paths, more than 128 resources, endpoint addresses (a worker address
// has none), non-finite v1 interface attributes, no transport at all, trailing bytes.
// InvalidArgument naming the offset and what is wrong.
absl::StatusOr<std::vector<UcxAddressRecord>> ParseUcxWorkerAddress(absl::string_view blob);

// ParseUcxWorkerAddress, plus a comparison against this node's own address (`local`, as parsed
// from ucp_worker_get_address): UCX only uses a peer record whose transport checksum matches a
// local transport, and then hands its device and interface addresses to that local transport,
// which reads as many bytes as it packs itself. So for every peer record of a transport we have,
// its device and interface addresses must be at least as long as the shortest we pack for that
// transport (a 0-byte one becomes a null pointer UCT dereferences). Records of transports we lack
// are checked for bounds only (UCX ignores them).
absl::Status ValidateUcxWorkerAddress(absl::string_view blob,
                                      const std::vector<UcxAddressRecord>& local);

// Extra zero bytes appended to every UCX blob we hand to UCX (not part of the blob). UCX's
// transports read fixed-size structures out of address and key records, sized by what they pack
// themselves; the padding keeps any read a few bytes past a short record inside our buffer, and
// terminates any string a transport reads.
inline constexpr size_t kUcxBlobPadding = 256;

}  // namespace fluxion::transfer

#endif  // FLUXION_TRANSFER_DESCRIPTOR_CHECK_H_

// libFuzzer target for the descriptor handshake: everything a Prefill request's KvTarget hands
// the prefill node before UCX sees a byte (transfer/descriptor_check.h). Pure: no UCX context.
//
// Each input goes four ways:
//   1. as a serialized descriptor (ParseDescriptor), then every check Connect() makes in order;
//   2. as a raw UCX worker address and a raw landing key, so that the fuzzer reaches those
//      grammars without forging CRC-32Cs;
//   3. as an envelope (UnwrapBlob);
//   4. as the header of each landing message a target or writer parses (write, fence, ack:
//      transfer/landing_wire.h), which any peer can send.
// Invariants (a violation traps): what parses re-serializes to the same bytes, and an unwrapped
// envelope re-wraps to the same bytes. Seeds: tests/fuzz/corpus/descriptor_fuzz/ (real
// descriptors and blobs of this host's UCX and landing headers).
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "transfer/descriptor_check.h"
#include "transfer/landing_wire.h"
#include "transfer/transport.h"

namespace {

using fluxion::transfer::BlobField;
namespace t = fluxion::transfer;

// Stands in for this node's own address records (ValidateUcxWorkerAddress compares with them).
const std::vector<t::UcxAddressRecord>& LocalRecords() {
  static const auto* records = new std::vector<t::UcxAddressRecord>{
      {0x6a77, 0, 18, 2}, {0x3dcf, 1, 0, 8}, {0x0c26, 2, 0, 12}};
  return *records;
}

void Require(bool ok) {
  if (!ok) __builtin_trap();
}

void CheckDescriptor(const t::PeerDescriptor& d) {
  (void)t::ValidatePeerDescriptor(d);
  auto address = t::UnwrapBlob(BlobField::kWorkerAddress, d.worker_address,
                               t::kMaxUcxWorkerAddressBytes);
  auto key = t::UnwrapBlob(BlobField::kRemoteKey, d.remote_key, t::kMaxUcxRemoteKeyBytes);
  if (address.ok()) {
    Require(t::WrapBlob(BlobField::kWorkerAddress, address->payload) == d.worker_address);
    (void)t::ValidateUcxWorkerAddress(address->payload, LocalRecords());
  }
  if (key.ok()) {
    Require(t::WrapBlob(BlobField::kRemoteKey, key->payload, key->scope_base,
                        key->scope_length) == d.remote_key);
    (void)t::CheckKeyScope(d, *key);
    (void)t::landing::ParseKey(key->payload);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view in(reinterpret_cast<const char*>(data), size);

  if (auto d = t::ParseDescriptor(in); d.ok()) {
    Require(t::SerializeDescriptor(*d) == in);
    CheckDescriptor(*d);
  }

  if (auto records = t::ParseUcxWorkerAddress(in); records.ok()) {
    Require(!records->empty());
    for (const t::UcxAddressRecord& r : *records) {
      Require(r.md_index < 64 && r.device_address_bytes < size && r.iface_address_bytes < size);
    }
  }
  (void)t::ValidateUcxWorkerAddress(in, LocalRecords());
  if (auto token = t::landing::ParseKey(in); token.ok()) {
    Require(t::landing::PackKey(*token) == in);
  }
  const auto same = [&](const auto& packed) {
    return absl::string_view(reinterpret_cast<const char*>(packed.data()), packed.size()) == in;
  };
  if (auto w = t::landing::ParseWriteHeader(in); w.ok()) {
    Require(same(t::landing::PackWriteHeader(*w)));
  }
  if (auto f = t::landing::ParseFenceHeader(in); f.ok()) {
    Require(same(t::landing::PackFenceHeader(*f)));
  }
  if (auto a = t::landing::ParseAck(in); a.ok()) Require(same(t::landing::PackAck(*a)));

  for (BlobField f : {BlobField::kWorkerAddress, BlobField::kRemoteKey}) {
    if (auto u = t::UnwrapBlob(f, in, t::kMaxUcxWorkerAddressBytes); u.ok()) {
      Require(t::WrapBlob(f, u->payload, u->scope_base, u->scope_length) == in);
    }
  }
  return 0;
}

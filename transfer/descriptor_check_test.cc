// Unit tests of the descriptor checks (transfer/descriptor_check.h) on hand-made input: field
// limits, the envelope, key scope, the UCX 1.13 address grammar (with blobs built here byte by
// byte; transfer/ucx_blob_test.cc runs the same checks on this host's real UCX blobs), and the
// landing key and message formats (transfer/landing_wire.h).
#include "transfer/descriptor_check.h"

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "transfer/landing_wire.h"

namespace fluxion::transfer {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kBase = 0x7f1234560000ull;

PeerDescriptor GoodDescriptor() {
  PeerDescriptor d;
  d.peer_name = "decode-0";
  d.transport = "ucx";
  d.worker_address = WrapBlob(BlobField::kWorkerAddress, "addr");
  d.remote_key = WrapBlob(BlobField::kRemoteKey, "key", kBase, 1 << 20);
  d.base_address = kBase;
  d.length = 1 << 20;
  d.compat.model_id = "m";
  return d;
}

TEST(ValidatePeerDescriptorTest, AcceptsAPlausibleDescriptor) {
  EXPECT_TRUE(ValidatePeerDescriptor(GoodDescriptor()).ok());
}

TEST(ValidatePeerDescriptorTest, RefusesEachImplausibleFieldNamingIt) {
  struct Case {
    const char* expect;
    void (*change)(PeerDescriptor&);
  };
  const std::vector<Case> cases = {
      {"peer_name", [](PeerDescriptor& d) { d.peer_name.clear(); }},
      {"peer_name", [](PeerDescriptor& d) { d.peer_name.assign(kMaxPeerNameBytes + 1, 'n'); }},
      {"transport", [](PeerDescriptor& d) { d.transport.clear(); }},
      {"transport", [](PeerDescriptor& d) { d.transport.assign(1000, 't'); }},
      {"model_id", [](PeerDescriptor& d) { d.compat.model_id.assign(kMaxModelIdBytes + 1, 'm'); }},
      {"worker_address", [](PeerDescriptor& d) { d.worker_address.clear(); }},
      {"worker_address",
       [](PeerDescriptor& d) { d.worker_address.assign(kMaxWorkerAddressFieldBytes + 1, 'a'); }},
      {"remote_key", [](PeerDescriptor& d) { d.remote_key.clear(); }},
      {"remote_key",
       [](PeerDescriptor& d) { d.remote_key.assign(kMaxRemoteKeyFieldBytes + 1, 'k'); }},
      {"length is 0", [](PeerDescriptor& d) { d.length = 0; }},
      {"base_address 0x0", [](PeerDescriptor& d) { d.base_address = 0; }},
      {"base_address 0x1000", [](PeerDescriptor& d) { d.base_address = 0x1000; }},
      {"below", [](PeerDescriptor& d) { d.base_address = kMinUserAddress - 8; }},
      {"aligned", [](PeerDescriptor& d) { d.base_address = kBase + 4; }},
      {"user address space", [](PeerDescriptor& d) { d.base_address = kUserAddressLimit; }},
      {"user address space", [](PeerDescriptor& d) { d.base_address = 0xffff800000001000ull; }},
      {"user address space", [](PeerDescriptor& d) { d.length = UINT64_MAX; }},
      {"user address space",
       [](PeerDescriptor& d) { d.length = kUserAddressLimit - d.base_address + 1; }},
  };
  for (const Case& c : cases) {
    PeerDescriptor d = GoodDescriptor();
    c.change(d);
    absl::Status s = ValidatePeerDescriptor(d);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.expect;
    EXPECT_THAT(s.message(), HasSubstr(c.expect));
  }
  // The last mappable byte is fine.
  PeerDescriptor d = GoodDescriptor();
  d.length = kUserAddressLimit - d.base_address;
  EXPECT_TRUE(ValidatePeerDescriptor(d).ok());
}

TEST(ValidatePeerDescriptorTest, HostileNamesArePrintedEscapedAndShort) {
  PeerDescriptor d = GoodDescriptor();
  d.peer_name = std::string("\x01\x02\n", 3) + std::string(200, 'x');
  d.length = 0;
  const std::string msg(ValidatePeerDescriptor(d).message());
  EXPECT_THAT(msg, HasSubstr("\\x01\\x02\\n"));
  EXPECT_LT(msg.size(), 200u);
}

TEST(BlobEnvelopeTest, RoundTripsPayloadAndScope) {
  const std::string payload("\x00\x01\xffucx", 6);
  const std::string e = WrapBlob(BlobField::kRemoteKey, payload, kBase, 4096);
  EXPECT_EQ(e.size(), payload.size() + kEnvelopeOverheadBytes);
  absl::StatusOr<UnwrappedBlob> u = UnwrapBlob(BlobField::kRemoteKey, e, 64);
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(u->payload, payload);
  EXPECT_EQ(u->scope_base, kBase);
  EXPECT_EQ(u->scope_length, 4096u);
}

TEST(BlobEnvelopeTest, EveryFlipTruncationAndExtensionIsRefusedNamingTheField) {
  const std::string e = WrapBlob(BlobField::kWorkerAddress, std::string(40, 'w'));
  for (size_t i = 0; i < e.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string b = e;
      b[i] = static_cast<char>(b[i] ^ (1 << bit));
      absl::Status s = UnwrapBlob(BlobField::kWorkerAddress, b, 64).status();
      ASSERT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << i << "." << bit;
      ASSERT_THAT(s.message(), HasSubstr("worker_address"));
    }
  }
  for (size_t n = 0; n < e.size(); ++n) {
    EXPECT_FALSE(UnwrapBlob(BlobField::kWorkerAddress, e.substr(0, n), 64).ok()) << n;
  }
  for (size_t extra = 1; extra < 10; ++extra) {
    EXPECT_FALSE(UnwrapBlob(BlobField::kWorkerAddress, e + std::string(extra, 0), 64).ok());
  }
}

TEST(BlobEnvelopeTest, RefusesTheWrongFieldOversizedPayloadsAndScopedAddresses) {
  const std::string key = WrapBlob(BlobField::kRemoteKey, "k", kBase, 8);
  EXPECT_THAT(UnwrapBlob(BlobField::kWorkerAddress, key, 64).status().message(),
              HasSubstr("swapped"));
  EXPECT_THAT(UnwrapBlob(BlobField::kRemoteKey, WrapBlob(BlobField::kRemoteKey,
                                                         std::string(65, 'k')), 64)
                  .status()
                  .message(),
              HasSubstr("65-byte payload"));
  EXPECT_FALSE(UnwrapBlob(BlobField::kRemoteKey, WrapBlob(BlobField::kRemoteKey, ""), 64).ok());
  EXPECT_FALSE(
      UnwrapBlob(BlobField::kWorkerAddress, WrapBlob(BlobField::kWorkerAddress, "a", 1, 1), 64)
          .ok());
  // Raw UCX bytes from a build without the envelope.
  EXPECT_THAT(UnwrapBlob(BlobField::kWorkerAddress, std::string(100, '\x20'), 200)
                  .status()
                  .message(),
              HasSubstr("no FXBE envelope"));
}

TEST(BlobEnvelopeTest, KeyScopeMustContainTheDescriptorRange) {
  PeerDescriptor d = GoodDescriptor();
  UnwrappedBlob key;
  key.scope_base = kBase;
  key.scope_length = d.length;
  EXPECT_TRUE(CheckKeyScope(d, key).ok());
  d.base_address += 8;
  d.length -= 8;
  EXPECT_TRUE(CheckKeyScope(d, key).ok());  // a sub-range of the key's scope
  d.length += 1;
  EXPECT_THAT(CheckKeyScope(d, key).message(), HasSubstr("remote_key was issued for"));
  key.scope_length = 0;
  d = GoodDescriptor();
  EXPECT_FALSE(CheckKeyScope(d, key).ok());
}

// --- UCX 1.13 worker addresses, built by hand --------------------------------------------------

// One transport record: checksum, attributes, interface address length byte, interface address.
struct Tl {
  uint16_t csum = 0x1234;
  uint8_t iface_len = 2;
  bool last = true;
};

std::string V1Attrs(float overhead = 1e-6f, float bandwidth = 1e9f, float lat = 1e-6f) {
  std::string a(16, '\0');
  std::memcpy(&a[0], &overhead, 4);
  std::memcpy(&a[4], &bandwidth, 4);
  std::memcpy(&a[8], &lat, 4);
  return a;
}

// A v1 address: header (flags in the upper nibble), uuid, one device with `tls`.
std::string V1Address(const std::vector<Tl>& tls, uint8_t md = 1, uint8_t dev_len = 6,
                      const std::string& attrs = V1Attrs(), uint8_t dev_flags = 0) {
  std::string a;
  a.push_back(static_cast<char>(0x20));  // version 0, flags: WORKER_UUID
  a.append(8, 'u');
  a.push_back(static_cast<char>(md));
  a.push_back(static_cast<char>(0x80 | dev_flags | dev_len));  // last device
  if (dev_flags & 0x40) a.push_back(1);                         // paths
  if (dev_flags & 0x20) a.push_back(0);                         // sys device
  a.append(dev_len, 'd');
  for (const Tl& t : tls) {
    a.push_back(static_cast<char>(t.csum & 0xff));
    a.push_back(static_cast<char>(t.csum >> 8));
    a.append(attrs);
    a.push_back(static_cast<char>((t.last ? 0x80 : 0) | t.iface_len));
    a.append(t.iface_len, 'i');
  }
  return a;
}

TEST(UcxWorkerAddressTest, ParsesAHandMadeV1Address) {
  auto r = ParseUcxWorkerAddress(V1Address({Tl{0x1111, 2, false}, Tl{0x2222, 8, true}}));
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->size(), 2u);
  EXPECT_EQ((*r)[0].tl_name_checksum, 0x1111);
  EXPECT_EQ((*r)[1].iface_address_bytes, 8u);
  EXPECT_EQ((*r)[1].device_address_bytes, 6u);
  EXPECT_EQ((*r)[1].md_index, 1u);
}

TEST(UcxWorkerAddressTest, ParsesAV2AddressWithExtendedLengths) {
  std::string a;
  a.push_back(0x01);                  // version 1 (v2 format)
  a.push_back(0x02 | 0x01);           // flags: uuid, debug name
  a.append(8, 'u');
  a.push_back(3);                     // name length
  a.append("abc");
  a.push_back(0x7f);                  // md index: extended
  a.push_back(40);                    // md 40
  a.push_back(static_cast<char>(0x80 | 0x40 | 0x1f));  // last device, paths, extended length
  a.push_back(40);                    // device address: 40 bytes
  a.push_back(2);                     // 2 paths
  a.append(40, 'd');
  a.append("\x34\x12", 2);
  a.append(8, 'a');                   // v2 attributes
  a.push_back(static_cast<char>(0x80 | 0x3f));  // last tl, extended length
  a.push_back(100);
  a.append(100, 'i');
  auto r = ParseUcxWorkerAddress(a);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->size(), 1u);
  EXPECT_EQ((*r)[0].md_index, 40u);
  EXPECT_EQ((*r)[0].device_address_bytes, 40u);
  EXPECT_EQ((*r)[0].iface_address_bytes, 100u);
  for (size_t n = 0; n < a.size(); ++n) EXPECT_FALSE(ParseUcxWorkerAddress(a.substr(0, n)).ok());
  // md index 64 and above: refused (UCX shifts 1 by it).
  std::string big = a;
  big[15] = 64;
  EXPECT_THAT(ParseUcxWorkerAddress(big).status().message(), HasSubstr("md index 64"));
}

TEST(UcxWorkerAddressTest, RefusesWhatWouldMisleadUcx) {
  struct Case {
    std::string blob;
    const char* expect;
  };
  std::string ep = V1Address({Tl{}});
  ep[ep.size() - 3] = static_cast<char>(0x80 | 0x40 | 2);  // HAS_EP_ADDR on the iface
  std::string zero_paths = V1Address({Tl{}}, 1, 6, V1Attrs(), 0x40);
  zero_paths[11] = 0;  // the path count
  std::string v2_upper;
  v2_upper.push_back(0x11);
  v2_upper.push_back(0);
  std::string v2_flags;
  v2_flags.push_back(0x01);
  v2_flags.push_back(static_cast<char>(0x40));
  const std::vector<Case> cases = {
      {"", "truncated"},
      {std::string(1, '\x05'), "unknown address format version 5"},
      {v2_upper, "upper nibble"},
      {v2_flags, "unknown header flags"},
      {std::string(1, '\0') + std::string(8, 'u') + "\xff", "no transports"},
      {std::string(1, '\0') + std::string(8, 'u'), "truncated"},
      {V1Address({Tl{}}) + "x", "trailing"},
      {ep, "endpoint addresses"},
      {zero_paths, "0 paths"},
      {V1Address({Tl{}}, 1, 6, V1Attrs(NAN)), "not finite"},
      {V1Address({Tl{}}, 1, 6, V1Attrs(1, INFINITY)), "not finite"},
      {V1Address({Tl{}}, 1, 6, V1Attrs(1, 0)), "bandwidth is 0"},
      {V1Address({Tl{0x1, 2, false}}), "truncated"},  // claims a further record
      {V1Address({Tl{}}, 0x80 | 1), "no transports"},   // an empty device only
  };
  for (const Case& c : cases) {
    absl::Status s = ParseUcxWorkerAddress(c.blob).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.expect;
    EXPECT_THAT(s.message(), HasSubstr(c.expect)) << s;
  }
  EXPECT_FALSE(ParseUcxWorkerAddress(std::string(kMaxUcxWorkerAddressBytes + 1, '\0')).ok());
}

TEST(UcxWorkerAddressTest, RecordsOfKnownTransportsMustBeAsLongAsOurs) {
  const std::vector<UcxAddressRecord> local = {{0x1234, 1, 6, 2}};
  EXPECT_TRUE(ValidateUcxWorkerAddress(V1Address({Tl{0x1234, 2}}), local).ok());
  EXPECT_TRUE(ValidateUcxWorkerAddress(V1Address({Tl{0x1234, 4}}, 1, 18), local).ok());
  // A 0-byte interface address would reach UCT as a null pointer.
  absl::Status s = ValidateUcxWorkerAddress(V1Address({Tl{0x1234, 0}}), local);
  EXPECT_THAT(s.message(), HasSubstr("packs at least 6 and 2"));
  EXPECT_FALSE(ValidateUcxWorkerAddress(V1Address({Tl{0x1234, 2}}, 1, 0), local).ok());
  // A transport we lack: bounds only.
  EXPECT_TRUE(ValidateUcxWorkerAddress(V1Address({Tl{0x9999, 0}}, 1, 0), local).ok());
}

// --- Landing keys and messages (transfer/landing_wire.h) ----------------------------------------

landing::Token SomeToken() {
  landing::Token t;
  for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<uint8_t>(0xa0 + i);
  return t;
}

TEST(LandingWireTest, KeyRoundTripsAndRefusesAnythingElse) {
  const std::string key = landing::PackKey(SomeToken());
  ASSERT_EQ(key.size(), landing::kKeyBytes);
  absl::StatusOr<landing::Token> t = landing::ParseKey(key);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*t, SomeToken());
  for (size_t n = 0; n < key.size(); ++n) EXPECT_FALSE(landing::ParseKey(key.substr(0, n)).ok());
  EXPECT_FALSE(landing::ParseKey(key + "x").ok());
  // A packed UCX rkey (what decode nodes sent before landings): refused, saying why.
  const std::string rkey("\x00\x00\x00\x00\x00\x00\x00\x00\x00", 9);
  EXPECT_THAT(landing::ParseKey(rkey).status().message(), HasSubstr("upgrade both"));
  std::string bad = key;
  bad[4] = 2;
  EXPECT_THAT(landing::ParseKey(bad).status().message(), HasSubstr("version 2"));
  bad = key;
  bad[6] = 1;
  EXPECT_THAT(landing::ParseKey(bad).status().message(), HasSubstr("reserved"));
  // Two tokens from the kernel differ.
  absl::StatusOr<landing::Token> a = landing::NewToken(), b = landing::NewToken();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(*a, *b);
}

template <size_t N>
absl::string_view View(const std::array<uint8_t, N>& a) {
  return absl::string_view(reinterpret_cast<const char*>(a.data()), N);
}

TEST(LandingWireTest, HeadersRoundTrip) {
  const landing::WriteHeaderBytes w =
      landing::PackWriteHeader({SomeToken(), 0x1122334455667788ull, 42, 0x7f0012345678ull});
  absl::StatusOr<landing::WriteHeader> wh = landing::ParseWriteHeader(View(w));
  ASSERT_TRUE(wh.ok()) << wh.status();
  EXPECT_EQ(wh->token, SomeToken());
  EXPECT_EQ(wh->stream, 0x1122334455667788ull);
  EXPECT_EQ(wh->batch, 42u);
  EXPECT_EQ(wh->remote_addr, 0x7f0012345678ull);

  const landing::FenceHeaderBytes f = landing::PackFenceHeader({7, 9, 1000, 8192000});
  absl::StatusOr<landing::FenceHeader> fh = landing::ParseFenceHeader(View(f));
  ASSERT_TRUE(fh.ok()) << fh.status();
  EXPECT_EQ(fh->stream, 7u);
  EXPECT_EQ(fh->batch, 9u);
  EXPECT_EQ(fh->messages, 1000u);
  EXPECT_EQ(fh->bytes, 8192000u);

  landing::Ack ack;
  ack.stream = 7;
  ack.batch = 9;
  ack.accepted = 998;
  ack.accepted_bytes = 8175616;
  ack.refused = 2;
  ack.in_flight = 1;
  ack.first_refusal = landing::Refusal::kOutOfRange;
  const landing::AckBytes ab = landing::PackAck(ack);
  absl::StatusOr<landing::Ack> back = landing::ParseAck(View(ab));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->accepted, 998u);
  EXPECT_EQ(back->accepted_bytes, 8175616u);
  EXPECT_EQ(back->refused, 2u);
  EXPECT_EQ(back->in_flight, 1u);
  EXPECT_EQ(back->first_refusal, landing::Refusal::kOutOfRange);
}

// What a hostile peer can send the target's handler: every size but the exact one, every flipped
// framing byte, a swapped message kind: refused, never read past.
TEST(LandingWireTest, HeadersRefuseEverySizeAndFramingError) {
  const landing::WriteHeaderBytes w = landing::PackWriteHeader({SomeToken(), 1, 2, 0x10000});
  const std::string good(View(w));
  for (size_t n = 0; n <= good.size() + 16; ++n) {
    if (n == good.size()) continue;
    std::string b = good;
    b.resize(n, '\0');
    EXPECT_FALSE(landing::ParseWriteHeader(b).ok()) << n;
  }
  for (size_t i = 0; i < 8; ++i) {  // magic, version, reserved
    std::string b = good;
    b[i] = static_cast<char>(b[i] ^ 0x10);
    EXPECT_FALSE(landing::ParseWriteHeader(b).ok()) << i;
  }
  // A fence is not a write, nor an ack.
  const landing::FenceHeaderBytes f = landing::PackFenceHeader({1, 2, 3, 4});
  std::string fence(View(f));
  EXPECT_FALSE(landing::ParseWriteHeader(fence).ok());
  EXPECT_FALSE(landing::ParseAck(fence).ok());
  // An ack with an unknown refusal code or non-zero reserved tail.
  landing::AckBytes ab = landing::PackAck({});
  ab[56] = 9;
  EXPECT_FALSE(landing::ParseAck(View(ab)).ok());
  ab = landing::PackAck({});
  ab[63] = 1;
  EXPECT_FALSE(landing::ParseAck(View(ab)).ok());
}

}  // namespace
}  // namespace fluxion::transfer

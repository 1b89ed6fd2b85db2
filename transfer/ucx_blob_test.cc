// The structural checks of UCX 1.13's packed worker address (transfer/descriptor_check.h) and of
// the landing key (transfer/landing_wire.h) against real blobs of this host's UCX, and Connect()
// against hostile descriptors whose envelopes are well-formed (an attacker can compute a CRC):
// whatever the bytes, InvalidArgument or a clean UCX error, never a crash inside UCX; and a key
// whose token bits were flipped connects but lands nothing (the target knows no such landing).
//
// Also the proof of the crash these checks prevent: a worker address whose first byte has
// another format version makes ucp_ep_create abort (a death test, in a forked child).
//
// Nothing binds outside 127.0.0.1 (TCP on lo only); no environment is read.
#include <ucp/api/ucp.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "transfer/descriptor_check.h"
#include "transfer/landing_wire.h"
#include "transfer/transport.h"
#include "transfer/transport_testing.h"
#include "transfer/ucx_handles.h"
#include "transfer/ucx_transport.h"

namespace fluxion::transfer {
namespace {

using ::testing::HasSubstr;

constexpr size_t kBytes = 64 * 1024;

using Config = UcxTestConfig;

std::unique_ptr<UcxTransport> MakeTransport(const Config& c, const std::string& node) {
  UcxOptions o;
  o.node_name = node;
  o.compat = TestCompat();
  o.config = c.ucx;
  o.peer_error_handling = c.peer_error_handling;
  o.connect_timeout = absl::Seconds(10);
  absl::StatusOr<std::unique_ptr<UcxTransport>> t = NewUcxTransport(o);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *std::move(t) : nullptr;
}

class UcxBlobTest : public ::testing::TestWithParam<Config> {
 protected:
  void SetUp() override {
    writer_ = MakeTransport(GetParam(), "prefill-0");
    target_ = MakeTransport(GetParam(), "decode-0");
    ASSERT_NE(writer_, nullptr);
    ASSERT_NE(target_, nullptr);
    arena_.assign(kBytes, 0);
    auto reg = target_->Register({arena_.data(), arena_.size()});
    ASSERT_TRUE(reg.ok()) << reg.status();
    reg_ = *std::move(reg);
    descriptor_ = *reg_->Describe();
    auto a = UnwrapBlob(BlobField::kWorkerAddress, descriptor_.worker_address,
                        kMaxUcxWorkerAddressBytes);
    auto k = UnwrapBlob(BlobField::kRemoteKey, descriptor_.remote_key, kMaxUcxRemoteKeyBytes);
    ASSERT_TRUE(a.ok() && k.ok());
    address_ = a->payload;
    key_ = k->payload;
    auto records = ParseUcxWorkerAddress(address_);
    ASSERT_TRUE(records.ok()) << records.status();
    local_ = *records;
  }
  void TearDown() override {
    reg_.reset();
    writer_.reset();
    target_.reset();
  }

  // `d` with its blobs replaced by well-formed envelopes around `address` and `key`.
  PeerDescriptor Rewrapped(const std::string& address, const std::string& key) const {
    PeerDescriptor d = descriptor_;
    d.worker_address = WrapBlob(BlobField::kWorkerAddress, address);
    d.remote_key = WrapBlob(BlobField::kRemoteKey, key, descriptor_.base_address,
                            descriptor_.length);
    return d;
  }

  std::unique_ptr<UcxTransport> writer_, target_;
  std::vector<uint8_t> arena_;
  std::unique_ptr<Registration> reg_;
  PeerDescriptor descriptor_;
  std::string address_, key_;
  std::vector<UcxAddressRecord> local_;
};

TEST_P(UcxBlobTest, RealBlobsPassAndEveryTruncationOrExtensionIsRefused) {
  EXPECT_TRUE(ValidateUcxWorkerAddress(address_, local_).ok());
  EXPECT_TRUE(landing::ParseKey(key_).ok());
  EXPECT_FALSE(local_.empty());
  for (size_t n = 0; n < address_.size(); ++n) {
    EXPECT_FALSE(ParseUcxWorkerAddress(address_.substr(0, n)).ok()) << n;
  }
  for (size_t n = 0; n < key_.size(); ++n) {
    EXPECT_FALSE(landing::ParseKey(key_.substr(0, n)).ok()) << n;
  }
  for (size_t extra = 1; extra <= 8; ++extra) {
    EXPECT_FALSE(ParseUcxWorkerAddress(address_ + std::string(extra, '\0')).ok()) << extra;
    EXPECT_FALSE(landing::ParseKey(key_ + std::string(extra, '\0')).ok()) << extra;
  }
}

TEST_P(UcxBlobTest, UnknownAddressVersionIsRefused) {
  for (int version = 2; version < 16; ++version) {
    std::string a = address_;
    a[0] = static_cast<char>((a[0] & 0xf0) | version);
    absl::Status s = ParseUcxWorkerAddress(a).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("unknown address format version"));
  }
}

// Every single-bit flip of the raw worker address and key, inside a well-formed envelope (what
// an attacker can send): Connect() never crashes. A flipped key is refused (framing bytes) or
// names a token no landing has: it connects, and the target refuses its writes without touching
// memory. What the address checks cannot refuse (a flipped uuid, port or IP byte is still a
// well-formed address) reaches UCX, which then fails cleanly or connects somewhere that does not
// answer; Connect's deadline bounds that.
TEST_P(UcxBlobTest, FlippedBlobsInsideValidEnvelopesNeverCrash) {
  size_t refused_by_us = 0, reached_target = 0;
  std::vector<uint8_t> source(64, 0x3c);
  auto source_reg = writer_->Register({source.data(), source.size()}, {/*remote_write=*/false});
  ASSERT_TRUE(source_reg.ok());
  for (size_t i = 0; i < key_.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string k = key_;
      k[i] = static_cast<char>(k[i] ^ (1 << bit));
      if (!landing::ParseKey(k).ok()) {
        ++refused_by_us;
        EXPECT_EQ(writer_->Connect(Rewrapped(address_, k)).status().code(),
                  absl::StatusCode::kInvalidArgument);
        continue;
      }
      ++reached_target;
      auto t = writer_->Connect(Rewrapped(address_, k));
      ASSERT_TRUE(t.ok()) << t.status();
      auto h = writer_->Write(**t, {{descriptor_.base_address, source.data(), source.size()}});
      ASSERT_TRUE(h.ok()) << h.status();
      EXPECT_EQ((*h)->Wait(absl::Seconds(10)).code(), absl::StatusCode::kFailedPrecondition);
      t->reset();
    }
  }
  EXPECT_EQ(reached_target, 8 * sizeof(landing::Token)) << "every token bit flip connects";
  EXPECT_TRUE(std::all_of(arena_.begin(), arena_.end(), [](uint8_t b) { return b == 0; }));
  EXPECT_EQ(target_->metrics().landing_refused, reached_target);
  source_reg->reset();
  // Address flips that pass the checks would each make an endpoint to wherever the flipped bytes
  // point (a wrong port waits for the connect timeout); those go through the parser only, and
  // every refusal must be an InvalidArgument from us.
  for (size_t i = 0; i < address_.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string a = address_;
      a[i] = static_cast<char>(a[i] ^ (1 << bit));
      if (!ValidateUcxWorkerAddress(a, local_).ok()) {
        ++refused_by_us;
        EXPECT_EQ(writer_->Connect(Rewrapped(a, key_)).status().code(),
                  absl::StatusCode::kInvalidArgument);
      }
    }
  }
  EXPECT_GT(refused_by_us, 0u);
  RecordProperty("refused", static_cast<int>(refused_by_us));
}

// Hand-made hostile addresses with correct envelopes.
TEST_P(UcxBlobTest, HostileAddressesAreRefusedBeforeUcx) {
  std::vector<std::pair<std::string, std::string>> cases;  // address, expected message part
  std::string a = address_;
  a[0] = static_cast<char>((a[0] & 0xf0) | 0x7);
  cases.push_back({a, "unknown address format version"});
  cases.push_back({address_.substr(0, address_.size() / 2), "truncated"});
  cases.push_back({address_ + "x", "trailing"});
  // A v1 header with only the null resource: an address without transports.
  cases.push_back({std::string(1, '\0') + std::string(8, 'u') + std::string(1, '\xff'),
                   "no transports"});
  for (const auto& [bad, why] : cases) {
    absl::Status s = writer_->Connect(Rewrapped(bad, key_)).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << why;
    EXPECT_THAT(s.message(), HasSubstr("worker_address")) << s;
    EXPECT_THAT(s.message(), HasSubstr(why)) << s;
  }
  // A key that is not a key.
  for (const std::string& k : {std::string(3, 'k'), std::string(9, '\x01'),
                               key_ + std::string(5, '\x7f')}) {
    absl::Status s = writer_->Connect(Rewrapped(address_, k)).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("remote_key")) << s;
  }
  // The real ones still connect.
  auto t = writer_->Connect(descriptor_);
  ASSERT_TRUE(t.ok()) << t.status();
  t->reset();
}

// Why the checks exist: UCX 1.13 aborts the whole process on an address with an unknown format
// version (ucs_assertv_always in ucp_address_unpack_header), which is what one changed byte in a
// Prefill's worker_address did to the prefill node before issue 12.
TEST_P(UcxBlobTest, RawUcxAbortsOnAnUnknownAddressVersion) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  std::string bad = address_;
  bad[0] = static_cast<char>((bad[0] & 0xf0) | 0x7);
  bad.append(kUcxBlobPadding, '\0');
  EXPECT_DEATH(
      {
        ucp_config_t* config = nullptr;
        ucp_config_read(nullptr, nullptr, &config);
        for (const auto& [k, v] : GetParam().ucx) ucp_config_modify(config, k.c_str(), v.c_str());
        ucp_params_t params = {};
        params.field_mask = UCP_PARAM_FIELD_FEATURES;
        params.features = UCP_FEATURE_AM;
        ucp_context_h context = nullptr;
        ucp_init(&params, config, &context);
        ucp_worker_params_t wp = {};
        ucp_worker_h worker = nullptr;
        ucp_worker_create(context, &wp, &worker);
        ucp_ep_params_t ep_params = {};
        ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
        ep_params.address = reinterpret_cast<const ucp_address_t*>(bad.data());
        ucp_ep_h ep = nullptr;
        ucp_ep_create(worker, &ep_params, &ep);
      },
      "addr version");
}

bool SameExceptMdIndex(const std::vector<UcxAddressRecord>& a,
                       const std::vector<UcxAddressRecord>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].tl_name_checksum != b[i].tl_name_checksum ||
        a[i].device_address_bytes != b[i].device_address_bytes ||
        a[i].iface_address_bytes != b[i].iface_address_bytes) {
      return false;
    }
  }
  return true;
}

// An address whose md indices are rearranged hands UCX's transports each other's records (with
// packed UCX rkeys, a flipped md index once made UCX attach a System V segment from the "self"
// record and crash). UCX no longer unpacks keys of ours, but ucp_ep_create still reads the
// address: every such flip must connect or fail cleanly. Only flips that change md indices (and
// nothing else the parser sees) are sent through UCX here: they still point at our own target,
// so this test cannot reach another process on the host.
TEST_P(UcxBlobTest, AddressFlipsOfMdIndicesNeverCrash) {
  size_t sent = 0;
  for (size_t i = 0; i < address_.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string a = address_;
      a[i] = static_cast<char>(a[i] ^ (1 << bit));
      absl::StatusOr<std::vector<UcxAddressRecord>> records = ParseUcxWorkerAddress(a);
      if (!records.ok() || !SameExceptMdIndex(*records, local_)) continue;
      bool md_changed = false;
      for (size_t r = 0; r < records->size(); ++r) {
        md_changed |= (*records)[r].md_index != local_[r].md_index;
      }
      if (!md_changed) continue;
      ++sent;
      auto t = writer_->Connect(Rewrapped(a, key_));
      if (t.ok()) t->reset();
    }
  }
  EXPECT_GT(sent, 0u);
}

// Not run routinely: every single-bit flip of the real address that passes the checks, through
// UCX. A flipped port or segment id can reach another UCX process on this host (and the probe
// read would then run in that process), so run it only on a machine of your own:
//   transfer_ucx_blob_test --gtest_also_run_disabled_tests --gtest_filter='*EveryAcceptedFlip*'
// Last run: 377 (TCP) and 1086 (shared memory) accepted flips, no crash.
TEST_P(UcxBlobTest, DISABLED_EveryAcceptedFlipThroughUcx) {
  UcxOptions o;
  o.node_name = "prefill-x";
  o.compat = TestCompat();
  o.config = GetParam().ucx;
  o.peer_error_handling = GetParam().peer_error_handling;
  o.connect_timeout = absl::Milliseconds(300);
  auto w = NewUcxTransport(o);
  ASSERT_TRUE(w.ok()) << w.status();
  for (size_t i = 0; i < address_.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string a = address_;
      a[i] = static_cast<char>(a[i] ^ (1 << bit));
      if (!ValidateUcxWorkerAddress(a, local_).ok()) continue;
      auto t = (*w)->Connect(Rewrapped(a, key_));
      if (t.ok()) t->reset();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, UcxBlobTest,
    ::testing::Values(Config{"Tcp", {{"TLS", "tcp"}, {"NET_DEVICES", "lo"}}, true},
                      Config{"Shm", {{"TLS", "sm,self"}}, false}),
    [](const ::testing::TestParamInfo<Config>& info) { return info.param.name; });

}  // namespace
}  // namespace fluxion::transfer

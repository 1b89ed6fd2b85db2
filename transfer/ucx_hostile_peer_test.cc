// A target UcxTransport against a hostile peer that speaks the UCP API directly (its own context,
// worker and endpoint, no Transport in between): it sends landing messages with every header it
// likes — wrong sizes and framing, unknown tokens, ranges outside the landing or wrapping the
// address space, eager and rendezvous, fences without a reply endpoint or with data, fake acks,
// floods of batches that never end — and an honest writer then checks that the target still
// serves. The target must never crash, never write outside its live registration, and keep its
// per-batch state bounded (UcxOptions::landing_limits).
//
// What such a peer can still do on TCP by speaking raw UCT (PUT requests) is out of reach of any
// UCP-level check: docs/TRANSFER.md, "Remote-key scope".
//
// Nothing binds outside 127.0.0.1 (TCP on lo only); no environment is read.
#include <ucp/api/ucp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "transfer/descriptor_check.h"
#include "transfer/landing_wire.h"
#include "transfer/transport.h"
#include "transfer/transport_testing.h"
#include "transfer/ucx_transport.h"

namespace fluxion::transfer {
namespace {

constexpr size_t kPage = 8192;
constexpr size_t kBytes = 64 * kPage;
constexpr size_t kRunOffset = 16 * kPage;
constexpr size_t kRunBytes = 16 * kPage;
constexpr uint8_t kSentinel = 0x5a;
constexpr size_t kMaxBatches = 64;

using Config = UcxTestConfig;

UcxOptions Options(const Config& c, const std::string& node) {
  UcxOptions o;
  o.node_name = node;
  o.compat = TestCompat();
  o.config = c.ucx;
  o.peer_error_handling = c.peer_error_handling;
  o.landing_limits.max_batches = kMaxBatches;
  return o;
}

// The hostile peer: raw UCP, AM only. Every call progresses its own worker until its sends are
// done, so that nothing it issued is still pending when the test looks at the target.
class RawPeer {
 public:
  static std::unique_ptr<RawPeer> Connect(const Config& c, const std::string& target_address) {
    auto p = std::unique_ptr<RawPeer>(new RawPeer());
    ucp_config_t* config = nullptr;
    if (ucp_config_read(nullptr, nullptr, &config) != UCS_OK) return nullptr;
    for (const auto& [k, v] : c.ucx) ucp_config_modify(config, k.c_str(), v.c_str());
    ucp_params_t params = {};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_AM;
    const ucs_status_t s = ucp_init(&params, config, &p->context_);
    ucp_config_release(config);
    if (s != UCS_OK) return nullptr;
    ucp_worker_params_t wp = {};
    if (ucp_worker_create(p->context_, &wp, &p->worker_) != UCS_OK) return nullptr;
    ucp_am_handler_param_t ack = {};
    ack.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                     UCP_AM_HANDLER_PARAM_FIELD_ARG;
    ack.id = landing::kAckAmId;
    ack.cb = &RawPeer::OnAck;
    ack.arg = p.get();
    if (ucp_worker_set_am_recv_handler(p->worker_, &ack) != UCS_OK) return nullptr;
    p->address_ = target_address;
    p->address_.append(kUcxBlobPadding, '\0');
    ucp_ep_params_t ep = {};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    ep.address = reinterpret_cast<const ucp_address_t*>(p->address_.data());
    if (c.peer_error_handling) {
      ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
      ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    }
    if (ucp_ep_create(p->worker_, &ep, &p->ep_) != UCS_OK) return nullptr;
    return p;
  }
  ~RawPeer() {
    if (ep_ != nullptr) {
      ucp_request_param_t param = {};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      param.flags = UCP_EP_CLOSE_FLAG_FORCE;
      Wait(ucp_ep_close_nbx(ep_, &param));
    }
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    if (context_ != nullptr) ucp_cleanup(context_);
  }

  // Sends one active message and progresses until it left.
  void Send(uint16_t id, const void* header, size_t header_length, const void* data,
            size_t length, uint32_t flags = 0) {
    ucp_request_param_t param = {};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = flags;
    Wait(ucp_am_send_nbx(ep_, id, header, header_length, data, length, &param));
  }
  void SendWrite(const landing::WriteHeader& h, const void* data, size_t length,
                 uint32_t flags = 0) {
    const landing::WriteHeaderBytes bytes = landing::PackWriteHeader(h);
    Send(landing::kWriteAmId, bytes.data(), bytes.size(), data, length, flags);
  }
  // A fence with a reply endpoint; returns the target's ack (or nothing within 10 s).
  std::optional<landing::Ack> Fence(const landing::FenceHeader& h) {
    acks_.clear();
    const landing::FenceHeaderBytes bytes = landing::PackFenceHeader(h);
    Send(landing::kFenceAmId, bytes.data(), bytes.size(), nullptr, 0, UCP_AM_SEND_FLAG_REPLY);
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (acks_.empty() && absl::Now() < deadline) ucp_worker_progress(worker_);
    if (acks_.empty()) return std::nullopt;
    return acks_.back();
  }
  void Progress(absl::Duration d) {
    const absl::Time end = absl::Now() + d;
    while (absl::Now() < end) ucp_worker_progress(worker_);
  }

 private:
  RawPeer() = default;
  static ucs_status_t OnAck(void* arg, const void* header, size_t header_length, void*, size_t,
                            const ucp_am_recv_param_t*) {
    auto a = landing::ParseAck(
        absl::string_view(static_cast<const char*>(header), header_length));
    if (a.ok()) static_cast<RawPeer*>(arg)->acks_.push_back(*a);
    return UCS_OK;
  }
  void Wait(ucs_status_ptr_t request) {
    if (!UCS_PTR_IS_PTR(request)) return;
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (ucp_request_check_status(request) == UCS_INPROGRESS && absl::Now() < deadline) {
      ucp_worker_progress(worker_);
    }
    ucp_request_free(request);
  }

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_ep_h ep_ = nullptr;
  std::string address_;
  std::vector<landing::Ack> acks_;
};

class UcxHostilePeerTest : public ::testing::TestWithParam<Config> {
 protected:
  void SetUp() override {
    auto t = NewUcxTransport(Options(GetParam(), "decode-0"));
    ASSERT_TRUE(t.ok()) << t.status();
    target_ = *std::move(t);
    memory_.assign(kBytes, kSentinel);
    auto whole = target_->Register({memory_.data(), memory_.size()});  // another request's pages
    auto run = target_->Register({memory_.data() + kRunOffset, kRunBytes});
    ASSERT_TRUE(whole.ok() && run.ok());
    whole_ = *std::move(whole);
    run_ = *std::move(run);
    run_descriptor_ = *run_->Describe();
    auto address = UnwrapBlob(BlobField::kWorkerAddress, run_descriptor_.worker_address,
                              kMaxUcxWorkerAddressBytes);
    auto key = UnwrapBlob(BlobField::kRemoteKey, run_descriptor_.remote_key,
                          kMaxUcxRemoteKeyBytes);
    ASSERT_TRUE(address.ok() && key.ok());
    auto token = landing::ParseKey(key->payload);
    ASSERT_TRUE(token.ok()) << token.status();
    token_ = *token;
    peer_ = RawPeer::Connect(GetParam(), address->payload);
    ASSERT_NE(peer_, nullptr);
    payload_.assign(4 * kPage, 0xee);
  }
  void TearDown() override {
    peer_.reset();
    run_.reset();
    whole_.reset();
    target_.reset();
  }

  uint64_t Addr(size_t offset) const { return reinterpret_cast<uintptr_t>(memory_.data()) + offset; }

  // Every byte outside [from, to) of the target's memory still holds the sentinel.
  void ExpectSentinelOutside(size_t from, size_t to) {
    for (size_t i = 0; i < kBytes; ++i) {
      if (i >= from && i < to) continue;
      ASSERT_EQ(memory_[i], kSentinel) << "byte " << i << " was written";
    }
  }

  // An honest writer still connects and lands a page in the run.
  void ExpectTargetServes() {
    auto w = NewUcxTransport(Options(GetParam(), "prefill-0"));
    ASSERT_TRUE(w.ok()) << w.status();
    std::vector<uint8_t> page(kPage, 0x11);
    auto src = (*w)->Register({page.data(), page.size()}, {/*remote_write=*/false});
    ASSERT_TRUE(src.ok());
    auto remote = (*w)->Connect(run_descriptor_);
    ASSERT_TRUE(remote.ok()) << remote.status();
    auto h = (*w)->Write(**remote, {{Addr(kRunOffset + kRunBytes - kPage), page.data(), kPage}});
    ASSERT_TRUE(h.ok()) << h.status();
    EXPECT_TRUE((*h)->Wait(absl::Seconds(10)).ok());
    EXPECT_EQ(0, std::memcmp(memory_.data() + kRunOffset + kRunBytes - kPage, page.data(), kPage));
    remote->reset();
    src->reset();
  }

  std::unique_ptr<UcxTransport> target_;
  std::vector<uint8_t> memory_;
  std::unique_ptr<Registration> whole_, run_;
  PeerDescriptor run_descriptor_;
  landing::Token token_;
  std::unique_ptr<RawPeer> peer_;
  std::vector<uint8_t> payload_;
};

TEST_P(UcxHostilePeerTest, MalformedAndOutOfRangeWritesAreRefusedAndCounted) {
  const landing::WriteHeaderBytes good = landing::PackWriteHeader({token_, 1, 1, Addr(kRunOffset)});
  // Headers of every wrong size, wrong magic and version, no header at all.
  for (size_t n : {size_t{0}, size_t{1}, landing::kWriteHeaderBytes - 1,
                   landing::kWriteHeaderBytes + 1, size_t{200}}) {
    std::vector<uint8_t> h(n, 0);
    std::memcpy(h.data(), good.data(), std::min(n, good.size()));
    peer_->Send(landing::kWriteAmId, n == 0 ? nullptr : h.data(), n, payload_.data(), kPage);
  }
  landing::WriteHeaderBytes bad = good;
  bad[0] ^= 1;
  peer_->Send(landing::kWriteAmId, bad.data(), bad.size(), payload_.data(), kPage);
  bad = good;
  bad[4] = 7;
  peer_->Send(landing::kWriteAmId, bad.data(), bad.size(), payload_.data(), kPage);
  // A token no landing has.
  landing::Token other = token_;
  other[0] ^= 0x80;
  peer_->SendWrite({other, 2, 1, Addr(kRunOffset)}, payload_.data(), kPage);
  // The run's real token with ranges outside it: before, across its end, the whole memory,
  // wrapping the address space, the zero page; eager and rendezvous.
  const std::vector<std::pair<uint64_t, size_t>> outside = {
      {Addr(kRunOffset - kPage), kPage},
      {Addr(kRunOffset + kRunBytes - kPage), 2 * kPage},
      {Addr(0), 4 * kPage},
      {UINT64_MAX - 64, 128},
      {0, kPage},
  };
  for (uint32_t flags : {0u, uint32_t{UCP_AM_SEND_FLAG_EAGER}, uint32_t{UCP_AM_SEND_FLAG_RNDV}}) {
    for (const auto& [addr, length] : outside) {
      peer_->SendWrite({token_, 3, 1, addr}, payload_.data(), length, flags);
    }
  }
  // A write message with no data at all.
  peer_->SendWrite({token_, 3, 1, Addr(kRunOffset)}, nullptr, 0);
  auto ack = peer_->Fence({3, 1, 3 * outside.size() + 1, 0});
  ASSERT_TRUE(ack.has_value()) << "the target did not answer the fence";
  EXPECT_EQ(ack->accepted, 0u);
  EXPECT_EQ(ack->refused, 3 * outside.size() + 1);
  EXPECT_EQ(ack->first_refusal, landing::Refusal::kOutOfRange);
  ExpectSentinelOutside(0, 0);
  EXPECT_GE(target_->metrics().landing_refused, 3 * outside.size() + 1 + 8);
  EXPECT_EQ(target_->metrics().landed_bytes, 0u);
  // Inside the run the same peer may write, eager and rendezvous: the check is the range, not who.
  peer_->SendWrite({token_, 4, 1, Addr(kRunOffset)}, payload_.data(), kPage, UCP_AM_SEND_FLAG_EAGER);
  peer_->SendWrite({token_, 4, 1, Addr(kRunOffset + kPage)}, payload_.data(), 2 * kPage,
                   UCP_AM_SEND_FLAG_RNDV);
  ack = peer_->Fence({4, 1, 2, 3 * kPage});
  ASSERT_TRUE(ack.has_value());
  EXPECT_EQ(ack->accepted, 2u);
  EXPECT_EQ(ack->accepted_bytes, 3 * kPage);
  EXPECT_EQ(ack->in_flight, 0u);
  ExpectSentinelOutside(kRunOffset, kRunOffset + 3 * kPage);
  ExpectTargetServes();
}

TEST_P(UcxHostilePeerTest, FencesAndAcksThatAreNotWhatTheySeemAreDropped) {
  const landing::FenceHeaderBytes fence = landing::PackFenceHeader({5, 1, 0, 0});
  // No reply endpoint (the target cannot answer and must not try), data attached, bad sizes.
  peer_->Send(landing::kFenceAmId, fence.data(), fence.size(), nullptr, 0);
  peer_->Send(landing::kFenceAmId, fence.data(), fence.size(), payload_.data(), kPage,
              UCP_AM_SEND_FLAG_REPLY);
  peer_->Send(landing::kFenceAmId, fence.data(), fence.size(), payload_.data(), 4 * kPage,
              UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_RNDV);
  peer_->Send(landing::kFenceAmId, fence.data(), fence.size() - 1, nullptr, 0,
              UCP_AM_SEND_FLAG_REPLY);
  // Acks sent to the target (which writes nothing and expects none from this peer), and ids
  // nobody handles, below, between and far above ours (UCX 1.13 leaves unused handler slots
  // uninitialized: the landing table clears all of them), eager and rendezvous.
  const landing::AckBytes ack = landing::PackAck({});
  peer_->Send(landing::kAckAmId, ack.data(), ack.size(), nullptr, 0, UCP_AM_SEND_FLAG_REPLY);
  for (uint16_t id : {0, 5, 16, 20, 35, 36, 4242, 65535}) {
    peer_->Send(id, ack.data(), ack.size(), payload_.data(), kPage, UCP_AM_SEND_FLAG_EAGER);
    peer_->Send(id, ack.data(), ack.size(), payload_.data(), 4 * kPage, UCP_AM_SEND_FLAG_RNDV);
  }
  peer_->Progress(absl::Milliseconds(100));
  // A well-formed fence for a batch nobody wrote is answered with nothing accounted for.
  auto answer = peer_->Fence({6, 1, 10, 100});
  ASSERT_TRUE(answer.has_value());
  EXPECT_EQ(answer->accepted + answer->refused + answer->in_flight, 0u);
  ExpectSentinelOutside(0, 0);
  ExpectTargetServes();
}

// Batches that never end (write messages without a fence) each leave a tally at the target: at
// most landing_limits.max_batches are kept, whatever the peer sends.
TEST_P(UcxHostilePeerTest, BatchesThatNeverEndKeepTheTargetsStateBounded) {
  for (uint64_t batch = 0; batch < 20 * kMaxBatches; ++batch) {
    peer_->SendWrite({token_, 7, batch, Addr(kRunOffset)}, payload_.data(), 64);
  }
  peer_->Progress(absl::Milliseconds(50));
  EXPECT_LE(target_->LandingBatchesForTesting(), kMaxBatches);
  EXPECT_GT(target_->LandingBatchesForTesting(), 0u);
  ExpectSentinelOutside(kRunOffset, kRunOffset + 64);
  ExpectTargetServes();
}

// UCX 1.13's new protocol layer overflows a stack buffer when it sends a short active message
// with a reply endpoint and a header, which every fence and ack is: any peer could crash a target
// by sending fences. The transport refuses to start with it.
TEST(UcxProtocolTest, TheNewProtocolLayerOfUcx113IsRefused) {
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  if (major > 1 || minor >= 14) GTEST_SKIP() << "UCX " << major << "." << minor << " is fixed";
  UcxOptions o = Options(Config{"Tcp", {{"TLS", "tcp"}, {"NET_DEVICES", "lo"}}, true}, "x");
  o.config.push_back({"PROTO_ENABLE", "y"});
  auto t = NewUcxTransport(o);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition) << t.status();
  o.config.back().second = "n";
  EXPECT_TRUE(NewUcxTransport(o).ok());
}

INSTANTIATE_TEST_SUITE_P(
    All, UcxHostilePeerTest,
    ::testing::Values(Config{"Tcp", {{"TLS", "tcp"}, {"NET_DEVICES", "lo"}}, true},
                      Config{"Shm", {{"TLS", "sm,self"}}, false}),
    [](const ::testing::TestParamInfo<Config>& info) { return info.param.name; });

}  // namespace
}  // namespace fluxion::transfer

// The prefill engine against per-reservation keys (KvTarget.ranges), over the loopback transport,
// which enforces a registration's range and its revocation as a NIC would: a stale request from a
// finished reservation cannot change the pages of the request that got them next, and pages
// outside the request's ranges are refused before anything is written.
#include "prefill/prefill_engine.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>

#include "decode/kv_admission.h"
#include "gtest/gtest.h"
#include "model/random_model.h"
#include "model/sparse_state.h"
#include "proto/convert.h"
#include "transfer/loopback_transport.h"

namespace fluxion::prefill {
namespace {

namespace v1 = ::fluxion::v1;
using decode::KvAdmission;
using decode::KvArena;
using decode::PageRun;
using decode::Reservation;

constexpr int64_t kPageTokens = 16;
constexpr int kPromptTokens = 40;

class PrefillEngineRangesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/prefill_engine_test_" + std::to_string(getpid());
    ASSERT_TRUE(model::WriteRandomModel(*model::PresetConfig("tiny"), 5, dir_).ok());
    model_ = std::move(*model::Model::Load(dir_));
    const model::AttentionShape shape = model_->attention_shape();
    layout_ = proto::LayoutFor(model_->config(), dir_, "hash", kPageTokens);
    const transfer::CompatibilityRecord compat = proto::CompatibilityOf(layout_, 1);
    decode_ = std::make_unique<transfer::LoopbackTransport>(
        transfer::LoopbackOptions{"decode", compat});
    prefill_ = std::make_unique<transfer::LoopbackTransport>(
        transfer::LoopbackOptions{"prefill", compat});
    page_bytes_ = 2 * kPageTokens * shape.head_dim * 2;
    pages_ = shape.num_layers * shape.num_kv_heads * ((kPromptTokens + kPageTokens - 1) / kPageTokens);
    arena_ = std::move(*KvArena::Create(page_bytes_, pages_ * 4, {/*huge_pages=*/false}));
    arena_reg_ = std::move(*decode_->Register({arena_->base(), arena_->bytes()}, {true}));
    decode::KvAdmissionOptions options;
    options.release_thread = false;
    admission_ = std::make_unique<KvAdmission>(arena_.get(), options);
    engine_ = std::make_unique<PrefillEngine>(model_.get(), prefill_.get(), layout_,
                                              PrefillEngineOptions{});
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  Reservation Reserve() {
    absl::StatusOr<Reservation> r =
        admission_->Reserve(pages_, absl::Now() + absl::Seconds(10), [] { return false; });
    EXPECT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->RegisterRuns(decode_.get()).ok());
    return std::move(*r);
  }

  // The request the decode node would send for `pages` written with the keys of `keys`.
  v1::PrefillRequest RequestFor(const std::string& id, const Reservation& pages,
                                const Reservation& keys) {
    v1::PrefillRequest r;
    r.set_request_id(id);
    for (int i = 0; i < kPromptTokens; ++i) r.add_prompt_token_ids(static_cast<uint32_t>(7 + i));
    const transfer::PeerDescriptor arena = *arena_reg_->Describe();
    v1::KvTarget* kv = r.mutable_kv_target();
    kv->set_transport("loopback");
    kv->set_peer_name(arena.peer_name);
    kv->set_worker_address(arena.worker_address);
    kv->set_arena_base_address(arena.base_address);
    kv->set_arena_bytes(arena.length);
    kv->set_page_bytes(page_bytes_);
    for (const PageRun& run : pages.runs()) {
      v1::PageExtent* e = kv->add_extents();
      e->set_first_page_id(run.first);
      e->set_count(run.count);
    }
    for (const transfer::PeerDescriptor& d : keys.ranges()) {
      v1::RemoteRange* range = kv->add_ranges();
      range->set_base_address(d.base_address);
      range->set_length(d.length);
      range->set_remote_key(d.remote_key);
    }
    kv->set_page_order(v1::PAGE_ORDER_LAYER_HEAD_PAGE);
    kv->set_pages_per_head((kPromptTokens + kPageTokens - 1) / kPageTokens);
    kv->set_checksum_algorithm(v1::CHECKSUM_ALGORITHM_CRC32C);
    *r.mutable_layout() = layout_;
    r.set_protocol_version(1);
    return r;
  }

  absl::StatusOr<v1::PrefillResponse> Run(const v1::PrefillRequest& r) {
    return engine_->Run(r, [] { return false; });
  }

  void Fill(const Reservation& r, uint8_t byte) {
    for (const PageRun& run : r.runs()) {
      std::memset(arena_->page(run.first), byte, static_cast<size_t>(run.count) * page_bytes_);
    }
  }
  bool Holds(const Reservation& r, uint8_t byte) {
    for (const PageRun& run : r.runs()) {
      const uint8_t* p = arena_->page(run.first);
      for (size_t i = 0; i < static_cast<size_t>(run.count) * page_bytes_; ++i) {
        if (p[i] != byte) return false;
      }
    }
    return true;
  }

  std::string dir_;
  std::unique_ptr<model::Model> model_;
  v1::ModelLayout layout_;
  std::unique_ptr<transfer::LoopbackTransport> decode_, prefill_;
  size_t page_bytes_ = 0;
  int64_t pages_ = 0;
  std::unique_ptr<KvArena> arena_;
  std::unique_ptr<transfer::Registration> arena_reg_;
  std::unique_ptr<KvAdmission> admission_;
  std::unique_ptr<PrefillEngine> engine_;
};

TEST_F(PrefillEngineRangesTest, WritesThroughTheReservationsOwnRanges) {
  Reservation a = Reserve();
  Fill(a, 0);
  absl::StatusOr<v1::PrefillResponse> out = Run(RequestFor("a", a, a));
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_FALSE(Holds(a, 0));  // the KV landed
  a.SetPeerStopped();
}

TEST_F(PrefillEngineRangesTest, StaleRequestOfAFinishedReservationCannotChangeTheNextOnesPages) {
  Reservation a = Reserve();
  const v1::PrefillRequest stale = RequestFor("a", a, a);
  ASSERT_TRUE(Run(stale).ok());
  const std::vector<PageRun> a_runs = a.runs();
  a.SetPeerStopped();  // a replied; its keys are revoked
  a.Release();
  Reservation b = Reserve();  // the same pages, for another request
  ASSERT_EQ(b.runs(), a_runs);
  Fill(b, 0x5a);
  absl::StatusOr<v1::PrefillResponse> out = Run(stale);  // replayed, or a peer that kept it
  EXPECT_FALSE(out.ok());
  EXPECT_TRUE(Holds(b, 0x5a));
  b.SetPeerStopped();
}

// Why the keys are per reservation: with the arena-wide key (what decode nodes sent before
// KvTarget.ranges, still accepted from them), the same stale request rewrites the next owner's
// pages. This is the hazard the previous test shows closed.
TEST_F(PrefillEngineRangesTest, LegacyArenaWideKeyLetsAStaleRequestReachTheNextOwnersPages) {
  Reservation a = Reserve();
  v1::PrefillRequest stale = RequestFor("a", a, a);
  stale.mutable_kv_target()->clear_ranges();
  stale.mutable_kv_target()->set_remote_key(arena_reg_->Describe()->remote_key);
  ASSERT_TRUE(Run(stale).ok());
  a.SetPeerStopped();
  a.Release();
  Reservation b = Reserve();
  Fill(b, 0x5a);
  EXPECT_TRUE(Run(stale).ok());
  EXPECT_FALSE(Holds(b, 0x5a));  // corrupted
  b.SetPeerStopped();
}

TEST_F(PrefillEngineRangesTest, PagesOutsideTheRequestsRangesAreRefusedBeforeAnyWrite) {
  Reservation mine = Reserve();
  Reservation other = Reserve();  // another live request's pages, registered too
  Fill(mine, 0x11);
  Fill(other, 0x22);
  // Extents naming the other request's pages, with my keys.
  absl::StatusOr<v1::PrefillResponse> out = Run(RequestFor("x", other, mine));
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << out.status();
  EXPECT_NE(out.status().message().find("outside every kv_target.ranges entry"),
            std::string::npos)
      << out.status();
  EXPECT_TRUE(Holds(other, 0x22));
  EXPECT_TRUE(Holds(mine, 0x11));
  // A range that claims more than its key covers gets nothing either (the transport refuses).
  v1::PrefillRequest widened = RequestFor("y", other, mine);
  widened.mutable_kv_target()->mutable_ranges(0)->set_base_address(
      reinterpret_cast<uintptr_t>(arena_->base()));
  widened.mutable_kv_target()->mutable_ranges(0)->set_length(arena_->bytes());
  EXPECT_FALSE(Run(widened).ok());
  EXPECT_TRUE(Holds(other, 0x22));
  mine.SetPeerStopped();
  other.SetPeerStopped();
}

TEST_F(PrefillEngineRangesTest, SparseStateRoomOutsideTheRangesIsRefusedBeforeAnyWrite) {
  Reservation mine = Reserve();
  Reservation other = Reserve();
  Fill(mine, 0x11);
  Fill(other, 0x22);
  v1::PrefillRequest r = RequestFor("s", mine, mine);
  v1::SparseStateTarget* st = r.mutable_sparse_target();
  st->set_format_version(model::kSparseStateVersion);
  st->set_base_address(reinterpret_cast<uintptr_t>(arena_->base()));
  v1::ByteExtent* e = st->add_extents();  // the other request's pages as "my" state room
  e->set_offset(static_cast<uint64_t>(other.runs()[0].first) * page_bytes_);
  e->set_length(static_cast<uint64_t>(other.runs()[0].count) * page_bytes_);
  st->set_observation_window_tokens(32);
  st->set_score_block_tokens(1);
  absl::StatusOr<v1::PrefillResponse> out = Run(r);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << out.status();
  EXPECT_NE(out.status().message().find("sparse_target.extents[0]"), std::string::npos)
      << out.status();
  EXPECT_TRUE(Holds(other, 0x22));
  EXPECT_TRUE(Holds(mine, 0x11));
  mine.SetPeerStopped();
  other.SetPeerStopped();
}

TEST_F(PrefillEngineRangesTest, EmptyWorkerAddressIsInvalidArgument) {
  Reservation a = Reserve();
  v1::PrefillRequest r = RequestFor("a", a, a);
  r.mutable_kv_target()->clear_worker_address();
  absl::StatusOr<v1::PrefillResponse> out = Run(r);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << out.status();
  EXPECT_NE(out.status().message().find("worker_address"), std::string::npos);
  a.SetPeerStopped();
}

}  // namespace
}  // namespace fluxion::prefill

// The prefill engine against per-reservation keys (KvTarget.ranges), over the loopback transport,
// which enforces a registration's range and its revocation as a NIC would: a stale request from a
// finished reservation cannot change the pages of the request that got them next, and pages
// outside the request's ranges are refused before anything is written.
#include "prefill/prefill_engine.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <thread>
#include <vector>

#include "decode/kv_admission.h"
#include "gtest/gtest.h"
#include "model/random_model.h"
#include "model/sparse_state.h"
#include "proto/convert.h"
#include "transfer/crc32c.h"
#include "transfer/loopback_transport.h"
#include "transfer/page_meta.h"

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

  Reservation Reserve(int64_t pages = 0) {
    absl::StatusOr<Reservation> r = admission_->Reserve(
        pages > 0 ? pages : pages_, absl::Now() + absl::Seconds(10), [] { return false; });
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
  EXPECT_FALSE(out->has_page_meta());  // none asked for (a decode node older than the field)
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

// The page-metadata room, as the decode node reserves it: registered, named as byte extents.
struct MetaRoom {
  Reservation pages;
  uint64_t bytes = 0;  // what the prompt's metadata needs
};

class PrefillEngineMetaTest : public PrefillEngineRangesTest {
 protected:
  transfer::KvPageGeometry Geo() const {
    const model::AttentionShape shape = model_->attention_shape();
    return {shape.num_layers, shape.num_kv_heads, shape.head_dim, kPageTokens};
  }
  MetaRoom ReserveRoom() {
    MetaRoom room;
    room.bytes = transfer::PageMetaBytes(Geo(), kPromptTokens);
    room.pages = Reserve(static_cast<int64_t>((room.bytes + page_bytes_ - 1) / page_bytes_));
    return room;
  }
  // `r` asks for the metadata in `room`, whose ranges it also carries.
  void AskForMeta(v1::PrefillRequest* r, const MetaRoom& room, uint32_t version) {
    for (const transfer::PeerDescriptor& d : room.pages.ranges()) {
      v1::RemoteRange* range = r->mutable_kv_target()->add_ranges();
      range->set_base_address(d.base_address);
      range->set_length(d.length);
      range->set_remote_key(d.remote_key);
    }
    v1::PageMetaTarget* mt = r->mutable_page_meta_target();
    mt->set_format_version(version);
    mt->set_base_address(r->kv_target().arena_base_address());
    for (const PageRun& run : room.pages.runs()) {
      v1::ByteExtent* e = mt->add_extents();
      e->set_offset(static_cast<uint64_t>(run.first) * page_bytes_);
      e->set_length(static_cast<uint64_t>(run.count) * page_bytes_);
    }
  }
  // The room's first `bytes` bytes.
  std::vector<uint8_t> RoomBytes(const MetaRoom& room) {
    std::vector<uint8_t> out;
    for (const PageRun& run : room.pages.runs()) {
      const uint8_t* p = arena_->page(run.first);
      out.insert(out.end(), p, p + static_cast<size_t>(run.count) * page_bytes_);
    }
    out.resize(room.bytes);
    return out;
  }
  // What the metadata must be: encoded from the KV pages as they landed.
  std::vector<uint8_t> ExpectedMeta(const Reservation& kv) {
    const transfer::KvPageGeometry g = Geo();
    std::vector<uint8_t> pages;
    for (const PageRun& run : kv.runs()) {
      for (int32_t p = run.first; p < run.first + run.count; ++p) {
        pages.insert(pages.end(), arena_->page(p), arena_->page(p) + g.content_bytes());
      }
    }
    const uint64_t block = transfer::PageMetaLayerBytes(g, kPromptTokens);
    std::vector<uint8_t> meta(transfer::PageMetaBytes(g, kPromptTokens));
    const size_t layer_pages = g.pages_per_layer(kPromptTokens) * g.content_bytes();
    for (int64_t l = 0; l < g.num_layers; ++l) {
      transfer::EncodeLayerPageMeta(g, kPromptTokens, pages.data() + l * layer_pages,
                                    meta.data() + l * block);
    }
    return meta;
  }
};

TEST_F(PrefillEngineMetaTest, WritesEachLayersMetadataWithItsChecksum) {
  for (const bool layerwise : {true, false}) {
    SCOPED_TRACE(layerwise ? "layer by layer" : "after the last layer");
    PrefillEngineOptions options;
    options.layerwise = layerwise;
    options.piece_tokens = 16;  // pages complete in several pieces per layer
    engine_ = std::make_unique<PrefillEngine>(model_.get(), prefill_.get(), layout_, options);
    Reservation kv = Reserve();
    MetaRoom room = ReserveRoom();
    Fill(room.pages, 0xee);
    v1::PrefillRequest r = RequestFor("m", kv, kv);
    AskForMeta(&r, room, transfer::kPageMetaVersion);
    absl::StatusOr<v1::PrefillResponse> out = Run(r);
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_TRUE(out->has_page_meta());
    EXPECT_EQ(out->page_meta().format_version(), transfer::kPageMetaVersion);
    EXPECT_EQ(out->page_meta().bytes_written(), room.bytes);
    const std::vector<uint8_t> got = RoomBytes(room);
    EXPECT_TRUE(got == ExpectedMeta(kv));
    const int64_t layers = model_->attention_shape().num_layers;
    ASSERT_EQ(out->page_meta().layer_checksums_size(), layers);
    const uint64_t block = room.bytes / layers;
    for (int64_t l = 0; l < layers; ++l) {
      EXPECT_EQ(out->page_meta().layer_checksums(l), transfer::Crc32c(got.data() + l * block, block));
    }
    kv.SetPeerStopped();
    room.pages.SetPeerStopped();
  }
}

TEST_F(PrefillEngineMetaTest, UnknownFormatWritesNoMetadataAndTheRequestStillSucceeds) {
  Reservation kv = Reserve();
  MetaRoom room = ReserveRoom();
  Fill(room.pages, 0xee);
  v1::PrefillRequest r = RequestFor("m", kv, kv);
  AskForMeta(&r, room, transfer::kPageMetaVersion + 1);  // a newer decode node's format
  absl::StatusOr<v1::PrefillResponse> out = Run(r);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_FALSE(out->has_page_meta());  // the decode node computes it from the pages
  EXPECT_TRUE(Holds(room.pages, 0xee));
  kv.SetPeerStopped();
  room.pages.SetPeerStopped();
}

TEST_F(PrefillEngineMetaTest, RoomOutsideTheRangesOrTooSmallIsRefusedBeforeAnyWrite) {
  Reservation kv = Reserve();
  MetaRoom room = ReserveRoom();
  Reservation other = Reserve();
  Fill(kv, 0x11);
  Fill(other, 0x22);
  v1::PrefillRequest r = RequestFor("m", kv, kv);
  AskForMeta(&r, room, transfer::kPageMetaVersion);
  // The other request's pages as "my" room, with my keys.
  r.mutable_page_meta_target()->mutable_extents(0)->set_offset(
      static_cast<uint64_t>(other.runs()[0].first) * page_bytes_);
  absl::StatusOr<v1::PrefillResponse> out = Run(r);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << out.status();
  EXPECT_NE(out.status().message().find("page_meta_target.extents[0]"), std::string::npos)
      << out.status();
  EXPECT_TRUE(Holds(other, 0x22));
  EXPECT_TRUE(Holds(kv, 0x11));
  // A room one byte short.
  v1::PrefillRequest small = RequestFor("m2", kv, kv);
  AskForMeta(&small, room, transfer::kPageMetaVersion);
  v1::PageMetaTarget* mt = small.mutable_page_meta_target();
  mt->clear_extents();
  v1::ByteExtent* e = mt->add_extents();
  e->set_offset(static_cast<uint64_t>(room.pages.runs()[0].first) * page_bytes_);
  e->set_length(room.bytes - 1);
  out = Run(small);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kResourceExhausted) << out.status();
  EXPECT_TRUE(Holds(kv, 0x11));
  kv.SetPeerStopped();
  room.pages.SetPeerStopped();
  other.SetPeerStopped();
}

// The pages of `r` in their logical order (the runs' order).
std::vector<uint8_t> PagesOf(const KvArena& arena, const Reservation& r, size_t page_bytes) {
  std::vector<uint8_t> out;
  for (const PageRun& run : r.runs()) {
    const uint8_t* p = arena.page(run.first);
    out.insert(out.end(), p, p + static_cast<size_t>(run.count) * page_bytes);
  }
  return out;
}

// The staging ring at its smallest (one page of every KV head) while the decode node's transport
// holds every write queued, unread, for a while: the engine cannot reuse a slot, defers the pages
// it has no room for, and sends them from the Landing's drain once the writes move. A slot reused
// too early would send another page's bytes: the pages, the checksums and the page records must
// equal those of a run whose staging holds the whole prompt.
TEST_F(PrefillEngineMetaTest, ASmallRingWithStalledWritesSendsTheSamePagesAndChecksums) {
  v1::PrefillResponse want;
  std::vector<uint8_t> want_pages, want_meta;
  PrefillEngineOptions whole;
  whole.piece_tokens = 16;  // the pieces of the runs below: the same arithmetic
  engine_ = std::make_unique<PrefillEngine>(model_.get(), prefill_.get(), layout_, whole);
  {
    Reservation kv = Reserve();
    MetaRoom room = ReserveRoom();
    v1::PrefillRequest r = RequestFor("whole", kv, kv);
    r.mutable_sampling()->set_temperature(0);  // greedy: the first token is the logits'
    AskForMeta(&r, room, transfer::kPageMetaVersion);
    absl::StatusOr<v1::PrefillResponse> out = Run(r);
    ASSERT_TRUE(out.ok()) << out.status();
    want = *out;
    want_pages = PagesOf(*arena_, kv, page_bytes_);
    want_meta = RoomBytes(room);
    kv.SetPeerStopped();
    room.pages.SetPeerStopped();
  }
  for (const bool layerwise : {true, false}) {
    SCOPED_TRACE(layerwise ? "layer by layer" : "after the last layer");
    PrefillEngineOptions options;
    options.layerwise = layerwise;
    options.piece_tokens = 16;
    options.staging_ring_bytes = 1;  // raised to one page of every KV head
    engine_ = std::make_unique<PrefillEngine>(model_.get(), prefill_.get(), layout_, options);
    Reservation kv = Reserve();
    MetaRoom room = ReserveRoom();
    Fill(kv, 0xee);
    v1::PrefillRequest r = RequestFor("ring", kv, kv);
    r.mutable_sampling()->set_temperature(0);
    AskForMeta(&r, room, transfer::kPageMetaVersion);
    decode_->SetProgressPausedForTesting(true);
    std::thread release([this] {
      absl::SleepFor(absl::Milliseconds(300));
      decode_->SetProgressPausedForTesting(false);
    });
    absl::StatusOr<v1::PrefillResponse> out = Run(r);
    release.join();
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(out->first_token_id(), want.first_token_id());
    EXPECT_EQ(out->kv_bytes_written(), want.kv_bytes_written());
    ASSERT_EQ(out->layer_checksums_size(), want.layer_checksums_size());
    for (int l = 0; l < want.layer_checksums_size(); ++l) {
      EXPECT_EQ(out->layer_checksums(l), want.layer_checksums(l)) << "layer " << l;
    }
    // Every slot one page of each head (3 pages per head), and the ring was full: in the compute
    // only when sending layer by layer, in the drain either way.
    const StagingStats stats = engine_->staging_stats();
    EXPECT_EQ(stats.slots, static_cast<uint64_t>(model_->attention_shape().num_layers * 3));
    if (layerwise) {
      EXPECT_GT(stats.deferred, 0u);
    } else {
      EXPECT_EQ(stats.deferred, 0u);
    }
    EXPECT_GT(stats.drain_waits, 0u);
    EXPECT_TRUE(PagesOf(*arena_, kv, page_bytes_) == want_pages);
    EXPECT_TRUE(RoomBytes(room) == want_meta);
    ASSERT_EQ(out->page_meta().layer_checksums_size(), want.page_meta().layer_checksums_size());
    for (int l = 0; l < want.page_meta().layer_checksums_size(); ++l) {
      EXPECT_EQ(out->page_meta().layer_checksums(l), want.page_meta().layer_checksums(l)) << l;
    }
    kv.SetPeerStopped();
    room.pages.SetPeerStopped();
  }
}

// Writes that never complete hold the ring: the drain gives up after the transfer lease with an
// error that says so, instead of reusing a slot a write may still read.
TEST_F(PrefillEngineRangesTest, ARingHeldByWritesThatNeverCompleteFailsAfterTheLease) {
  PrefillEngineOptions options;
  options.staging_ring_bytes = 1;
  options.transfer_timeout = absl::Milliseconds(200);
  engine_ = std::make_unique<PrefillEngine>(model_.get(), prefill_.get(), layout_, options);
  Reservation kv = Reserve();
  decode_->SetProgressPausedForTesting(true);
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::PrefillResponse> out = Run(RequestFor("stuck", kv, kv));
  EXPECT_EQ(out.status().code(), absl::StatusCode::kDeadlineExceeded) << out.status();
  EXPECT_NE(out.status().message().find("did not complete"), std::string::npos) << out.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  kv.SetPeerStopped();
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

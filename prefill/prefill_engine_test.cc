// The prefill engine against per-reservation keys (KvTarget.ranges), over the loopback transport,
// which enforces a registration's range and its revocation as a NIC would: a stale request from a
// finished reservation cannot change the pages of the request that got them next, and pages
// outside the request's ranges are refused before anything is written. Then the engine's device
// path (batches, each request's slice of the device's staging) over a CPU stand-in for the GPU.
#include "prefill/prefill_engine.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/wait_testing.h"
#include "decode/kv/kv_admission.h"
#include "model/dense_attention.h"
#include "model/generator.h"
#include "model/logprobs.h"
#include "prefill/prefill_device.h"
#include "transfer/kv_pages.h"
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

// Stalls the writes into `decode`: paused now, resumed once `engine`'s drain waits for ring room
// (or after kGenerousWait, which the caller's checks then show), so that whatever the compute's
// speed the staging ring is held by queued writes through the compute and into the drain. Join the
// thread before checking.
std::thread StallWritesUntilTheDrainWaits(transfer::LoopbackTransport* decode,
                                          const PrefillEngine* engine) {
  decode->SetProgressPausedForTesting(true);
  const uint64_t before = engine->staging_stats().drain_waits;
  return std::thread([decode, engine, before] {
    WaitFor([&] { return engine->staging_stats().drain_waits != before; }, kGenerousWait,
            absl::Milliseconds(1));
    decode->SetProgressPausedForTesting(false);
  });
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
    std::thread release = StallWritesUntilTheDrainWaits(decode_.get(), engine_.get());
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
  // The writes never land (progress stays paused), so only the lease can end the run: at least
  // 200 ms after it began, and before a generous bound that a drain waiting forever would pass.
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::PrefillResponse> out = Run(RequestFor("stuck", kv, kv));
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(out.status().code(), absl::StatusCode::kDeadlineExceeded) << out.status();
  EXPECT_NE(out.status().message().find("did not complete"), std::string::npos) << out.status();
  EXPECT_GE(took, options.transfer_timeout);
  EXPECT_LT(took, kGenerousWait);
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

// --- The engine's device path, over a CPU stand-in for the GPU ---

// The GPU prefill's contract (prefill/prefill_device.h) kept on the CPU: each prompt through the
// CPU model in pieces of kStandInPiece rows (the CPU path's arithmetic with piece_tokens 16, so
// the pages are byte-equal to it), its pages packed as the wire lays them out, and the pieces
// reported in (chunk, layer) order with the prompts interleaved, as the GPU's packed chunks
// interleave them.
class CpuStandInDevice : public PrefillDevice {
 public:
  static constexpr int64_t kStandInPiece = 16;
  explicit CpuStandInDevice(const model::Model* m) : m_(m) {}

  const model::ModelConfig& config() const override { return m_->config(); }

  absl::StatusOr<uint8_t*> HostStaging(size_t bytes) override {
    if (refuse_staging) return absl::ResourceExhaustedError("stand-in: no staging");
    if (staging_.size() < bytes) staging_.assign(bytes, 0);
    return staging_.data();
  }

  absl::StatusOr<std::vector<absl::StatusOr<DevicePrefillResult>>> RunBatch(
      absl::Span<const DevicePrompt> prompts, const BatchPiecesReady& ready) override {
    const model::AttentionShape shape = m_->attention_shape();
    last_.assign(prompts.size(), Prompt{});
    std::vector<absl::StatusOr<DevicePrefillResult>> results;
    int64_t longest = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      FLUXION_ASSIGN_OR_RETURN(DevicePrefillResult r, Compute(prompts[i], &last_[i]));
      results.push_back(std::move(r));
      longest = std::max<int64_t>(longest, static_cast<int64_t>(prompts[i].tokens.size()));
    }
    for (int64_t first = 0; first < longest; first += kStandInPiece) {
      for (int layer = 0; layer < shape.num_layers; ++layer) {
        for (size_t i = 0; i < prompts.size(); ++i) {
          const int64_t n = static_cast<int64_t>(prompts[i].tokens.size());
          if (first >= n || !results[i].ok()) continue;
          if (prompts[i].cancelled && prompts[i].cancelled()) {
            results[i] = absl::CancelledError("stand-in: cancelled");
            continue;
          }
          if (absl::Status s = ready(i, layer, first, std::min(n, first + kStandInPiece)); !s.ok()) {
            results[i] = s;
          }
        }
      }
    }
    return results;
  }

  absl::Status CopyPages(size_t prompt, int layer, int64_t first_page, int64_t end_page,
                         uint8_t* pages, uint8_t* records) override {
    if (prompt >= last_.size()) return absl::InvalidArgumentError("stand-in: no such prompt");
    const Prompt& p = last_[prompt];
    const transfer::KvPageGeometry& g = p.geo;
    const int64_t per_head = g.pages_per_head(p.tokens), count = end_page - first_page;
    if (layer < 0 || layer >= g.num_layers || first_page < 0 || count < 1 || end_page > per_head) {
      return absl::InvalidArgumentError("stand-in: pages out of range");
    }
    const size_t cb = g.content_bytes(), layer_bytes = g.pages_per_layer(p.tokens) * cb;
    const uint64_t record = transfer::PageMetaRecordBytes(g);
    for (int64_t h = 0; h < g.num_kv_heads; ++h) {
      const size_t index = static_cast<size_t>(h * per_head + first_page);
      std::memcpy(pages + h * count * cb, p.pages.data() + layer * layer_bytes + index * cb,
                  count * cb);
      if (records != nullptr && !p.meta.empty()) {
        std::memcpy(records + index * record,
                    p.meta.data() + layer * transfer::PageMetaLayerBytes(g, p.tokens) +
                        index * record,
                    count * record);
      }
    }
    return absl::OkStatus();
  }

  bool refuse_staging = false;

 private:
  struct Prompt {
    int64_t tokens = 0;
    transfer::KvPageGeometry geo;
    std::vector<uint8_t> pages, meta;
  };

  absl::StatusOr<DevicePrefillResult> Compute(const DevicePrompt& in, Prompt* out) const {
    const model::AttentionShape shape = m_->attention_shape();
    const int64_t n = static_cast<int64_t>(in.tokens.size());
    auto owned = std::make_unique<model::DenseAttention>(shape);
    model::DenseAttention* dense = owned.get();
    dense->RecordQueries(std::max<int64_t>(0, n - model::kPrefillTailRows), n);
    model::Sequence seq(std::move(owned));
    DevicePrefillResult r;
    for (int64_t first = 0; first < n; first += kStandInPiece) {
      FLUXION_RETURN_IF_ERROR(
          m_->Forward(seq, in.tokens.subspan(first, std::min(kStandInPiece, n - first)), &r.logits));
    }
    out->tokens = n;
    out->geo = {shape.num_layers, shape.num_kv_heads, shape.head_dim, in.page_tokens};
    const size_t layer_bytes = out->geo.pages_per_layer(n) * out->geo.content_bytes();
    out->pages.assign(layer_bytes * shape.num_layers, 0);
    for (int l = 0; l < shape.num_layers; ++l) {
      transfer::PackLayerPages(out->geo, n, dense->keys(l), dense->values(l),
                               shape.num_kv_heads * shape.head_dim,
                               out->pages.data() + l * layer_bytes);
    }
    if (in.encode_meta) {
      const uint64_t block = transfer::PageMetaLayerBytes(out->geo, n);
      out->meta.assign(transfer::PageMetaBytes(out->geo, n), 0);
      for (int l = 0; l < shape.num_layers; ++l) {
        transfer::EncodeLayerPageMeta(out->geo, n, out->pages.data() + l * layer_bytes,
                                      out->meta.data() + l * block);
      }
    }
    if (in.capture_state) {
      FLUXION_ASSIGN_OR_RETURN(r.state, model::CaptureSparseState(*dense, shape));
    }
    r.forward_end = std::chrono::steady_clock::now();
    return r;
  }

  const model::Model* m_;
  std::vector<uint8_t> staging_;
  std::vector<Prompt> last_;
};

class PrefillEngineDeviceTest : public PrefillEngineMetaTest {
 protected:
  // Request `i` of a batch: its own prompt (the fixture's length), pages, metadata room, greedy.
  struct Request {
    Reservation kv;
    MetaRoom room;
    v1::PrefillRequest proto;
  };
  Request Make(int i) {
    Request r;
    r.kv = Reserve();
    r.room = ReserveRoom();
    Fill(r.kv, 0xee);
    r.proto = RequestFor(absl::StrCat("r", i), r.kv, r.kv);
    for (int t = 0; t < kPromptTokens; ++t) {
      r.proto.set_prompt_token_ids(t, static_cast<uint32_t>((t * (i + 3) + 11 * i) % 200 + 1));
    }
    r.proto.mutable_sampling()->set_temperature(0);
    AskForMeta(&r.proto, r.room, transfer::kPageMetaVersion);
    return r;
  }
  void Stop(Request& r) {
    r.kv.SetPeerStopped();
    r.room.pages.SetPeerStopped();
  }
  // What the CPU path sends for request `i`, alone: reply, pages, metadata.
  struct Sent {
    v1::PrefillResponse reply;
    std::vector<uint8_t> pages, meta;
  };
  Sent OnTheCpu(int i) {
    PrefillEngineOptions options;
    options.piece_tokens = CpuStandInDevice::kStandInPiece;
    PrefillEngine cpu(model_.get(), prefill_.get(), layout_, options);
    Request r = Make(i);
    absl::StatusOr<v1::PrefillResponse> out = cpu.Run(r.proto, [] { return false; });
    EXPECT_TRUE(out.ok()) << out.status();
    Sent s{out.ok() ? *out : v1::PrefillResponse{}, PagesOf(*arena_, r.kv, page_bytes_),
           RoomBytes(r.room)};
    Stop(r);
    return s;
  }
  // Runs `requests` as one batch on `engine`; the replies in request order.
  std::vector<absl::StatusOr<v1::PrefillResponse>> RunBatch(
      const PrefillEngine& engine, std::vector<Request>& requests,
      std::vector<std::function<bool()>> cancelled = {}) {
    std::vector<const v1::PrefillRequest*> protos;
    for (Request& r : requests) protos.push_back(&r.proto);
    cancelled.resize(requests.size());
    for (auto& c : cancelled) {
      if (!c) c = [] { return false; };
    }
    std::vector<absl::StatusOr<v1::PrefillResponse>> replies(requests.size(),
                                                             absl::UnknownError("no reply"));
    engine.RunBatch(protos, cancelled, [&](size_t i, absl::StatusOr<v1::PrefillResponse> r) {
      replies[i] = std::move(r);
    });
    return replies;
  }
  void ExpectSame(const Sent& want, const absl::StatusOr<v1::PrefillResponse>& got,
                  Request& r) {
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->first_token_id(), want.reply.first_token_id());
    ASSERT_EQ(got->layer_checksums_size(), want.reply.layer_checksums_size());
    for (int l = 0; l < want.reply.layer_checksums_size(); ++l) {
      EXPECT_EQ(got->layer_checksums(l), want.reply.layer_checksums(l)) << "layer " << l;
    }
    EXPECT_TRUE(PagesOf(*arena_, r.kv, page_bytes_) == want.pages);
    EXPECT_TRUE(RoomBytes(r.room) == want.meta);
  }
};

// Three requests through one device batch, each with a one-page-per-head ring (a slice of the
// device's staging) and the writes stalled until the drain waits, so that pages wait and go from
// the drain: each lands exactly what the CPU path sends for it alone.
TEST_F(PrefillEngineDeviceTest, ABatchSendsWhatTheCpuPathSendsForEachRequest) {
  std::vector<Sent> want;
  for (int i = 0; i < 3; ++i) want.push_back(OnTheCpu(i));
  CpuStandInDevice device(model_.get());
  PrefillEngineOptions options;
  options.staging_ring_bytes = 1;  // raised to one page of every KV head
  PrefillEngine engine(&device, prefill_.get(), layout_, options);
  std::vector<Request> requests;
  for (int i = 0; i < 3; ++i) requests.push_back(Make(i));
  std::thread release = StallWritesUntilTheDrainWaits(decode_.get(), &engine);
  std::vector<absl::StatusOr<v1::PrefillResponse>> got = RunBatch(engine, requests);
  release.join();
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE(::testing::Message() << "request " << i);
    ExpectSame(want[i], got[i], requests[i]);
    Stop(requests[i]);
  }
  EXPECT_GT(engine.staging_stats().deferred, 0u);
  EXPECT_GT(engine.staging_stats().drain_waits, 0u);
}

// A request cancelled mid-batch ends Cancelled; the others land what the CPU path sends.
TEST_F(PrefillEngineDeviceTest, ARequestCancelledMidBatchLeavesTheOthersUnharmed) {
  const Sent want0 = OnTheCpu(0), want2 = OnTheCpu(2);
  CpuStandInDevice device(model_.get());
  PrefillEngine engine(&device, prefill_.get(), layout_, PrefillEngineOptions{});
  std::vector<Request> requests;
  for (int i = 0; i < 3; ++i) requests.push_back(Make(i));
  int polls = 0;
  std::vector<absl::StatusOr<v1::PrefillResponse>> got =
      RunBatch(engine, requests, {nullptr, [&] { return ++polls > 3; }, nullptr});
  EXPECT_EQ(got[1].status().code(), absl::StatusCode::kCancelled) << got[1].status();
  ExpectSame(want0, got[0], requests[0]);
  ExpectSame(want2, got[2], requests[2]);
  for (Request& r : requests) Stop(r);
}

// When the device has no staging for the batch, every request of it fails with that error and
// nothing is written.
TEST_F(PrefillEngineDeviceTest, NoStagingFailsEveryRequestOfTheBatchBeforeAnyWrite) {
  CpuStandInDevice device(model_.get());
  device.refuse_staging = true;
  PrefillEngine engine(&device, prefill_.get(), layout_, PrefillEngineOptions{});
  std::vector<Request> requests;
  for (int i = 0; i < 2; ++i) requests.push_back(Make(i));
  std::vector<absl::StatusOr<v1::PrefillResponse>> got = RunBatch(engine, requests);
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_EQ(got[i].status().code(), absl::StatusCode::kResourceExhausted) << got[i].status();
    EXPECT_TRUE(Holds(requests[i].kv, 0xee));
    Stop(requests[i]);
  }
}

// The CPU path computes the logprobs a request asks for: the first token's from the last row, the
// prompt's from every row (a request asking for them runs alone beside the batch's others).
// Equal to a plain forward's log-softmax over every row.
TEST_F(PrefillEngineDeviceTest, TheCpuPathComputesTheFirstTokensAndThePromptsLogprobs) {
  const Sent want0 = OnTheCpu(0), want2 = OnTheCpu(2);
  PrefillEngineOptions options;
  options.piece_tokens = CpuStandInDevice::kStandInPiece;  // several pieces: several forwards
  PrefillEngine engine(model_.get(), prefill_.get(), layout_, options);
  std::vector<Request> requests;
  for (int i = 0; i < 3; ++i) requests.push_back(Make(i));
  requests[1].proto.mutable_sampling()->set_logprobs(2);
  requests[1].proto.mutable_sampling()->set_prompt_logprobs(3);
  std::vector<absl::StatusOr<v1::PrefillResponse>> got = RunBatch(engine, requests);
  // The other two went through the batched forward (equal to a lone one up to its GEMM's
  // blocking): their greedy tokens are the lone ones'.
  ASSERT_TRUE(got[0].ok() && got[1].ok() && got[2].ok());
  EXPECT_EQ(got[0]->first_token_id(), want0.reply.first_token_id());
  EXPECT_EQ(got[2]->first_token_id(), want2.reply.first_token_id());
  EXPECT_FALSE(got[0]->has_first_token_logprobs());
  EXPECT_EQ(got[0]->prompt_logprobs_size(), 0);

  const v1::PrefillRequest& asked = requests[1].proto;
  std::vector<int32_t> ids(asked.prompt_token_ids().begin(), asked.prompt_token_ids().end());
  std::unique_ptr<model::Sequence> seq = model_->NewSequence();
  std::vector<float> rows;
  ASSERT_TRUE(model_->Forward(*seq, ids, &rows, /*all_logits=*/true).ok());
  const int64_t vocab = model_->config().vocab_size;
  auto row = [&](int i) { return absl::MakeConstSpan(rows.data() + i * vocab, vocab); };
  ASSERT_EQ(got[1]->prompt_logprobs_size(), kPromptTokens - 1);
  for (int i = 0; i + 1 < kPromptTokens; ++i) {
    const model::TokenLogprobs want = model::LogprobsOfRow(row(i), ids[i + 1], 3);
    const v1::TokenLogprobs& l = got[1]->prompt_logprobs(i);
    EXPECT_NEAR(l.logprob(), want.logprob, 1e-4) << "position " << i;
    ASSERT_EQ(l.top_token_ids_size(), 3);
    for (int k = 0; k < 3; ++k) {
      EXPECT_EQ(l.top_token_ids(k), static_cast<uint32_t>(want.top_ids[k]));
      EXPECT_NEAR(l.top_logprobs(k), want.top_logprobs[k], 1e-4);
    }
  }
  const model::TokenLogprobs first = model::LogprobsOfRow(
      row(kPromptTokens - 1), static_cast<int32_t>(got[1]->first_token_id()), 2);
  EXPECT_EQ(first.top_ids[0], static_cast<int32_t>(got[1]->first_token_id()));  // greedy
  EXPECT_NEAR(got[1]->first_token_logprobs().logprob(), first.logprob, 1e-4);
  EXPECT_EQ(got[1]->first_token_logprobs().top_token_ids_size(), 2);
  for (Request& r : requests) Stop(r);
}

// A device whose forward does not compute prompt rows refuses prompt logprobs before any write.
TEST_F(PrefillEngineDeviceTest, ADeviceWithoutPromptLogprobsRefusesThemBeforeAnyWrite) {
  CpuStandInDevice device(model_.get());
  PrefillEngine engine(&device, prefill_.get(), layout_, PrefillEngineOptions{});
  std::vector<Request> requests;
  requests.push_back(Make(0));
  requests[0].proto.mutable_sampling()->set_prompt_logprobs(0);
  std::vector<absl::StatusOr<v1::PrefillResponse>> got = RunBatch(engine, requests);
  EXPECT_EQ(got[0].status().code(), absl::StatusCode::kFailedPrecondition) << got[0].status();
  EXPECT_TRUE(Holds(requests[0].kv, 0xee));
  Stop(requests[0]);
}

}  // namespace
}  // namespace fluxion::prefill

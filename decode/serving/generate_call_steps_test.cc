// The phases of a Generate call that run without the service
// (decode/serving/generate_call_steps.h): the Prefill request a reservation becomes, every ending
// of landing a prompt (what is refused, what is counted as a checksum failure, that the pages
// always come back), and joining the batch (a first token that already ends the request never
// joins). No gRPC, no transport, no peer.
#include "decode/serving/generate_call_steps.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <utility>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "common/test_temp_dir.h"
#include "gtest/gtest.h"
#include "model/random_model.h"
#include "model/sparse_state.h"
#include "transfer/crc32c.h"
#include "transfer/page_meta.h"

namespace fluxion::decode {
namespace {

namespace v1 = ::fluxion::v1;

constexpr int64_t kPageTokens = 16;
constexpr int64_t kPrompt = 40;  // 3 pages per head

class GenerateCallStepsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string dir = tmp_.path().string();
    ASSERT_TRUE(model::WriteRandomModel(*model::PresetConfig("tiny"), 5, dir).ok());
    model_ = std::move(*model::Model::Load(dir));
    shape_ = model_->attention_shape();
    kv_shape_ = KvShape{shape_.num_layers, shape_.num_kv_heads, shape_.head_dim, kPageTokens};
    arena_ = std::move(*KvArena::Create(kv_shape_.page_bytes(),
                                        shape_.num_layers * shape_.num_kv_heads * 64,
                                        {/*huge_pages=*/false}));
    KvAdmissionOptions ao;
    ao.release_thread = false;
    admission_ = std::make_unique<KvAdmission>(arena_.get(), ao);
    scheduler_ = std::make_unique<BatchScheduler>(
        model_.get(), admission_.get(), shape_.num_layers * shape_.num_kv_heads, kPageTokens);
  }

  int64_t KvPages() const {
    return shape_.num_layers * shape_.num_kv_heads * ((kPrompt + kPageTokens - 1) / kPageTokens);
  }
  int64_t StatePages() const {
    const uint64_t bytes = SparseStateBytes(shape_.num_layers, shape_.num_kv_heads, kPrompt);
    return static_cast<int64_t>((bytes + arena_->page_bytes() - 1) / arena_->page_bytes());
  }
  bool AllFree() const { return arena_->counters().free == arena_->num_pages(); }

  // Reserves the prompt's pages (and a state room when asked), fills the KV pages as a prefill
  // node would (small finite bf16 values), and answers with their per-layer checksums.
  int64_t MetaPages() const {
    return PageMetaRoomPages(shape_, kPageTokens, kPrompt, arena_->page_bytes());
  }
  transfer::KvPageGeometry Geo() const {
    return {shape_.num_layers, shape_.num_kv_heads, shape_.head_dim, kPageTokens};
  }

  // With `with_meta`, the side room starts with the page-metadata room, as Admit reserves it.
  void Reserve(bool with_state, bool with_meta = false) {
    meta_pages_ = with_meta ? MetaPages() : 0;
    absl::StatusOr<Reservation> all = admission_->Reserve(
        KvPages() + meta_pages_ + (with_state ? StatePages() : 0),
        absl::Now() + absl::Seconds(10), [] { return false; });
    ASSERT_TRUE(all.ok()) << all.status();
    kv_ = std::move(*all);
    absl::StatusOr<Reservation> room = kv_.SplitAfter(KvPages());
    ASSERT_TRUE(room.ok()) << room.status();
    room_ = std::move(*room);
    std::vector<int32_t> ids;
    for (const PageRun& r : kv_.runs()) {
      for (int32_t p = r.first; p < r.first + r.count; ++p) ids.push_back(p);
    }
    const size_t content = kv_shape_.page_bytes();
    for (int32_t id : ids) {
      auto* half = reinterpret_cast<uint16_t*>(arena_->page(id));
      for (size_t i = 0; i < content / 2; ++i) half[i] = 0x3c00 + (id * 7 + i) % 64;
    }
    const int64_t per_layer = static_cast<int64_t>(ids.size()) / shape_.num_layers;
    landed_.Clear();
    landed_.set_node_name("prefill-test");
    landed_.set_first_token_id(7);
    for (int64_t layer = 0; layer < shape_.num_layers; ++layer) {
      uint32_t crc = 0;
      for (int64_t i = layer * per_layer; i < (layer + 1) * per_layer; ++i) {
        crc = transfer::Crc32cExtend(crc, arena_->page(ids[i]), content);
      }
      landed_.add_layer_checksums(crc);
    }
    kv_page_ids_ = ids;
  }

  // Writes `bytes` at byte `offset` of the side room's stream of pages.
  void WriteRoom(uint64_t offset, const void* bytes, size_t n) {
    const auto* src = static_cast<const uint8_t*>(bytes);
    uint64_t at = 0;
    for (const PageRun& r : room_.runs()) {
      const uint64_t run_bytes = static_cast<uint64_t>(r.count) * arena_->page_bytes();
      for (uint64_t i = 0; i < run_bytes && n > 0; ++i) {
        if (at + i == offset) {
          *(arena_->page(r.first) + i) = *src++;
          ++offset;
          --n;
        }
      }
      at += run_bytes;
    }
    ASSERT_EQ(n, 0u) << "the room is too small";
  }

  // Writes `blob` into the state room as the prefill node would and describes it in landed_.
  void WriteState(const std::string& blob, uint64_t claimed_bytes, uint32_t checksum) {
    WriteRoom(static_cast<uint64_t>(meta_pages_) * arena_->page_bytes(), blob.data(), blob.size());
    landed_.mutable_sparse_state()->set_bytes_written(claimed_bytes);
    landed_.mutable_sparse_state()->set_checksum(checksum);
  }

  // The page metadata the prefill node computes from the KV pages as they are now.
  std::vector<uint8_t> EncodedMeta() const {
    const transfer::KvPageGeometry g = Geo();
    const int64_t per_layer = KvPages() / shape_.num_layers;
    std::vector<uint8_t> layer_pages(per_layer * g.content_bytes());
    const uint64_t block = transfer::PageMetaLayerBytes(g, kPrompt);
    std::vector<uint8_t> meta(transfer::PageMetaBytes(g, kPrompt));
    for (int64_t l = 0; l < shape_.num_layers; ++l) {
      for (int64_t i = 0; i < per_layer; ++i) {
        std::memcpy(layer_pages.data() + i * g.content_bytes(),
                    arena_->page(kv_page_ids_[l * per_layer + i]), g.content_bytes());
      }
      transfer::EncodeLayerPageMeta(g, kPrompt, layer_pages.data(), meta.data() + l * block);
    }
    return meta;
  }

  // Writes `meta` into the page-metadata room and describes it in landed_, with each block's
  // CRC-32C (as sent: a test that corrupts `meta` first ships a consistent checksum).
  void ShipMeta(const std::vector<uint8_t>& meta) {
    WriteRoom(0, meta.data(), meta.size());
    v1::PageMetaSummary* summary = landed_.mutable_page_meta();
    summary->Clear();
    summary->set_format_version(transfer::kPageMetaVersion);
    summary->set_bytes_written(meta.size());
    const uint64_t block = meta.size() / shape_.num_layers;
    for (int64_t l = 0; l < shape_.num_layers; ++l) {
      summary->add_layer_checksums(transfer::Crc32c(meta.data() + l * block, block));
    }
  }

  // The bounds of the landed pages as the decode node computes them itself.
  PageBounds Recomputed() const {
    absl::StatusOr<PageBounds> b = PagedKv::ComputeBounds(*arena_, kv_shape_, kv_page_ids_, kPrompt);
    EXPECT_TRUE(b.ok()) << b.status();
    return *std::move(b);
  }

  // Whether `attention`'s pages carry exactly `bounds`.
  static bool HasBounds(const SparseAttention& attention, const PageBounds& bounds) {
    const PagedKv& kv = attention.kv();
    const int64_t heads = kv.shape().num_kv_heads;
    for (size_t i = 0; i < bounds.min.size(); ++i) {
      const int layer = static_cast<int>(i / heads), head = static_cast<int>(i % heads);
      for (size_t j = 0; j < bounds.min[i].size(); ++j) {
        if (kv.key_min(layer, head)[j] != bounds.min[i][j] ||
            kv.key_max(layer, head)[j] != bounds.max[i][j]) {
          return false;
        }
      }
    }
    return true;
  }

  model::SparseState MatchingState() const {
    model::SparseState st;
    st.num_layers = shape_.num_layers;
    st.num_kv_heads = shape_.num_kv_heads;
    st.group = shape_.num_heads / shape_.num_kv_heads;
    st.tokens = kPrompt;
    st.tail_rows = 1;
    st.heads.resize(static_cast<size_t>(st.num_layers * st.num_kv_heads));
    for (model::HeadSparseState& h : st.heads) {
      h.vertical.assign(kPrompt, 1.0f / kPrompt);
      h.slash.assign(kPrompt, 1.0f / kPrompt);
    }
    return st;
  }

  absl::StatusOr<std::unique_ptr<SparseAttention>> Land(const std::string& policy_name,
                                                        bool* checksum_failed) {
    absl::StatusOr<sparse::PolicyConfig> policy = sparse::ParsePolicy(policy_name, 0.5);
    EXPECT_TRUE(policy.ok()) << policy.status();
    policy_ = *policy;
    LandingInput in;
    in.arena = arena_.get();
    in.shape = shape_;
    in.page_tokens = kPageTokens;
    in.prompt_tokens = kPrompt;
    in.landed = &landed_;
    in.policy = &policy_;
    in.needs_state = sparse::TraitsOf(policy_.kind).needs_sparse_state;
    in.meta_pages = meta_pages_;
    in.pool = pool_;
    return LandPrompt(in, std::move(kv_), std::move(room_), checksum_failed);
  }

  // A request over landed pages, as JoinBatch makes it; `eos_ids` end it unless ignore_eos (the
  // model's config.json ones when absent).
  std::shared_ptr<DecodeRequest> Request(const v1::GenerateRequest& request,
                                         std::optional<std::vector<int64_t>> eos_ids = {}) {
    bool checksum_failed = false;
    absl::StatusOr<std::unique_ptr<SparseAttention>> attention = Land("full", &checksum_failed);
    EXPECT_TRUE(attention.ok()) << attention.status();
    const model::ModelConfig& config = model_->config();
    absl::StatusOr<ValidatedGenerate> valid = ValidateGenerateRequest(
        request, GenerateLimits{config.vocab_size, config.max_position_embeddings, "full", 0});
    EXPECT_TRUE(valid.ok()) << valid.status();
    return NewDecodeRequest(request, *valid, eos_ids.value_or(config.eos_token_ids), 1,
                            std::move(*attention), kPrompt);
  }

  v1::GenerateRequest SomeGenerate(uint32_t max_tokens) const {
    v1::GenerateRequest r;
    r.set_request_id("r");
    for (int i = 0; i < kPrompt; ++i) r.add_prompt_token_ids(static_cast<uint32_t>(3 + i));
    r.mutable_sampling()->set_max_tokens(max_tokens);
    r.mutable_sampling()->set_ignore_eos(true);
    return r;
  }

  ScopedTestTempDir tmp_;
  std::unique_ptr<model::Model> model_;
  model::AttentionShape shape_;
  KvShape kv_shape_;
  std::unique_ptr<KvArena> arena_;
  std::unique_ptr<KvAdmission> admission_;
  std::unique_ptr<BatchScheduler> scheduler_;
  Reservation kv_;
  Reservation room_;
  std::vector<int32_t> kv_page_ids_;
  v1::PrefillResponse landed_;
  sparse::PolicyConfig policy_;
  int64_t meta_pages_ = 0;
  const kernels::cpu::CpuPool* pool_ = nullptr;
};

TEST_F(GenerateCallStepsTest, PrefillRequestDescribesThePagesAndTheStateRoom) {
  Reserve(/*with_state=*/true);
  transfer::PeerDescriptor arena;
  arena.base_address = 4096;
  arena.length = arena_->bytes();
  arena.remote_key = "arena-wide key";
  v1::ModelLayout layout;
  layout.set_page_tokens(kPageTokens);
  PrefillTarget target{&arena, arena_->page_bytes(), &kv_, &room_, true, 3, &layout};
  v1::GenerateRequest generate = SomeGenerate(4);
  model::SamplingParams sampling;
  sampling.seed = 99;
  const v1::PrefillRequest p = BuildPrefillRequest("r#abc.1", generate, sampling, target);
  EXPECT_EQ(p.request_id(), "r#abc.1");
  EXPECT_EQ(p.prompt_token_ids_size(), kPrompt);
  EXPECT_EQ(p.sampling().seed(), 99u);  // the client gave none: both nodes draw from one stream
  EXPECT_TRUE(p.kv_target().remote_key().empty());  // never the arena-wide key
  int64_t pages = 0;
  for (const v1::PageExtent& e : p.kv_target().extents()) pages += e.count();
  EXPECT_EQ(pages, KvPages());
  EXPECT_EQ(p.kv_target().pages_per_head(), 3u);
  EXPECT_EQ(p.kv_target().checksum_algorithm(), v1::CHECKSUM_ALGORITHM_CRC32C);
  uint64_t room = 0;
  for (const v1::ByteExtent& e : p.sparse_target().extents()) room += e.length();
  EXPECT_EQ(room, static_cast<uint64_t>(StatePages()) * arena_->page_bytes());
  EXPECT_EQ(p.layout().page_tokens(), static_cast<uint32_t>(kPageTokens));
}

TEST_F(GenerateCallStepsTest, VerifiedPagesAreAdoptedByTheAttention) {
  Reserve(/*with_state=*/false);
  bool checksum_failed = true;
  absl::StatusOr<std::unique_ptr<SparseAttention>> attention = Land("full", &checksum_failed);
  ASSERT_TRUE(attention.ok()) << attention.status();
  EXPECT_FALSE(checksum_failed);
  EXPECT_EQ(arena_->counters().free, arena_->num_pages() - KvPages());  // the request holds them
  attention->reset();
  EXPECT_TRUE(AllFree());
}

TEST_F(GenerateCallStepsTest, ALayerWithAWrongChecksumIsDataLossAndFreesEverything) {
  Reserve(/*with_state=*/true);
  const int64_t per_layer = KvPages() / shape_.num_layers;
  arena_->page(kv_page_ids_[2 * per_layer + 1])[5] ^= 1;  // one bit of layer 2
  bool checksum_failed = false;
  absl::StatusOr<std::unique_ptr<SparseAttention>> attention = Land("fluxion", &checksum_failed);
  EXPECT_EQ(attention.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(attention.status().message().find("layer 2"), std::string::npos)
      << attention.status();
  EXPECT_NE(attention.status().message().find("prefill-test"), std::string::npos);
  EXPECT_TRUE(checksum_failed);
  EXPECT_TRUE(AllFree());  // the KV pages and the state room
}

TEST_F(GenerateCallStepsTest, MissingLayerChecksumsAreDataLossButNoChecksumFailure) {
  Reserve(/*with_state=*/false);
  landed_.mutable_layer_checksums()->RemoveLast();
  bool checksum_failed = true;
  absl::StatusOr<std::unique_ptr<SparseAttention>> attention = Land("full", &checksum_failed);
  EXPECT_EQ(attention.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(attention.status().message().find("layer checksums"), std::string::npos);
  EXPECT_FALSE(checksum_failed);
  EXPECT_TRUE(AllFree());
}

TEST_F(GenerateCallStepsTest, AStateLargerThanItsRoomIsRefusedBeforeReadingPastIt) {
  Reserve(/*with_state=*/true);
  const std::string blob = MatchingState().Serialize();
  WriteState(blob, static_cast<uint64_t>(StatePages()) * arena_->page_bytes() + 1,
             transfer::Crc32c(blob.data(), blob.size()));
  bool checksum_failed = true;
  absl::StatusOr<std::unique_ptr<SparseAttention>> attention = Land("lfps", &checksum_failed);
  EXPECT_EQ(attention.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(attention.status().message().find("does not fit"), std::string::npos);
  EXPECT_FALSE(checksum_failed);
  EXPECT_TRUE(AllFree());
}

TEST_F(GenerateCallStepsTest, AStateWithAWrongChecksumIsACountedChecksumFailure) {
  Reserve(/*with_state=*/true);
  const std::string blob = MatchingState().Serialize();
  WriteState(blob, blob.size(), transfer::Crc32c(blob.data(), blob.size()) ^ 1);
  bool checksum_failed = false;
  absl::StatusOr<std::unique_ptr<SparseAttention>> attention = Land("lfps", &checksum_failed);
  EXPECT_EQ(attention.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(checksum_failed);
  EXPECT_TRUE(AllFree());
}

TEST_F(GenerateCallStepsTest, AStateOfAnotherShapeIsRefused) {
  Reserve(/*with_state=*/true);
  model::SparseState other = MatchingState();
  other.tokens = kPrompt - 1;  // another prompt's
  for (model::HeadSparseState& h : other.heads) {
    h.vertical.resize(kPrompt - 1);
    h.slash.resize(kPrompt - 1);
  }
  const std::string blob = other.Serialize();
  WriteState(blob, blob.size(), transfer::Crc32c(blob.data(), blob.size()));
  bool checksum_failed = true;
  absl::StatusOr<std::unique_ptr<SparseAttention>> attention = Land("lfps", &checksum_failed);
  EXPECT_EQ(attention.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(attention.status().message().find("sparse state: "), std::string::npos)
      << attention.status();
  EXPECT_FALSE(checksum_failed);
  EXPECT_TRUE(AllFree());
}

TEST_F(GenerateCallStepsTest, AMatchingStateIsLoadedAndItsRoomGoesBackAtOnce) {
  Reserve(/*with_state=*/true);
  const std::string blob = MatchingState().Serialize();
  ASSERT_EQ(blob.size(), SparseStateBytes(shape_.num_layers, shape_.num_kv_heads, kPrompt));
  WriteState(blob, blob.size(), transfer::Crc32c(blob.data(), blob.size()));
  bool checksum_failed = true;
  absl::StatusOr<std::unique_ptr<SparseAttention>> attention = Land("lfps", &checksum_failed);
  ASSERT_TRUE(attention.ok()) << attention.status();
  EXPECT_FALSE(checksum_failed);
  EXPECT_EQ(arena_->counters().free, arena_->num_pages() - KvPages());  // the room is back
}

TEST_F(GenerateCallStepsTest, PrefillRequestAsksForPageMetadataInTheRoomsFirstPages) {
  Reserve(/*with_state=*/true, /*with_meta=*/true);
  transfer::PeerDescriptor arena;
  arena.base_address = 4096;
  arena.length = arena_->bytes();
  v1::ModelLayout layout;
  layout.set_page_tokens(kPageTokens);
  PrefillTarget target{&arena, arena_->page_bytes(), &kv_, &room_, true, 3, &layout, MetaPages()};
  const v1::PrefillRequest p = BuildPrefillRequest("r#abc.1", SomeGenerate(4), {}, target);
  ASSERT_TRUE(p.has_page_meta_target());
  EXPECT_EQ(p.page_meta_target().format_version(), transfer::kPageMetaVersion);
  const uint64_t page_bytes = arena_->page_bytes();
  const uint64_t room_start = static_cast<uint64_t>(room_.runs()[0].first) * page_bytes;
  uint64_t meta_room = 0, state_room = 0;
  for (const v1::ByteExtent& e : p.page_meta_target().extents()) meta_room += e.length();
  for (const v1::ByteExtent& e : p.sparse_target().extents()) state_room += e.length();
  EXPECT_EQ(meta_room, MetaPages() * page_bytes);
  EXPECT_GE(meta_room, transfer::PageMetaBytes(Geo(), kPrompt));
  EXPECT_EQ(state_room, StatePages() * page_bytes);
  EXPECT_EQ(p.page_meta_target().extents(0).offset(), room_start);  // the room's first pages
  EXPECT_EQ(p.sparse_target().extents(0).offset(), room_start + meta_room);  // then the state
  target.meta_pages = 0;  // a decode node that reserves no metadata room asks for none
  EXPECT_FALSE(BuildPrefillRequest("r#abc.2", SomeGenerate(4), {}, target).has_page_meta_target());
}

TEST_F(GenerateCallStepsTest, ShippedPageMetadataIsAdoptedAndEqualsTheRecomputedOne) {
  const kernels::cpu::CpuPool two(2);
  for (const kernels::cpu::CpuPool* pool : {static_cast<const kernels::cpu::CpuPool*>(nullptr), &two}) {
    SCOPED_TRACE(pool == nullptr ? "serial" : "on a 2-thread pool");
    pool_ = pool;
    Reserve(/*with_state=*/true, /*with_meta=*/true);
    ShipMeta(EncodedMeta());
    const std::string blob = MatchingState().Serialize();
    WriteState(blob, blob.size(), transfer::Crc32c(blob.data(), blob.size()));
    const PageBounds recomputed = Recomputed();
    bool checksum_failed = true;
    absl::StatusOr<std::unique_ptr<SparseAttention>> attention = Land("lfps", &checksum_failed);
    ASSERT_TRUE(attention.ok()) << attention.status();
    EXPECT_FALSE(checksum_failed);
    EXPECT_TRUE(HasBounds(**attention, recomputed));
    EXPECT_EQ(arena_->counters().free, arena_->num_pages() - KvPages());  // both rooms are back
    attention->reset();
    EXPECT_TRUE(AllFree());
  }
}

// The shipped metadata is what the pages adopt, not a recomputation: wider (still valid) bounds
// with a consistent checksum come through as sent.
TEST_F(GenerateCallStepsTest, TheShippedMetadataIsUsedAsSent) {
  Reserve(/*with_state=*/false, /*with_meta=*/true);
  std::vector<uint8_t> meta = EncodedMeta();
  const bf16 minus_eight = FloatToBf16(-8.0f);  // below every key of the fixture (about 1)
  std::memcpy(meta.data(), &minus_eight, 2);      // layer 0, head 0, page 0, key_min[0]
  ShipMeta(meta);
  PageBounds expected = Recomputed();
  expected.min[0][0] = -8.0f;
  bool checksum_failed = true;
  absl::StatusOr<std::unique_ptr<SparseAttention>> attention = Land("quest", &checksum_failed);
  ASSERT_TRUE(attention.ok()) << attention.status();
  EXPECT_TRUE(HasBounds(**attention, expected));
}

TEST_F(GenerateCallStepsTest, AnOlderPrefillNodeThatSendsNoMetadataStillLands) {
  Reserve(/*with_state=*/false, /*with_meta=*/true);  // room reserved, nothing written there
  bool checksum_failed = true;
  absl::StatusOr<std::unique_ptr<SparseAttention>> attention = Land("quest", &checksum_failed);
  ASSERT_TRUE(attention.ok()) << attention.status();
  EXPECT_FALSE(checksum_failed);
  EXPECT_TRUE(HasBounds(**attention, Recomputed()));  // computed from the pages
  attention->reset();
  EXPECT_TRUE(AllFree());
}

TEST_F(GenerateCallStepsTest, CorruptedPageMetadataIsACountedChecksumFailure) {
  Reserve(/*with_state=*/false, /*with_meta=*/true);
  const std::vector<uint8_t> meta = EncodedMeta();
  ShipMeta(meta);
  const uint64_t block = meta.size() / shape_.num_layers;
  std::vector<uint8_t> flipped = meta;
  flipped[block + 9] ^= 1;  // one bit of layer 1's block, after its checksum was taken
  WriteRoom(0, flipped.data(), flipped.size());
  bool checksum_failed = false;
  absl::StatusOr<std::unique_ptr<SparseAttention>> attention = Land("quest", &checksum_failed);
  EXPECT_EQ(attention.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(attention.status().message().find("page metadata of layer 1"), std::string::npos)
      << attention.status();
  EXPECT_TRUE(checksum_failed);
  EXPECT_TRUE(AllFree());
}

TEST_F(GenerateCallStepsTest, ShortOrMiscountedPageMetadataIsRefusedBeforeReadingIt) {
  const std::vector<std::pair<std::string, std::function<void(v1::PageMetaSummary*)>>> cases = {
      {"claims", [](v1::PageMetaSummary* m) { m->set_bytes_written(m->bytes_written() - 4); }},
      {"claims", [](v1::PageMetaSummary* m) { m->set_bytes_written(uint64_t{1} << 40); }},
      {"layer checksums", [](v1::PageMetaSummary* m) { m->mutable_layer_checksums()->RemoveLast(); }},
      {"format", [](v1::PageMetaSummary* m) { m->set_format_version(2); }},
  };
  for (const auto& [message, damage] : cases) {
    Reserve(/*with_state=*/false, /*with_meta=*/true);
    ShipMeta(EncodedMeta());
    damage(landed_.mutable_page_meta());
    bool checksum_failed = true;
    absl::StatusOr<std::unique_ptr<SparseAttention>> attention = Land("quest", &checksum_failed);
    EXPECT_EQ(attention.status().code(), absl::StatusCode::kDataLoss) << message;
    EXPECT_NE(attention.status().message().find(message), std::string::npos)
        << attention.status();
    EXPECT_FALSE(checksum_failed);
    EXPECT_TRUE(AllFree());
  }
}

TEST_F(GenerateCallStepsTest, NonFiniteOrInvertedShippedBoundsAreRefused) {
  for (const float bad : {NAN, INFINITY, 100.0f /* a min above its max */}) {
    Reserve(/*with_state=*/false, /*with_meta=*/true);
    std::vector<uint8_t> meta = EncodedMeta();
    const bf16 v = FloatToBf16(bad);
    std::memcpy(meta.data() + meta.size() - 4 * shape_.head_dim + 2 * 3, &v, 2);  // last record
    ShipMeta(meta);  // with a matching checksum: a buggy peer, not a torn write
    bool checksum_failed = true;
    absl::StatusOr<std::unique_ptr<SparseAttention>> attention = Land("quest", &checksum_failed);
    EXPECT_EQ(attention.status().code(), absl::StatusCode::kDataLoss) << bad;
    EXPECT_NE(attention.status().message().find("not finite or out of order"), std::string::npos)
        << attention.status();
    EXPECT_FALSE(checksum_failed);
    EXPECT_TRUE(AllFree());
  }
}

TEST_F(GenerateCallStepsTest, AKvChecksumFailureIsFoundOnThePoolToo) {
  const kernels::cpu::CpuPool two(2);
  pool_ = &two;
  Reserve(/*with_state=*/false, /*with_meta=*/true);
  ShipMeta(EncodedMeta());
  const int64_t per_layer = KvPages() / shape_.num_layers;
  const int64_t last = shape_.num_layers - 1;
  arena_->page(kv_page_ids_[last * per_layer])[3] ^= 4;
  bool checksum_failed = false;
  absl::StatusOr<std::unique_ptr<SparseAttention>> attention = Land("quest", &checksum_failed);
  EXPECT_EQ(attention.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(attention.status().message().find(absl::StrCat("KV of layer ", last)),
            std::string::npos)
      << attention.status();
  EXPECT_TRUE(checksum_failed);
  EXPECT_TRUE(AllFree());
}

TEST_F(GenerateCallStepsTest, AFirstTokenThatEndsTheRequestNeverJoinsAndFreesItsPages) {
  Reserve(/*with_state=*/false);
  std::shared_ptr<DecodeRequest> r = Request(SomeGenerate(/*max_tokens=*/1));
  EXPECT_EQ(StartDecoding(r, 7, std::nullopt, scheduler_.get()), Finish::kLength);
  EXPECT_EQ(scheduler_->running(), 0);
  absl::MutexLock lock(&r->mu);
  EXPECT_EQ(r->finish, Finish::kLength);
  EXPECT_EQ(r->pending, std::vector<int32_t>{7});
  EXPECT_TRUE(AllFree());  // published after the pages were back
}

TEST_F(GenerateCallStepsTest, AFirstTokenThatIsAStopIdEndsWithStop) {
  Reserve(/*with_state=*/false);
  v1::GenerateRequest generate = SomeGenerate(/*max_tokens=*/10);
  generate.mutable_sampling()->add_stop_token_ids(7);
  std::shared_ptr<DecodeRequest> r = Request(generate);
  EXPECT_EQ(StartDecoding(r, 7, std::nullopt, scheduler_.get()), Finish::kStop);
  absl::MutexLock lock(&r->mu);
  EXPECT_EQ(r->matched_stop, std::optional<int32_t>(7));
  EXPECT_TRUE(AllFree());
}

// generation_config.json's EOS ids (DecodeServiceOptions::extra_eos_token_ids, merged by the
// service) end a request like config.json's, unless it asks ignore_eos.
TEST_F(GenerateCallStepsTest, AnEosIdOfTheNodeEndsWithStopUnlessIgnoreEos) {
  Reserve(/*with_state=*/false);
  v1::GenerateRequest generate = SomeGenerate(/*max_tokens=*/10);
  generate.mutable_sampling()->set_ignore_eos(false);
  std::shared_ptr<DecodeRequest> r = Request(generate, std::vector<int64_t>{9, 7});
  EXPECT_EQ(StartDecoding(r, 7, std::nullopt, scheduler_.get()), Finish::kStop);
  {
    absl::MutexLock lock(&r->mu);
    EXPECT_EQ(r->matched_stop, std::optional<int32_t>(7));
  }
  EXPECT_TRUE(AllFree());
  Reserve(/*with_state=*/false);
  std::shared_ptr<DecodeRequest> ignoring = Request(SomeGenerate(10), std::vector<int64_t>{7});
  EXPECT_TRUE(ignoring->stop_ids.empty());
  EndRequest(*ignoring, Finish::kAbort, absl::OkStatus());
}

TEST_F(GenerateCallStepsTest, OtherwiseTheRequestJoinsTheBatchAndDecodesToItsLength) {
  Reserve(/*with_state=*/false);
  std::shared_ptr<DecodeRequest> r = Request(SomeGenerate(/*max_tokens=*/3));
  EXPECT_EQ(StartDecoding(r, 7, std::nullopt, scheduler_.get()), Finish::kNone);
  absl::MutexLock lock(&r->mu);
  auto done = [&r]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu) { return r->finish != Finish::kNone; };
  ASSERT_TRUE(r->mu.AwaitWithTimeout(absl::Condition(&done), absl::Seconds(120)));
  EXPECT_EQ(r->finish, Finish::kLength);
  EXPECT_EQ(r->pending.size(), 3u);
  EXPECT_EQ(r->pending[0], 7);
  EXPECT_TRUE(AllFree());
}

// A prefill node's answer is a peer's bytes: its tokens and logprobs are checked against what the
// request asked for before anything uses them.
TEST(CheckPrefillTokensTest, TheAnswersTokensAndLogprobsMustMatchTheRequest) {
  constexpr int64_t kVocab = 100, kPrompt = 3;
  v1::SamplingParams asked;
  v1::PrefillResponse landed;
  landed.set_first_token_id(7);
  absl::StatusOr<PrefillTokens> t = CheckPrefillTokens(landed, asked, kPrompt, kVocab);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->first_token, 7);
  EXPECT_FALSE(t->first_logprobs.has_value());

  landed.set_first_token_id(kVocab);
  EXPECT_EQ(CheckPrefillTokens(landed, asked, kPrompt, kVocab).status().code(),
            absl::StatusCode::kDataLoss);
  landed.set_first_token_id(7);

  // logprobs 2: the first token's entry with exactly two alternatives inside the vocabulary.
  asked.set_logprobs(2);
  EXPECT_EQ(CheckPrefillTokens(landed, asked, kPrompt, kVocab).status().code(),
            absl::StatusCode::kDataLoss);  // none sent
  v1::TokenLogprobs* first = landed.mutable_first_token_logprobs();
  first->set_logprob(-0.5f);
  first->add_top_token_ids(7);
  first->add_top_logprobs(-0.5f);
  EXPECT_FALSE(CheckPrefillTokens(landed, asked, kPrompt, kVocab).ok());  // one of two
  first->add_top_token_ids(kVocab + 5);
  first->add_top_logprobs(-1.5f);
  EXPECT_FALSE(CheckPrefillTokens(landed, asked, kPrompt, kVocab).ok());  // outside
  first->set_top_token_ids(1, 9);
  t = CheckPrefillTokens(landed, asked, kPrompt, kVocab);
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_TRUE(t->first_logprobs.has_value());
  EXPECT_EQ(t->first_logprobs->token, 7);
  EXPECT_EQ(t->first_logprobs->top_ids, (std::vector<int32_t>{7, 9}));

  // prompt_logprobs 0: one entry per prompt token after the first, none unasked.
  v1::TokenLogprobs* extra = landed.add_prompt_logprobs();
  EXPECT_FALSE(CheckPrefillTokens(landed, asked, kPrompt, kVocab).ok());  // not asked for
  asked.set_prompt_logprobs(0);
  EXPECT_FALSE(CheckPrefillTokens(landed, asked, kPrompt, kVocab).ok());  // 1 of 2
  landed.add_prompt_logprobs();
  EXPECT_TRUE(CheckPrefillTokens(landed, asked, kPrompt, kVocab).ok());
  extra->add_top_token_ids(1);
  extra->add_top_logprobs(-1);
  EXPECT_FALSE(CheckPrefillTokens(landed, asked, kPrompt, kVocab).ok());  // 1 alternative of 0
  asked.clear_logprobs();
  landed.clear_prompt_logprobs();
  asked.clear_prompt_logprobs();
  EXPECT_FALSE(CheckPrefillTokens(landed, asked, kPrompt, kVocab).ok());  // logprobs unasked
}

}  // namespace
}  // namespace fluxion::decode

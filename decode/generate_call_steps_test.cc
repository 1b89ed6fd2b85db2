// The phases of a Generate call that run without the service (decode/generate_call_steps.h): the
// Prefill request a reservation becomes, every ending of landing a prompt (what is refused, what
// is counted as a checksum failure, that the pages always come back), and joining the batch
// (a first token that already ends the request never joins). No gRPC, no transport, no peer.
#include "decode/generate_call_steps.h"

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/test_temp_dir.h"
#include "gtest/gtest.h"
#include "model/random_model.h"
#include "model/sparse_state.h"
#include "transfer/crc32c.h"

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
  void Reserve(bool with_state) {
    absl::StatusOr<Reservation> all = admission_->Reserve(
        KvPages() + (with_state ? StatePages() : 0), absl::Now() + absl::Seconds(10),
        [] { return false; });
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

  // Writes `blob` into the state room as the prefill node would and describes it in landed_.
  void WriteState(const std::string& blob, uint64_t claimed_bytes, uint32_t checksum) {
    size_t at = 0;
    for (const PageRun& r : room_.runs()) {
      const size_t room_bytes = static_cast<size_t>(r.count) * arena_->page_bytes();
      const size_t len = std::min(room_bytes, blob.size() - at);
      std::memcpy(arena_->page(r.first), blob.data() + at, len);
      at += len;
      if (at == blob.size()) break;
    }
    landed_.mutable_sparse_state()->set_bytes_written(claimed_bytes);
    landed_.mutable_sparse_state()->set_checksum(checksum);
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
    return LandPrompt(in, std::move(kv_), std::move(room_), checksum_failed);
  }

  // A request over landed pages, as JoinBatch makes it.
  std::shared_ptr<DecodeRequest> Request(const v1::GenerateRequest& request) {
    bool checksum_failed = false;
    absl::StatusOr<std::unique_ptr<SparseAttention>> attention = Land("full", &checksum_failed);
    EXPECT_TRUE(attention.ok()) << attention.status();
    const model::ModelConfig& config = model_->config();
    absl::StatusOr<ValidatedGenerate> valid = ValidateGenerateRequest(
        request, GenerateLimits{config.vocab_size, config.max_position_embeddings, "full", 0});
    EXPECT_TRUE(valid.ok()) << valid.status();
    return NewDecodeRequest(request, *valid, config, 1, std::move(*attention), kPrompt);
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

TEST_F(GenerateCallStepsTest, AFirstTokenThatEndsTheRequestNeverJoinsAndFreesItsPages) {
  Reserve(/*with_state=*/false);
  std::shared_ptr<DecodeRequest> r = Request(SomeGenerate(/*max_tokens=*/1));
  EXPECT_EQ(StartDecoding(r, 7, scheduler_.get()), Finish::kLength);
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
  EXPECT_EQ(StartDecoding(r, 7, scheduler_.get()), Finish::kStop);
  absl::MutexLock lock(&r->mu);
  EXPECT_EQ(r->matched_stop, std::optional<int32_t>(7));
  EXPECT_TRUE(AllFree());
}

TEST_F(GenerateCallStepsTest, OtherwiseTheRequestJoinsTheBatchAndDecodesToItsLength) {
  Reserve(/*with_state=*/false);
  std::shared_ptr<DecodeRequest> r = Request(SomeGenerate(/*max_tokens=*/3));
  EXPECT_EQ(StartDecoding(r, 7, scheduler_.get()), Finish::kNone);
  absl::MutexLock lock(&r->mu);
  auto done = [&r]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu) { return r->finish != Finish::kNone; };
  ASSERT_TRUE(r->mu.AwaitWithTimeout(absl::Condition(&done), absl::Seconds(120)));
  EXPECT_EQ(r->finish, Finish::kLength);
  EXPECT_EQ(r->pending.size(), 3u);
  EXPECT_EQ(r->pending[0], 7);
  EXPECT_TRUE(AllFree());
}

}  // namespace
}  // namespace fluxion::decode

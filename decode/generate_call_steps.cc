#include "decode/generate_call_steps.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "decode/paged_kv.h"
#include "model/sparse_state.h"
#include "transfer/crc32c.h"

namespace fluxion::decode {
namespace {

namespace v1 = ::fluxion::v1;

std::vector<int32_t> PageIds(const std::vector<PageRun>& runs) {
  std::vector<int32_t> ids;
  ids.reserve(CountPages(runs));
  for (const PageRun& r : runs) {
    for (int32_t p = r.first; p < r.first + r.count; ++p) ids.push_back(p);
  }
  return ids;
}

// DATA_LOSS unless every layer's pages hash to the checksum the prefill node sent for it.
absl::Status CheckLayerChecksums(const LandingInput& in, const std::vector<int32_t>& page_ids,
                                 bool* checksum_failed) {
  const v1::PrefillResponse& landed = *in.landed;
  const int64_t layers = in.shape.num_layers;
  if (landed.layer_checksums_size() != layers) {
    return absl::DataLossError(absl::StrCat("prefill node ", landed.node_name(), " sent ",
                                            landed.layer_checksums_size(),
                                            " layer checksums for ", layers, " layers"));
  }
  // Only the K/V bytes are hashed: a page may be larger than its content (the arena's page size).
  const size_t content =
      KvShape{layers, in.shape.num_kv_heads, in.shape.head_dim, in.page_tokens}.page_bytes();
  const int64_t per_layer = static_cast<int64_t>(page_ids.size()) / layers;
  for (int64_t layer = 0; layer < layers; ++layer) {
    uint32_t crc = 0;
    for (int64_t i = layer * per_layer; i < (layer + 1) * per_layer; ++i) {
      crc = transfer::Crc32cExtend(crc, in.arena->page(page_ids[i]), content);
    }
    if (crc != landed.layer_checksums(layer)) {
      *checksum_failed = true;
      return absl::DataLossError(absl::StrFormat(
          "KV of layer %d landed with CRC-32C %08x but prefill node %s sent %08x; the request "
          "was not decoded (retry it)",
          layer, crc, landed.node_name(), static_cast<uint32_t>(landed.layer_checksums(layer))));
    }
  }
  return absl::OkStatus();
}

// The sparse state read out of its room, checked against its checksum and this model and prompt.
absl::StatusOr<model::SparseState> ReadSparseState(const LandingInput& in,
                                                   const Reservation& room,
                                                   bool* checksum_failed) {
  const v1::PrefillResponse& landed = *in.landed;
  const uint64_t written = landed.sparse_state().bytes_written();
  const uint64_t page_bytes = in.arena->page_bytes();
  std::string blob;
  for (const PageRun& r : room.runs()) {
    if (blob.size() >= written) break;
    const uint64_t len =
        std::min<uint64_t>(written - blob.size(), static_cast<uint64_t>(r.count) * page_bytes);
    blob.append(reinterpret_cast<const char*>(in.arena->page(r.first)), len);
  }
  if (blob.size() != written) {
    return absl::DataLossError(
        absl::StrCat("sparse state of ", written, " bytes does not fit the reserved room"));
  }
  if (transfer::Crc32c(blob.data(), blob.size()) != landed.sparse_state().checksum()) {
    *checksum_failed = true;
    return absl::DataLossError("sparse state landed with a wrong CRC-32C; retry the request");
  }
  absl::StatusOr<model::SparseState> parsed = model::SparseState::Parse(blob);
  // Parse checks the state against its own header only; the policy indexes it by this model's
  // shape, so a state for another shape or prompt length must not get through.
  absl::Status matches = parsed.ok() ? parsed->CheckMatches(in.shape, in.prompt_tokens)
                                     : parsed.status();
  if (!matches.ok()) {
    return absl::DataLossError(absl::StrCat("sparse state: ", matches.message()));
  }
  return std::move(*parsed);
}

}  // namespace

uint64_t SparseStateBytes(int64_t layers, int64_t heads, int64_t tokens) {
  return 72 + static_cast<uint64_t>(layers * heads) * (20 + 8 * static_cast<uint64_t>(tokens));
}

v1::PrefillRequest BuildPrefillRequest(const std::string& prefill_id,
                                       const v1::GenerateRequest& request,
                                       const model::SamplingParams& sampling,
                                       const PrefillTarget& target) {
  const transfer::PeerDescriptor& arena = *target.arena;
  v1::PrefillRequest prefill;
  prefill.set_request_id(prefill_id);
  *prefill.mutable_prompt_token_ids() = request.prompt_token_ids();
  *prefill.mutable_sampling() = request.sampling();
  if (!request.sampling().has_seed()) prefill.mutable_sampling()->set_seed(sampling.seed);
  v1::KvTarget* kv = prefill.mutable_kv_target();
  kv->set_transport(arena.transport);
  kv->set_peer_name(arena.peer_name);
  kv->set_worker_address(arena.worker_address);
  // No arena-wide key: one key per registered run of this reservation (KvTarget.ranges).
  for (const Reservation* held : {target.kv_pages, target.state_room}) {
    for (const transfer::PeerDescriptor& d : held->ranges()) {
      v1::RemoteRange* range = kv->add_ranges();
      range->set_base_address(d.base_address);
      range->set_length(d.length);
      range->set_remote_key(d.remote_key);
    }
  }
  kv->set_arena_base_address(arena.base_address);
  kv->set_arena_bytes(arena.length);
  kv->set_page_bytes(target.page_bytes);
  for (const PageRun& r : target.kv_pages->runs()) {
    v1::PageExtent* e = kv->add_extents();
    e->set_first_page_id(r.first);
    e->set_count(r.count);
  }
  kv->set_page_order(v1::PAGE_ORDER_LAYER_HEAD_PAGE);
  kv->set_pages_per_head(static_cast<uint32_t>(target.pages_per_head));
  kv->set_checksum_algorithm(v1::CHECKSUM_ALGORITHM_CRC32C);
  if (target.needs_state) {
    v1::SparseStateTarget* st = prefill.mutable_sparse_target();
    st->set_format_version(model::kSparseStateVersion);
    st->set_base_address(arena.base_address);
    for (const PageRun& r : target.state_room->runs()) {
      v1::ByteExtent* e = st->add_extents();
      e->set_offset(static_cast<uint64_t>(r.first) * target.page_bytes);
      e->set_length(static_cast<uint64_t>(r.count) * target.page_bytes);
    }
    st->set_observation_window_tokens(32);
    st->set_score_block_tokens(1);
  }
  *prefill.mutable_layout() = *target.layout;
  prefill.set_protocol_version(1);
  return prefill;
}

absl::StatusOr<std::unique_ptr<SparseAttention>> LandPrompt(const LandingInput& in,
                                                            Reservation kv_pages,
                                                            Reservation state_room,
                                                            bool* checksum_failed) {
  *checksum_failed = false;
  const std::vector<int32_t> page_ids = PageIds(kv_pages.runs());
  if (absl::Status s = CheckLayerChecksums(in, page_ids, checksum_failed); !s.ok()) return s;
  model::SparseState state;
  if (in.needs_state) {
    absl::StatusOr<model::SparseState> read = ReadSparseState(in, state_room, checksum_failed);
    if (!read.ok()) return read.status();  // both reservations die here: pages freed
    state = std::move(*read);
  }
  state_room.Release();  // parsed; the room is no longer needed
  const KvShape kv_shape{in.shape.num_layers, in.shape.num_kv_heads, in.shape.head_dim,
                         in.page_tokens};
  absl::StatusOr<std::unique_ptr<PagedKv>> paged =
      PagedKv::Adopt(std::move(kv_pages), kv_shape, page_ids, in.prompt_tokens);  // owns them
  if (!paged.ok()) {
    return absl::InternalError(absl::StrCat("adopting pages: ", paged.status().message()));
  }
  absl::StatusOr<std::unique_ptr<SparseAttention>> attention = SparseAttention::FromPages(
      std::move(*paged), in.shape, *in.policy, in.needs_state ? &state : nullptr);
  if (!attention.ok()) {
    return absl::InternalError(absl::StrCat("policy setup: ", attention.status().message()));
  }
  return std::move(*attention);
}

std::shared_ptr<DecodeRequest> NewDecodeRequest(const v1::GenerateRequest& request,
                                                const ValidatedGenerate& valid,
                                                const model::ModelConfig& config,
                                                uint64_t admission_seq,
                                                std::unique_ptr<SparseAttention> attention,
                                                int64_t prompt_tokens) {
  auto r = std::make_shared<DecodeRequest>();
  r->id = request.request_id();
  r->admission_seq = admission_seq;
  r->attention = attention.get();
  r->seq = std::make_unique<model::Sequence>(std::move(attention), prompt_tokens);
  r->sampler.emplace(valid.sampling);
  // Draw 0 of the request's stream sampled the first token on the prefill node; the next token is
  // draw 1 (PROTOCOL.md), so a seeded request gives the tokens of single-process generation.
  (void)r->sampler->Sample(std::vector<float>{0.0f});
  const v1::SamplingParams& sp = request.sampling();
  r->stop_ids.assign(sp.stop_token_ids().begin(), sp.stop_token_ids().end());
  if (!sp.ignore_eos()) {
    for (int64_t eos : config.eos_token_ids) r->stop_ids.push_back(static_cast<int32_t>(eos));
  }
  r->max_tokens = valid.max_tokens;
  r->context_limit = config.max_position_embeddings;
  return r;
}

Finish StartDecoding(const std::shared_ptr<DecodeRequest>& r, int32_t first_token,
                     BatchScheduler* scheduler) {
  const Finish first = AcceptToken(*r, first_token);
  if (first != Finish::kNone) {
    EndRequest(*r, first, absl::OkStatus());  // its reservations wake the admission's waiters
  } else {
    scheduler->Join(r);
  }
  return first;
}

}  // namespace fluxion::decode

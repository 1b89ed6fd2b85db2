#include "decode/serving/generate_call_steps.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "decode/kv/paged_kv.h"
#include "model/sparse_state.h"
#include "transfer/crc32c.h"
#include "transfer/page_meta.h"

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

transfer::KvPageGeometry GeometryOf(const model::AttentionShape& shape, int64_t page_tokens) {
  return {shape.num_layers, shape.num_kv_heads, shape.head_dim, page_tokens};
}

// Copies `len` bytes from byte `offset` of the stream the pages of `runs` form, in order, to
// `dst`. False (nothing promised about dst) when the runs hold fewer bytes.
bool CopyFromRoom(const KvArena& arena, const std::vector<PageRun>& runs, uint64_t offset,
                  uint64_t len, uint8_t* dst) {
  const uint64_t page_bytes = arena.page_bytes();
  uint64_t at = 0;  // stream offset of the current run
  for (const PageRun& r : runs) {
    if (len == 0) break;
    const uint64_t run_bytes = static_cast<uint64_t>(r.count) * page_bytes;
    if (offset < at + run_bytes) {
      const uint64_t skip = offset - at;
      const uint64_t n = std::min(len, run_bytes - skip);
      std::memcpy(dst, arena.page(r.first) + skip, n);
      dst += n;
      offset += n;
      len -= n;
    }
    at += run_bytes;
  }
  return len == 0;
}

// DATA_LOSS unless the prefill node sent one KV checksum per layer.
absl::Status CheckLayerChecksumCount(const LandingInput& in) {
  const v1::PrefillResponse& landed = *in.landed;
  if (landed.layer_checksums_size() != in.shape.num_layers) {
    return absl::DataLossError(absl::StrCat("prefill node ", landed.node_name(), " sent ",
                                            landed.layer_checksums_size(),
                                            " layer checksums for ", in.shape.num_layers,
                                            " layers"));
  }
  return absl::OkStatus();
}

// DATA_LOSS unless the page-metadata summary describes exactly this prompt's metadata, in the
// room this node reserved, with a checksum per layer.
absl::Status CheckPageMetaSummary(const LandingInput& in) {
  const v1::PageMetaSummary& meta = in.landed->page_meta();
  const uint64_t want = transfer::PageMetaBytes(GeometryOf(in.shape, in.page_tokens),
                                                in.prompt_tokens);
  const std::string who = absl::StrCat("page metadata from prefill node ", in.landed->node_name());
  if (meta.format_version() != transfer::kPageMetaVersion) {
    return absl::DataLossError(absl::StrCat(who, " is format ", meta.format_version(),
                                            "; this node asked for ", transfer::kPageMetaVersion));
  }
  if (meta.bytes_written() != want ||
      want > static_cast<uint64_t>(in.meta_pages) * in.arena->page_bytes()) {
    return absl::DataLossError(absl::StrCat(who, " claims ", meta.bytes_written(),
                                            " bytes; a ", in.prompt_tokens, "-token prompt has ",
                                            want, " in a room of ", in.meta_pages, " pages"));
  }
  if (meta.layer_checksums_size() != in.shape.num_layers) {
    return absl::DataLossError(absl::StrCat(who, " has ", meta.layer_checksums_size(),
                                            " layer checksums for ", in.shape.num_layers,
                                            " layers"));
  }
  return absl::OkStatus();
}

// What one layer's landing pass found.
struct LayerLanding {
  absl::Status status;
  bool checksum_failed = false;
};

// The landing pass of one layer: CRC-32C over its KV pages (the one read of the context), and
// the layer's page bounds into `bounds`: decoded from the shipped block (`shipped`) or computed
// from each page right after hashing it, while it is in cache.
LayerLanding LandLayer(const LandingInput& in, const std::vector<int32_t>& page_ids,
                       const std::vector<PageRun>& room, bool shipped, int64_t layer,
                       PageBounds* bounds) {
  const v1::PrefillResponse& landed = *in.landed;
  const transfer::KvPageGeometry geo = GeometryOf(in.shape, in.page_tokens);
  const int64_t heads = geo.num_kv_heads, d = geo.head_dim, pt = geo.page_tokens;
  const int64_t per_head = geo.pages_per_head(in.prompt_tokens);
  // Only the K/V bytes are hashed: a page may be larger than its content (the arena's page size).
  const size_t content = geo.content_bytes();
  std::vector<float*> mins(heads), maxs(heads);
  for (int64_t h = 0; h < heads; ++h) {
    const size_t index = static_cast<size_t>(layer * heads + h);
    bounds->min[index].resize(per_head * d);
    bounds->max[index].resize(per_head * d);
    mins[h] = bounds->min[index].data();
    maxs[h] = bounds->max[index].data();
  }
  uint32_t crc = 0;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < per_head; ++i) {
      const uint8_t* page = in.arena->page(page_ids[(layer * heads + h) * per_head + i]);
      crc = transfer::Crc32cExtend(crc, page, content);
      if (!shipped) {
        transfer::PageKeyBounds(d, std::min(pt, in.prompt_tokens - i * pt),
                                reinterpret_cast<const bf16*>(page), mins[h] + i * d,
                                maxs[h] + i * d);
      }
    }
  }
  LayerLanding out;
  if (crc != landed.layer_checksums(layer)) {
    out.checksum_failed = true;
    out.status = absl::DataLossError(absl::StrFormat(
        "KV of layer %d landed with CRC-32C %08x but prefill node %s sent %08x; the request "
        "was not decoded (retry it)",
        layer, crc, landed.node_name(), static_cast<uint32_t>(landed.layer_checksums(layer))));
    return out;
  }
  if (!shipped) return out;
  const uint64_t block_bytes = transfer::PageMetaLayerBytes(geo, in.prompt_tokens);
  std::vector<uint8_t> block(block_bytes);
  if (!CopyFromRoom(*in.arena, room, layer * block_bytes, block_bytes, block.data())) {
    out.status = absl::DataLossError("page metadata does not fit the reserved room");
    return out;  // not expected: CheckPageMetaSummary checked the size against the room
  }
  const uint32_t meta_crc = transfer::Crc32c(block.data(), block.size());
  if (meta_crc != landed.page_meta().layer_checksums(layer)) {
    out.checksum_failed = true;
    out.status = absl::DataLossError(absl::StrFormat(
        "page metadata of layer %d landed with CRC-32C %08x but prefill node %s sent %08x; the "
        "request was not decoded (retry it)",
        layer, meta_crc, landed.node_name(),
        static_cast<uint32_t>(landed.page_meta().layer_checksums(layer))));
    return out;
  }
  absl::Status decoded = transfer::DecodeLayerPageMeta(geo, in.prompt_tokens, block.data(), mins,
                                                       maxs);
  if (!decoded.ok()) {
    out.status = absl::DataLossError(absl::StrCat(
        "page metadata of layer ", layer, " from prefill node ", landed.node_name(), ": ",
        decoded.message(), "; the request was not decoded (retry it)"));
  }
  return out;
}

// Every layer's landing pass (in parallel on in.pool), then the first failure in layer order.
absl::StatusOr<PageBounds> LandLayers(const LandingInput& in, const std::vector<int32_t>& page_ids,
                                      const std::vector<PageRun>& room, bool* checksum_failed) {
  FLUXION_RETURN_IF_ERROR(CheckLayerChecksumCount(in));
  // A summary without a room this node reserved is ignored: nothing of it can be read.
  const bool shipped = in.meta_pages > 0 && in.landed->has_page_meta();
  if (shipped) FLUXION_RETURN_IF_ERROR(CheckPageMetaSummary(in));
  const int64_t layers = in.shape.num_layers;
  PageBounds bounds;
  bounds.min.resize(static_cast<size_t>(layers * in.shape.num_kv_heads));
  bounds.max.resize(bounds.min.size());
  std::vector<LayerLanding> results(layers);
  auto one = [&](int64_t layer) {
    results[layer] = LandLayer(in, page_ids, room, shipped, layer, &bounds);
  };
  if (in.pool != nullptr) {
    // On a thread of its own: this runs on the request's thread, and a team started there would
    // outlive the landing and slow every step's parallel regions (cpu_pool.h says how).
    in.pool->ParallelForOnTransientThread(layers, one);
  } else {
    for (int64_t layer = 0; layer < layers; ++layer) one(layer);
  }
  for (const LayerLanding& r : results) {
    if (r.status.ok()) continue;
    *checksum_failed = r.checksum_failed;
    return r.status;
  }
  return bounds;
}

// The sparse state read out of its room, checked against its checksum and this model and prompt.
absl::StatusOr<model::SparseState> ReadSparseState(const LandingInput& in,
                                                   const Reservation& room,
                                                   bool* checksum_failed) {
  const v1::PrefillResponse& landed = *in.landed;
  const uint64_t written = landed.sparse_state().bytes_written();
  const uint64_t page_bytes = in.arena->page_bytes();
  // The state's room follows the page-metadata room's pages.
  const uint64_t room_bytes = static_cast<uint64_t>(room.pages()) * page_bytes;
  const uint64_t state_at = static_cast<uint64_t>(in.meta_pages) * page_bytes;
  if (written > room_bytes - std::min(room_bytes, state_at)) {
    return absl::DataLossError(
        absl::StrCat("sparse state of ", written, " bytes does not fit the reserved room"));
  }
  std::string blob(written, '\0');
  if (!CopyFromRoom(*in.arena, room.runs(), state_at, written,
                    reinterpret_cast<uint8_t*>(blob.data()))) {
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

// Appends byte extents (offsets from page 0 of the arena) covering pages [first, first + count)
// of the stream of pages `runs` form.
void AddRoomExtents(const std::vector<PageRun>& runs, int64_t first, int64_t count,
                    size_t page_bytes, google::protobuf::RepeatedPtrField<v1::ByteExtent>* out) {
  int64_t at = 0;  // stream index of the run's first page
  for (const PageRun& r : runs) {
    const int64_t lo = std::max<int64_t>(first, at), hi = std::min<int64_t>(first + count, at + r.count);
    if (lo < hi) {
      v1::ByteExtent* e = out->Add();
      e->set_offset(static_cast<uint64_t>(r.first + (lo - at)) * page_bytes);
      e->set_length(static_cast<uint64_t>(hi - lo) * page_bytes);
    }
    at += r.count;
  }
}

}  // namespace

int64_t PageMetaRoomPages(const model::AttentionShape& shape, int64_t page_tokens,
                          int64_t tokens, size_t page_bytes) {
  const uint64_t bytes = transfer::PageMetaBytes(GeometryOf(shape, page_tokens), tokens);
  return static_cast<int64_t>((bytes + page_bytes - 1) / page_bytes);
}

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
  const std::vector<PageRun>& room = target.state_room->runs();
  if (target.meta_pages > 0) {
    v1::PageMetaTarget* mt = prefill.mutable_page_meta_target();
    mt->set_format_version(transfer::kPageMetaVersion);
    mt->set_base_address(arena.base_address);
    AddRoomExtents(room, 0, target.meta_pages, target.page_bytes, mt->mutable_extents());
  }
  if (target.needs_state) {
    v1::SparseStateTarget* st = prefill.mutable_sparse_target();
    st->set_format_version(model::kSparseStateVersion);
    st->set_base_address(arena.base_address);
    AddRoomExtents(room, target.meta_pages, CountPages(room) - target.meta_pages,
                   target.page_bytes, st->mutable_extents());
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
  absl::StatusOr<PageBounds> bounds = LandLayers(in, page_ids, state_room.runs(), checksum_failed);
  if (!bounds.ok()) return bounds.status();  // both reservations die here: pages freed
  model::SparseState state;
  if (in.needs_state) {
    absl::StatusOr<model::SparseState> read = ReadSparseState(in, state_room, checksum_failed);
    if (!read.ok()) return read.status();  // both reservations die here: pages freed
    state = std::move(*read);
  }
  state_room.Release();  // parsed and copied out; the room is no longer needed
  const KvShape kv_shape{in.shape.num_layers, in.shape.num_kv_heads, in.shape.head_dim,
                         in.page_tokens};
  absl::StatusOr<std::unique_ptr<PagedKv>> paged =
      PagedKv::Adopt(std::move(kv_pages), kv_shape, page_ids, in.prompt_tokens,
                     std::move(*bounds));  // owns them
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
                                                const std::vector<int64_t>& eos_ids,
                                                uint64_t admission_seq,
                                                std::unique_ptr<SparseAttention> attention,
                                                int64_t prompt_tokens) {
  auto r = std::make_shared<DecodeRequest>();
  r->id = request.request_id();
  r->admission_seq = admission_seq;
  r->attention = attention.get();
  r->seq = std::make_unique<model::Sequence>(std::move(attention), prompt_tokens);
  const v1::SamplingParams& sp = request.sampling();
  r->stop_ids.assign(sp.stop_token_ids().begin(), sp.stop_token_ids().end());
  if (!sp.ignore_eos()) {
    for (int64_t eos : eos_ids) r->stop_ids.push_back(static_cast<int32_t>(eos));
  }
  model::SamplingParams sampling = valid.sampling;
  sampling.penalties.stop_token_ids = r->stop_ids;  // what min_tokens holds back
  r->sampler.emplace(sampling);
  if (sampling.penalties.repetition != 1.0) {
    const std::vector<int32_t> prompt(request.prompt_token_ids().begin(),
                                      request.prompt_token_ids().end());
    r->sampler->SetPrompt(prompt);
  }
  // Draw 0 of the request's stream sampled the first token on the prefill node; the next token is
  // draw 1 (PROTOCOL.md), so a seeded request gives the tokens of single-process generation.
  r->sampler->SkipDraw();
  r->max_tokens = valid.max_tokens;
  r->context_limit = valid.context_limit;
  return r;
}

std::shared_ptr<DecodeRequest> ResumeDecodeRequest(DecodeRequest& preempted,
                                                   std::unique_ptr<SparseAttention> attention,
                                                   int64_t context_tokens,
                                                   BatchScheduler* scheduler) {
  auto r = std::make_shared<DecodeRequest>();
  r->id = preempted.id;
  r->admission_seq = preempted.admission_seq;
  r->attention = attention.get();
  r->seq = std::make_unique<model::Sequence>(std::move(attention), context_tokens);
  r->sampler = std::move(preempted.sampler);
  r->stop_ids = preempted.stop_ids;
  r->max_tokens = preempted.max_tokens;
  r->context_limit = preempted.context_limit;
  r->last_token = preempted.last_token;
  r->completion_tokens = preempted.completion_tokens;
  scheduler->Join(r);
  return r;
}

namespace {

absl::Status CheckLogprobs(const v1::TokenLogprobs& l, uint32_t top, int64_t vocab,
                           absl::string_view what) {
  if (static_cast<uint32_t>(l.top_token_ids_size()) != top ||
      static_cast<uint32_t>(l.top_logprobs_size()) != top) {
    return absl::DataLossError(absl::StrCat("the prefill node's ", what, " lists ",
                                            l.top_token_ids_size(), " ids and ",
                                            l.top_logprobs_size(), " values; ", top,
                                            " were asked for"));
  }
  for (uint32_t id : l.top_token_ids()) {
    if (id >= static_cast<uint64_t>(vocab)) {
      return absl::DataLossError(absl::StrCat("the prefill node's ", what, " names token ", id,
                                              ", outside the vocabulary [0, ", vocab, ")"));
    }
  }
  return absl::OkStatus();
}

model::TokenLogprobs LogprobsFromProto(const v1::TokenLogprobs& l, int32_t token) {
  model::TokenLogprobs out;
  out.token = token;
  out.logprob = l.logprob();
  out.top_ids.assign(l.top_token_ids().begin(), l.top_token_ids().end());
  out.top_logprobs.assign(l.top_logprobs().begin(), l.top_logprobs().end());
  return out;
}

}  // namespace

absl::StatusOr<PrefillTokens> CheckPrefillTokens(const v1::PrefillResponse& landed,
                                                 const v1::SamplingParams& asked,
                                                 int64_t prompt_tokens, int64_t vocab) {
  PrefillTokens out;
  if (landed.first_token_id() >= static_cast<uint64_t>(vocab)) {
    return absl::DataLossError(absl::StrCat("the prefill node's first token ",
                                            landed.first_token_id(),
                                            " is outside the vocabulary [0, ", vocab, ")"));
  }
  out.first_token = static_cast<int32_t>(landed.first_token_id());
  if (asked.has_logprobs() != landed.has_first_token_logprobs()) {
    return absl::DataLossError(asked.has_logprobs()
                                   ? "the prefill node sent no logprobs for the first token"
                                   : "the prefill node sent logprobs nobody asked for");
  }
  if (asked.has_logprobs()) {
    FLUXION_RETURN_IF_ERROR(CheckLogprobs(landed.first_token_logprobs(), asked.logprobs(), vocab,
                                          "first token's logprobs"));
    out.first_logprobs = LogprobsFromProto(landed.first_token_logprobs(), out.first_token);
  }
  const int64_t want = asked.has_prompt_logprobs() ? prompt_tokens - 1 : 0;
  if (landed.prompt_logprobs_size() != want) {
    return absl::DataLossError(absl::StrCat("the prefill node sent ",
                                            landed.prompt_logprobs_size(),
                                            " prompt logprobs; ", want, " were asked for"));
  }
  for (const v1::TokenLogprobs& l : landed.prompt_logprobs()) {
    FLUXION_RETURN_IF_ERROR(CheckLogprobs(l, asked.prompt_logprobs(), vocab, "prompt logprobs"));
  }
  return out;
}

Finish StartDecoding(const std::shared_ptr<DecodeRequest>& r, int32_t first_token,
                     const std::optional<model::TokenLogprobs>& first_logprobs,
                     BatchScheduler* scheduler) {
  const Finish first = AcceptToken(*r, first_token, first_logprobs);
  if (first != Finish::kNone) {
    EndRequest(*r, first, absl::OkStatus());  // its reservations wake the admission's waiters
  } else {
    scheduler->Join(r);
  }
  return first;
}

}  // namespace fluxion::decode

// The parts of a Generate call's phases (decode/serving/generate_call.h) that need neither the
// service nor gRPC: what the prefill node is asked to write where, checking and loading what it
// wrote, and turning the loaded prompt into a request of the running batch. Apart so that each can
// be tested alone in process (decode/serving/generate_call_steps_test.cc).
//
// Thread-compatible: free functions over the objects they are given.
#ifndef FLUXION_DECODE_SERVING_GENERATE_CALL_STEPS_H_
#define FLUXION_DECODE_SERVING_GENERATE_CALL_STEPS_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "decode/kv/kv_admission.h"
#include "decode/kv/kv_arena.h"
#include "decode/serving/batch_scheduler.h"
#include "decode/serving/generate_validation.h"
#include "decode/step/sparse_attention.h"
#include "fluxion/v1/decode.pb.h"
#include "fluxion/v1/prefill.pb.h"
#include "kernels/cpu/cpu_pool.h"
#include "model/config.h"
#include "model/logprobs.h"
#include "model/model.h"
#include "transfer/transport.h"

namespace fluxion::decode {

// Bytes of the sparse state (model/sparse_state.h) the prefill node writes for a prompt of
// `tokens` tokens: the room a request reserves next to its KV pages.
uint64_t SparseStateBytes(int64_t layers, int64_t heads, int64_t tokens);

// Pages of the room for a prompt's per-page metadata (transfer/page_meta.h): the first pages of
// the request's side room, before the sparse state's.
int64_t PageMetaRoomPages(const model::AttentionShape& shape, int64_t page_tokens,
                          int64_t tokens, size_t page_bytes);

// Where the prefill node is to write one request's prompt.
struct PrefillTarget {
  const transfer::PeerDescriptor* arena = nullptr;  // the arena's registration (no key is sent)
  size_t page_bytes = 0;
  const Reservation* kv_pages = nullptr;  // runs registered (RegisterRuns)
  // The side room, registered: `meta_pages` pages of per-page metadata room (0: none is asked
  // for), then the sparse-state room when `needs_state`. Empty when neither is asked for.
  const Reservation* state_room = nullptr;
  bool needs_state = false;
  int64_t pages_per_head = 0;  // ceil(prompt / page_tokens)
  const fluxion::v1::ModelLayout* layout = nullptr;
  int64_t meta_pages = 0;
};

// The Prefill call for `request` under the attempt's id: the prompt and sampling (with
// `sampling.seed` when the client gave none, so both nodes draw from one stream), one
// KvTarget.ranges entry per registered run of both reservations (never the arena-wide key), the
// KV pages as extents in PAGE_ORDER_LAYER_HEAD_PAGE with CRC-32C per layer, the page-metadata
// room and the sparse-state room as byte extents, and this node's layout.
fluxion::v1::PrefillRequest BuildPrefillRequest(const std::string& prefill_id,
                                                const fluxion::v1::GenerateRequest& request,
                                                const model::SamplingParams& sampling,
                                                const PrefillTarget& target);

// What a request's prompt landed as, for its attention.
struct LandingInput {
  const KvArena* arena = nullptr;
  model::AttentionShape shape;
  int64_t page_tokens = 16;
  int64_t prompt_tokens = 0;
  const fluxion::v1::PrefillResponse* landed = nullptr;  // the prefill node's OK answer
  const sparse::PolicyConfig* policy = nullptr;
  bool needs_state = false;
  int64_t meta_pages = 0;  // PrefillTarget::meta_pages of the request
  // Verifies the layers in parallel; null: on the calling thread.
  const kernels::cpu::CpuPool* pool = nullptr;
};

// Checks what the prefill node wrote and hands the pages to the request's attention, reading the
// context once: one pass per layer (in parallel on `pool`) computes CRC-32C over the layer's
// pages and compares it with landed->layer_checksums, and takes the layer's page metadata either
// from the prefill node (landed->page_meta: its block read out of the room, its CRC-32C checked,
// every value finite and every min <= max) or, when the prefill node sent none (an older one),
// from the pages in the same pass while they are in cache. Then it reads the sparse state out of
// its room (its own CRC-32C, SparseState::Parse, CheckMatches against this model and prompt),
// frees the room, adopts the KV pages and their metadata into a PagedKv and sets up the policy.
// DATA_LOSS (the request was not decoded: retry it) for a wrong number of layer checksums, a
// layer, metadata or state checksum mismatch (`*checksum_failed` set: counted apart), metadata of
// the wrong format or size or with a non-finite or inverted bound, a state larger than its room
// or one that does not parse or match; INTERNAL when adopting or the policy setup fails.
// Both reservations are the callee's: on any error their pages are given back before it returns.
// REQUIRES: the prefill node stopped writing (SetPeerStopped).
absl::StatusOr<std::unique_ptr<SparseAttention>> LandPrompt(const LandingInput& in,
                                                            Reservation kv_pages,
                                                            Reservation state_room,
                                                            bool* checksum_failed);

// The request as the running batch decodes it: `attention` over its `prompt_tokens` landed
// tokens, its sampler at draw 1 (draw 0 sampled the first token on the prefill node, PROTOCOL.md,
// so a seeded request gives the tokens of single-process generation), stop ids (the request's
// and `eos_ids` unless ignore_eos), max_tokens and the context limit.
std::shared_ptr<DecodeRequest> NewDecodeRequest(const fluxion::v1::GenerateRequest& request,
                                                const ValidatedGenerate& valid,
                                                const std::vector<int64_t>& eos_ids,
                                                uint64_t admission_seq,
                                                std::unique_ptr<SparseAttention> attention,
                                                int64_t prompt_tokens);

// Takes the prefill node's first token into `r`: when it already ends the request (a stop token,
// max_tokens 1, the context full) the request ends here (pages freed, finish published) and never
// joins; otherwise it joins `scheduler`'s batch. Returns how it ended (kNone: joined).
Finish StartDecoding(const std::shared_ptr<DecodeRequest>& r, int32_t first_token,
                     const std::optional<model::TokenLogprobs>& first_logprobs,
                     BatchScheduler* scheduler);

// The prefill node's first token and its log-probabilities when asked for.
struct PrefillTokens {
  int32_t first_token = 0;
  std::optional<model::TokenLogprobs> first_logprobs;
};

// The tokens of the prefill node's answer checked against the request it answers (a peer's
// bytes: nothing of them is used unchecked): the first token inside the vocabulary; with
// `asked.logprobs`, the first token's log-probabilities with that many alternatives; with
// `asked.prompt_logprobs`, one entry per prompt token after the first with that many; every id
// inside the vocabulary, nothing the request did not ask for. DATA_LOSS naming the field
// otherwise (the request is not decoded).
absl::StatusOr<PrefillTokens> CheckPrefillTokens(const fluxion::v1::PrefillResponse& landed,
                                                 const fluxion::v1::SamplingParams& asked,
                                                 int64_t prompt_tokens, int64_t vocab);

// The preempted request `preempted` continued: `attention` holds its KV recomputed over
// `context_tokens` tokens (the prompt and every generated token but the last); the rest carries
// over (the sampler at its next draw, the counts and limits, the last token as the next input,
// its place in the preemption order, so that younger requests yield before it does again).
// Joins `scheduler`'s batch.
// REQUIRES: `preempted` has finished (its scheduler-side fields are no longer written).
std::shared_ptr<DecodeRequest> ResumeDecodeRequest(DecodeRequest& preempted,
                                                   std::unique_ptr<SparseAttention> attention,
                                                   int64_t context_tokens,
                                                   BatchScheduler* scheduler);

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_SERVING_GENERATE_CALL_STEPS_H_

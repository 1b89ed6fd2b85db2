// Validation of a fluxion.v1 PrefillRequest, apart from the engine so that it is a pure function
// of the request and the node's limits: unit-testable and fuzzed (prefill/prefill_request_fuzz.cc,
// docs/FUZZING.md) without a model or a transport. Everything here is checked before the engine
// touches the decode node's memory.
//
// Thread-safe: pure functions.
#ifndef FLUXION_PREFILL_PREFILL_VALIDATION_H_
#define FLUXION_PREFILL_PREFILL_VALIDATION_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "fluxion/v1/prefill.pb.h"
#include "model/attention.h"
#include "model/sampler.h"
#include "transfer/kv_pages.h"

namespace fluxion::prefill {

// What this prefill node accepts: its model, its layout and its transport.
struct PrefillLimits {
  int64_t vocab_size = 0;
  int64_t context_limit = 0;  // max_position_embeddings; 0 = unbounded
  model::AttentionShape shape;
  const fluxion::v1::ModelLayout* layout = nullptr;  // this node's; not owned, not null
  std::string transport_kind;
};

// One writable range of the decode node's memory and its key (KvTarget.ranges, or the legacy
// arena-wide key when the request has no ranges). `key` points into the request.
struct WritableRange {
  uint64_t base = 0;
  uint64_t length = 0;
  const std::string* key = nullptr;
};

// The request's KV target resolved against the limits.
struct ValidatedPrefill {
  uint32_t version = 1;  // protocol_version, 0 read as 1
  model::SamplingParams sampling;
  transfer::KvPageGeometry geo;
  uint64_t content_bytes = 0;  // bytes of one page's content (geo.content_bytes())
  int64_t per_head = 0;        // pages per KV head
  uint64_t arena_bytes = 0;    // the span the decode node's remote key covers
  std::vector<uint64_t> page_ids;  // every page, PAGE_ORDER_LAYER_HEAD_PAGE
  // Every page and sparse-state extent lies inside one range; the ranges some page or extent
  // uses become the write targets, numbered in first use: used[range] is the target (or -1),
  // page_target[i] the target of page_ids[i], state_target[j] that of sparse extent j.
  std::vector<WritableRange> ranges;  // sorted by base
  std::vector<int> used;
  std::vector<uint32_t> page_target, state_target;
  int targets = 0;
  // Whether to write the per-page metadata (the request has a page_meta_target in a format this
  // node produces, transfer/page_meta.h), and the target of each of its extents.
  bool want_meta = false;
  std::vector<uint32_t> meta_target;
};

// INVALID_ARGUMENT naming the field for a malformed request (request_id, prompt ids, context,
// kv_target and sparse_target geometry, an empty worker_address, a page or sparse extent outside
// every kv_target.ranges entry, the same for page_meta_target's extents), FAILED_PRECONDITION for
// a peer this node cannot serve (newer protocol, other model/layout, other transport or
// checksum), RESOURCE_EXHAUSTED for a sparse_target or page_meta_target too small for what goes
// there. A page_meta_target in a format this node does not produce is not an error: no metadata
// is written (want_meta false) and the decode node computes it itself.
absl::StatusOr<ValidatedPrefill> ValidatePrefillRequest(const fluxion::v1::PrefillRequest& request,
                                                        const PrefillLimits& limits);

}  // namespace fluxion::prefill

#endif  // FLUXION_PREFILL_PREFILL_VALIDATION_H_

#include "prefill/prefill_validation.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/sparse_state.h"
#include "proto/convert.h"

namespace fluxion::prefill {
namespace {

namespace v1 = ::fluxion::v1;

absl::Status Annotate(const absl::Status& s, const std::string& prefix) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(prefix, s.message()));
}

uint64_t SparseStateBytes(int64_t layers, int64_t heads, int64_t tokens) {
  return 72 + static_cast<uint64_t>(layers * heads) * (20 + 8 * static_cast<uint64_t>(tokens));
}

}  // namespace

absl::StatusOr<ValidatedPrefill> ValidatePrefillRequest(const v1::PrefillRequest& request,
                                                        const PrefillLimits& limits) {
  const model::AttentionShape& shape = limits.shape;
  const int64_t n = request.prompt_token_ids_size();
  ValidatedPrefill out;
  const std::string& id = request.request_id();
  if (id.empty() || id.size() > 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("request_id must be 1 to 128 bytes, got ", id.size()));
  }
  if (n == 0) return absl::InvalidArgumentError("prompt_token_ids is empty");
  for (int64_t i = 0; i < n; ++i) {
    if (request.prompt_token_ids(i) >= static_cast<uint64_t>(limits.vocab_size)) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompt_token_ids[", i, "] = ", request.prompt_token_ids(i),
                       " is outside the model's vocabulary [0, ", limits.vocab_size, ")"));
    }
  }
  if (limits.context_limit > 0 && n >= limits.context_limit) {
    return absl::InvalidArgumentError(absl::StrCat("prompt of ", n, " tokens leaves no room in the ",
                                                   limits.context_limit,
                                                   "-token context"));
  }
  const uint32_t version = request.protocol_version() == 0 ? 1 : request.protocol_version();
  if (version > transfer::kTransferProtocolVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat("protocol_version ", version, " is newer than this prefill node's ",
                     transfer::kTransferProtocolVersion));
  }
  FLUXION_RETURN_IF_ERROR(Annotate(
      transfer::CheckCompatible(proto::CompatibilityOf(*limits.layout, version),
                                proto::CompatibilityOf(request.layout(), version)),
      "the decode node's model/layout differs from this prefill node's (here = prefill, peer = "
      "decode): "));
  FLUXION_ASSIGN_OR_RETURN(out.sampling, proto::SamplingFromProto(request.sampling()));

  const v1::KvTarget& kv = request.kv_target();
  const transfer::KvPageGeometry geo{shape.num_layers, shape.num_kv_heads, shape.head_dim,
                                     static_cast<int64_t>(limits.layout->page_tokens())};
  if (kv.transport() != limits.transport_kind) {
    return absl::FailedPreconditionError(absl::StrCat("kv_target.transport is '", kv.transport(),
                                                      "'; this prefill node writes with '",
                                                      limits.transport_kind, "'"));
  }
  if (kv.page_order() != v1::PAGE_ORDER_LAYER_HEAD_PAGE) {
    return absl::InvalidArgumentError("kv_target.page_order must be PAGE_ORDER_LAYER_HEAD_PAGE");
  }
  if (kv.checksum_algorithm() == v1::CHECKSUM_ALGORITHM_UNSPECIFIED) {
    return absl::InvalidArgumentError("kv_target.checksum_algorithm is unspecified");
  }
  if (kv.checksum_algorithm() != v1::CHECKSUM_ALGORITHM_NONE &&
      kv.checksum_algorithm() != v1::CHECKSUM_ALGORITHM_CRC32C) {
    return absl::FailedPreconditionError(
        "this prefill node computes only CHECKSUM_ALGORITHM_CRC32C or NONE");
  }
  const uint64_t cb = geo.content_bytes();
  if (kv.page_bytes() < cb) {
    return absl::InvalidArgumentError(absl::StrCat("kv_target.page_bytes ", kv.page_bytes(),
                                                   " is smaller than a page's ", cb, " bytes"));
  }
  const int64_t per_head = geo.pages_per_head(n);
  if (kv.pages_per_head() != per_head) {
    return absl::InvalidArgumentError(absl::StrCat("kv_target.pages_per_head is ",
                                                   kv.pages_per_head(), "; a ", n,
                                                   "-token prompt needs ", per_head));
  }
  std::vector<transfer::PageIdRun> runs;
  uint64_t max_end = 0;
  for (const v1::PageExtent& e : kv.extents()) {
    runs.push_back({e.first_page_id(), e.count()});
    max_end = std::max<uint64_t>(max_end, e.first_page_id() + e.count());
  }
  // The remote key covers [base, base + arena_bytes); without the field, what the extents need.
  const uint64_t arena_bytes = kv.arena_bytes() != 0 ? kv.arena_bytes() : max_end * kv.page_bytes();
  absl::StatusOr<std::vector<uint64_t>> expanded =
      transfer::ExpandPageRuns(runs, geo.total_pages(n), arena_bytes / kv.page_bytes());
  if (!expanded.ok()) return Annotate(expanded.status(), "kv_target.extents: ");
  out.page_ids = std::move(*expanded);
  const bool want_state = request.has_sparse_target();
  const v1::SparseStateTarget& st = request.sparse_target();
  const uint64_t state_bytes = SparseStateBytes(shape.num_layers, shape.num_kv_heads, n);
  if (want_state) {
    if (st.format_version() != model::kSparseStateVersion) {
      return absl::FailedPreconditionError(
          absl::StrCat("sparse_target.format_version ", st.format_version(),
                       " is not produced here; this prefill node writes version ",
                       model::kSparseStateVersion));
    }
    if (!st.remote_key().empty()) {
      return absl::FailedPreconditionError(
          "sparse_target.remote_key must be empty: this prefill node writes the sparse state "
          "inside the KV arena only");
    }
    uint64_t room = 0;
    for (int i = 0; i < st.extents_size(); ++i) {
      const v1::ByteExtent& e = st.extents(i);
      const uint64_t start = st.base_address() + e.offset();
      if (e.length() == 0 || start < kv.arena_base_address() ||
          start - kv.arena_base_address() > arena_bytes ||
          e.length() > arena_bytes - (start - kv.arena_base_address())) {
        return absl::InvalidArgumentError(
            absl::StrCat("sparse_target.extents[", i, "] lies outside the arena"));
      }
      room += e.length();
    }
    if (room < state_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat("sparse_target.extents hold ", room,
                                                       " bytes; the sparse state needs ",
                                                       state_bytes));
    }
  }

  out.version = version;
  out.geo = geo;
  out.content_bytes = cb;
  out.per_head = per_head;
  out.arena_bytes = arena_bytes;
  return out;
}

}  // namespace fluxion::prefill

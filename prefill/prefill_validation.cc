#include "prefill/prefill_validation.h"

#include <algorithm>
#include <limits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/sparse_state.h"
#include "proto/convert.h"
#include "transfer/page_meta.h"

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

// The ranges of `kv`, sorted by base; InvalidArgument naming the field for a malformed one.
absl::StatusOr<std::vector<WritableRange>> RangesOf(const v1::KvTarget& kv, uint64_t arena_bytes,
                                                    size_t max_ranges) {
  std::vector<WritableRange> ranges;
  if (kv.ranges_size() == 0) {
    if (kv.remote_key().empty()) {
      return absl::InvalidArgumentError(
          "kv_target has neither ranges nor a remote_key: nothing may be written");
    }
    ranges.push_back({kv.arena_base_address(), arena_bytes, &kv.remote_key()});
    return ranges;
  }
  if (static_cast<size_t>(kv.ranges_size()) > max_ranges) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv_target.ranges has ", kv.ranges_size(), " entries for ", max_ranges,
        " page and sparse-state extents; the decode node sends one range per reserved run"));
  }
  for (int i = 0; i < kv.ranges_size(); ++i) {
    const v1::RemoteRange& r = kv.ranges(i);
    if (r.length() == 0 || r.remote_key().empty() ||
        r.base_address() > std::numeric_limits<uint64_t>::max() - r.length()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "kv_target.ranges[", i, "] needs a length > 0, a remote_key and an end below 2^64"));
    }
    ranges.push_back({r.base_address(), r.length(), &r.remote_key()});
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const WritableRange& a, const WritableRange& b) { return a.base < b.base; });
  return ranges;
}

// Index into `ranges` (sorted by base) of a range holding [addr, addr + length), or -1.
int RangeHolding(const std::vector<WritableRange>& ranges, uint64_t addr, uint64_t length);

// Checks that each of `extents` (offsets from `base`; `field` names them in errors) lies inside
// the arena [arena_base, + arena_bytes) and inside one range, and appends that range's target to
// `targets`. Returns the room they hold, in bytes.
template <typename TargetOf>
absl::StatusOr<uint64_t> CheckByteExtents(
    const google::protobuf::RepeatedPtrField<v1::ByteExtent>& extents, uint64_t base,
    uint64_t arena_base, uint64_t arena_bytes, const std::vector<WritableRange>& ranges,
    const std::string& field, TargetOf target_of, std::vector<uint32_t>* targets) {
  uint64_t room = 0;
  for (int i = 0; i < extents.size(); ++i) {
    const v1::ByteExtent& e = extents[i];
    if (e.offset() > std::numeric_limits<uint64_t>::max() - base) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "] overflows 2^64"));
    }
    const uint64_t start = base + e.offset();
    if (e.length() == 0 || start < arena_base || start - arena_base > arena_bytes ||
        e.length() > arena_bytes - (start - arena_base)) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "] lies outside the arena"));
    }
    const int range = RangeHolding(ranges, start, e.length());
    if (range < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, "[", i, "] lies outside every kv_target.ranges entry; nothing was written"));
    }
    targets->push_back(target_of(range));
    room += e.length();
  }
  return room;
}

int RangeHolding(const std::vector<WritableRange>& ranges, uint64_t addr, uint64_t length) {
  auto it = std::upper_bound(ranges.begin(), ranges.end(), addr,
                             [](uint64_t a, const WritableRange& r) { return a < r.base; });
  if (it == ranges.begin()) return -1;
  --it;
  const uint64_t offset = addr - it->base;
  if (offset > it->length || length > it->length - offset) return -1;
  return static_cast<int>(it - ranges.begin());
}

}  // namespace

namespace {

// The request's id, prompt and protocol version (into out->version) and sampling.
absl::Status CheckPromptAndProtocol(const v1::PrefillRequest& request, const PrefillLimits& limits,
                                    ValidatedPrefill* out) {
  const int64_t n = request.prompt_token_ids_size();
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
  FLUXION_ASSIGN_OR_RETURN(out->sampling, proto::SamplingFromProto(request.sampling()));
  FLUXION_RETURN_IF_ERROR(proto::ValidatePromptLogprobs(request.sampling(), n));
  out->version = version;
  return absl::OkStatus();
}

// kv_target's transport, address, order, checksum and page geometry for an n-token prompt.
absl::Status CheckKvGeometry(const v1::KvTarget& kv, const PrefillLimits& limits,
                             const transfer::KvPageGeometry& geo, int64_t n) {
  if (kv.transport() != limits.transport_kind) {
    return absl::FailedPreconditionError(absl::StrCat("kv_target.transport is '", kv.transport(),
                                                      "'; this prefill node writes with '",
                                                      limits.transport_kind, "'"));
  }
  if (kv.worker_address().empty()) {
    return absl::InvalidArgumentError(
        "kv_target.worker_address is empty; every request must carry the decode node's worker "
        "address");
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
  return absl::OkStatus();
}

// The write target of range `range`, numbered in first use (ValidatedPrefill's `used`).
uint32_t TargetOf(ValidatedPrefill* out, int range) {
  if (out->used[range] < 0) out->used[range] = out->targets++;
  return static_cast<uint32_t>(out->used[range]);
}

// The pages' ids, the arena the remote key covers, the writable ranges, and each page's range.
absl::Status ResolvePages(const v1::PrefillRequest& request, const transfer::KvPageGeometry& geo,
                          int64_t n, ValidatedPrefill* out) {
  const v1::KvTarget& kv = request.kv_target();
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
  out->page_ids = std::move(*expanded);
  if (kv.arena_base_address() > std::numeric_limits<uint64_t>::max() - arena_bytes) {
    return absl::InvalidArgumentError("kv_target.arena_base_address + arena_bytes overflows");
  }
  out->arena_bytes = arena_bytes;
  // Every page must lie inside one range the decode node registered for this request: its key
  // reaches nothing else, and a page outside would be a write the decode node did not allow.
  const size_t state_extents =
      request.has_sparse_target() ? static_cast<size_t>(request.sparse_target().extents_size()) : 0;
  const size_t meta_extents = request.has_page_meta_target()
                                  ? static_cast<size_t>(request.page_meta_target().extents_size())
                                  : 0;
  FLUXION_ASSIGN_OR_RETURN(
      out->ranges, RangesOf(kv, arena_bytes,
                            static_cast<size_t>(kv.extents_size()) + state_extents + meta_extents));
  out->used.assign(out->ranges.size(), -1);
  const uint64_t cb = geo.content_bytes();
  out->page_target.resize(out->page_ids.size());
  for (size_t i = 0; i < out->page_ids.size(); ++i) {
    const uint64_t addr = kv.arena_base_address() + out->page_ids[i] * kv.page_bytes();
    const int range = RangeHolding(out->ranges, addr, cb);
    if (range < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "kv_target.extents: page ", out->page_ids[i], " (0x", absl::Hex(addr), ", ", cb,
          " bytes) lies outside every kv_target.ranges entry; nothing was written"));
    }
    out->page_target[i] = TargetOf(out, range);
  }
  return absl::OkStatus();
}

// The sparse-state and page-metadata targets, when the request has them.
absl::Status ResolveSideTargets(const v1::PrefillRequest& request, const PrefillLimits& limits,
                                const transfer::KvPageGeometry& geo, int64_t n,
                                ValidatedPrefill* out) {
  const model::AttentionShape& shape = limits.shape;
  const uint64_t arena_base = request.kv_target().arena_base_address();
  auto target_of = [out](int range) { return TargetOf(out, range); };
  if (request.has_sparse_target()) {
    const v1::SparseStateTarget& st = request.sparse_target();
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
    FLUXION_ASSIGN_OR_RETURN(
        const uint64_t room,
        CheckByteExtents(st.extents(), st.base_address(), arena_base, out->arena_bytes,
                         out->ranges, "sparse_target.extents", target_of, &out->state_target));
    const uint64_t state_bytes = SparseStateBytes(shape.num_layers, shape.num_kv_heads, n);
    if (room < state_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat("sparse_target.extents hold ", room,
                                                       " bytes; the sparse state needs ",
                                                       state_bytes));
    }
  }
  const v1::PageMetaTarget& mt = request.page_meta_target();
  if (request.has_page_meta_target() && mt.format_version() == transfer::kPageMetaVersion) {
    FLUXION_ASSIGN_OR_RETURN(
        const uint64_t room,
        CheckByteExtents(mt.extents(), mt.base_address(), arena_base, out->arena_bytes,
                         out->ranges, "page_meta_target.extents", target_of, &out->meta_target));
    const uint64_t meta_bytes = transfer::PageMetaBytes(geo, n);
    if (room < meta_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat("page_meta_target.extents hold ", room,
                                                       " bytes; the page metadata needs ",
                                                       meta_bytes));
    }
    out->want_meta = true;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ValidatedPrefill> ValidatePrefillRequest(const v1::PrefillRequest& request,
                                                        const PrefillLimits& limits) {
  const model::AttentionShape& shape = limits.shape;
  const int64_t n = request.prompt_token_ids_size();
  ValidatedPrefill out;
  FLUXION_RETURN_IF_ERROR(CheckPromptAndProtocol(request, limits, &out));
  const transfer::KvPageGeometry geo{shape.num_layers, shape.num_kv_heads, shape.head_dim,
                                     static_cast<int64_t>(limits.layout->page_tokens())};
  FLUXION_RETURN_IF_ERROR(CheckKvGeometry(request.kv_target(), limits, geo, n));
  FLUXION_RETURN_IF_ERROR(ResolvePages(request, geo, n, &out));
  FLUXION_RETURN_IF_ERROR(ResolveSideTargets(request, limits, geo, n, &out));
  out.geo = geo;
  out.content_bytes = geo.content_bytes();
  out.per_head = geo.pages_per_head(n);
  return out;
}

}  // namespace fluxion::prefill

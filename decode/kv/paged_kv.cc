#include "decode/kv/paged_kv.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "transfer/page_meta.h"

namespace fluxion::decode {

absl::StatusOr<std::unique_ptr<PagedKv>> PagedKv::Create(KvArena* arena, const KvShape& shape,
                                                         KvAdmission* admission) {
  if (shape.num_layers <= 0 || shape.num_kv_heads <= 0 || shape.head_dim <= 0 ||
      shape.page_tokens <= 0) {
    return absl::InvalidArgumentError("KV shape needs positive layers, heads, head_dim, page size");
  }
  if (arena->page_bytes() < shape.page_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat("arena pages of ", arena->page_bytes(),
                                                   " bytes cannot hold ", shape.page_bytes(),
                                                   "-byte KV pages"));
  }
  return std::unique_ptr<PagedKv>(new PagedKv(arena, shape, admission));
}

namespace {

// InvalidArgument unless `pages` lists per_head pages of every (layer, head), all in the arena.
absl::Status CheckPageList(const KvArena& arena, const KvShape& shape,
                           absl::Span<const int32_t> pages, int64_t tokens) {
  const int64_t per_head = (tokens + shape.page_tokens - 1) / shape.page_tokens;
  if (tokens <= 0 ||
      static_cast<int64_t>(pages.size()) != shape.num_layers * shape.num_kv_heads * per_head) {
    return absl::InvalidArgumentError(absl::StrCat(pages.size(), " pages cannot hold ", tokens,
                                                   " tokens of every layer and KV head"));
  }
  for (int32_t id : pages) {
    if (id < 0 || id >= arena.num_pages()) {
      return absl::InvalidArgumentError(absl::StrCat("page id ", id, " is outside the arena"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<PageBounds> PagedKv::ComputeBounds(const KvArena& arena, const KvShape& shape,
                                                  absl::Span<const int32_t> pages,
                                                  int64_t tokens) {
  FLUXION_RETURN_IF_ERROR(CheckPageList(arena, shape, pages, tokens));
  const int64_t pt = shape.page_tokens, d = shape.head_dim, per_head = (tokens + pt - 1) / pt;
  const size_t tables = static_cast<size_t>(shape.num_layers * shape.num_kv_heads);
  PageBounds bounds;
  bounds.min.resize(tables);
  bounds.max.resize(tables);
  for (size_t index = 0; index < tables; ++index) {
    bounds.min[index].resize(per_head * d);
    bounds.max[index].resize(per_head * d);
    for (int64_t page = 0; page < per_head; ++page) {
      const auto* keys = reinterpret_cast<const bf16*>(arena.page(pages[index * per_head + page]));
      transfer::PageKeyBounds(d, std::min(pt, tokens - page * pt), keys,
                              bounds.min[index].data() + page * d,
                              bounds.max[index].data() + page * d);
    }
  }
  return bounds;
}

absl::StatusOr<std::unique_ptr<PagedKv>> PagedKv::Adopt(Reservation reservation,
                                                         const KvShape& shape,
                                                         absl::Span<const int32_t> pages,
                                                         int64_t tokens, PageBounds bounds) {
  KvArena* const arena = reservation.arena();
  if (arena == nullptr) return absl::InvalidArgumentError("adopting an empty reservation");
  // On failure `reservation` dies with this call and gives its pages back.
  FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<PagedKv> kv,
                           Create(arena, shape, reservation.admission()));
  kv->reserved_.push_back(std::move(reservation));  // owned from here on, whatever happens below
  FLUXION_RETURN_IF_ERROR(CheckPageList(*arena, shape, pages, tokens));
  const int64_t per_head = (tokens + shape.page_tokens - 1) / shape.page_tokens;
  const size_t tables = static_cast<size_t>(shape.num_layers * shape.num_kv_heads);
  const size_t floats = static_cast<size_t>(per_head * shape.head_dim);
  bool sized = bounds.min.size() == tables && bounds.max.size() == tables;
  for (size_t i = 0; sized && i < tables; ++i) {
    sized = bounds.min[i].size() == floats && bounds.max[i].size() == floats;
  }
  if (!sized) {
    return absl::InvalidArgumentError(absl::StrCat(
        "page bounds do not cover ", per_head, " pages of head_dim ", shape.head_dim,
        " for each of ", tables, " (layer, KV head) tables"));
  }
  for (int64_t layer = 0; layer < shape.num_layers; ++layer) {
    kv->lengths_[layer] = tokens;
    for (int64_t h = 0; h < shape.num_kv_heads; ++h) {
      const size_t index = kv->Index(static_cast<int>(layer), static_cast<int>(h));
      kv->pages_[index].assign(pages.begin() + index * per_head,
                               pages.begin() + (index + 1) * per_head);
      kv->meta_[index].min = std::move(bounds.min[index]);
      kv->meta_[index].max = std::move(bounds.max[index]);
    }
  }
  return kv;
}

PagedKv::PagedKv(KvArena* arena, const KvShape& shape, KvAdmission* admission)
    : arena_(arena),
      admission_(admission),
      shape_(shape),
      lengths_(shape.num_layers, 0),
      pages_(shape.num_layers * shape.num_kv_heads),
      meta_(shape.num_layers * shape.num_kv_heads) {}

int64_t PagedKv::reserved_pages() const {
  int64_t n = 0;
  for (const Reservation& r : reserved_) n += r.pages();
  return n;
}

absl::Status PagedKv::Append(int layer, int64_t n, const float* k, const float* v,
                             int64_t row_stride) {
  if (layer < 0 || layer >= shape_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range"));
  }
  const int64_t pt = shape_.page_tokens, d = shape_.head_dim, heads = shape_.num_kv_heads;
  const int64_t old_len = lengths_[layer], new_len = old_len + n;
  const int64_t have = static_cast<int64_t>(pages_[Index(layer, 0)].size());
  const int64_t want = (new_len + pt - 1) / pt;
  if (want > have) {
    // One reservation for every head of the layer: all or nothing.
    FLUXION_ASSIGN_OR_RETURN(Reservation group,
                             Reservation::Allocate(arena_, (want - have) * heads, admission_));
    std::vector<int32_t> ids;
    for (const PageRun& r : group.runs()) {
      for (int32_t id = r.first; id < r.first + r.count; ++id) ids.push_back(id);
    }
    // Head-major: each head's new pages are consecutive ids where the runs allow.
    for (int64_t h = 0; h < heads; ++h) {
      auto& table = pages_[Index(layer, h)];
      PageMeta& meta = meta_[Index(layer, h)];
      for (int64_t p = 0; p < want - have; ++p) table.push_back(ids[h * (want - have) + p]);
      meta.min.resize(want * d, INFINITY);
      meta.max.resize(want * d, -INFINITY);
    }
    reserved_.push_back(std::move(group));
  }
  for (int64_t h = 0; h < heads; ++h) {
    const auto& table = pages_[Index(layer, h)];
    PageMeta& meta = meta_[Index(layer, h)];
    for (int64_t i = 0; i < n; ++i) {
      const int64_t pos = old_len + i, page = pos / pt, slot = pos % pt;
      bf16* kp = reinterpret_cast<bf16*>(arena_->page(table[page])) + slot * d;
      bf16* vp = kp + pt * d;
      const float* ks = k + i * row_stride + h * d;
      const float* vs = v + i * row_stride + h * d;
      float* mn = meta.min.data() + page * d;
      float* mx = meta.max.data() + page * d;
      for (int64_t t = 0; t < d; ++t) {
        kp[t] = FloatToBf16(ks[t]);
        vp[t] = FloatToBf16(vs[t]);
        // Metadata describes the stored (bf16) keys, so bounds hold for what kernels read.
        const float kr = Bf16ToFloat(kp[t]);
        mn[t] = std::min(mn[t], kr);
        mx[t] = std::max(mx[t], kr);
      }
    }
  }
  lengths_[layer] = new_len;
  return absl::OkStatus();
}

}  // namespace fluxion::decode

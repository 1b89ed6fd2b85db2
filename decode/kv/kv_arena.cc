#include "decode/kv/kv_arena.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"

namespace fluxion::decode {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;

size_t RoundUp(size_t x, size_t to) { return (x + to - 1) / to * to; }

const char* StateName(int s) {
  switch (s) {
    case 0:
      return "free";
    case 1:
      return "reserved";
    default:
      return "quarantined";
  }
}

}  // namespace

int64_t CountPages(absl::Span<const PageRun> runs) {
  int64_t n = 0;
  for (const PageRun& r : runs) n += r.count;
  return n;
}

absl::StatusOr<std::unique_ptr<KvArena>> KvArena::Create(size_t page_bytes, int64_t num_pages,
                                                         const KvArenaOptions& options) {
  if (page_bytes == 0 || num_pages <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("KV arena needs positive page_bytes and ",
                                                   "num_pages, got ", page_bytes, " and ",
                                                   num_pages));
  }
  if (num_pages > std::numeric_limits<int32_t>::max() ||
      static_cast<size_t>(num_pages) > std::numeric_limits<size_t>::max() / page_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV arena of ", num_pages, " pages x ", page_bytes, " bytes is too large"));
  }
  const size_t bytes = RoundUp(page_bytes * static_cast<size_t>(num_pages), kHugePage);
  const int populate = options.populate ? MAP_POPULATE : 0;
  void* p = MAP_FAILED;
  bool huge = false;
  if (options.huge_pages) {
    p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB | populate, -1, 0);
    huge = p != MAP_FAILED;
  }
  if (p == MAP_FAILED) {
    p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | populate, -1,
             0);
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "cannot map a KV arena of ", bytes, " bytes: ", std::strerror(errno),
          " (lower --kv-pages or free host memory)"));
    }
    // No explicit huge pages reserved on this host (the usual case): transparent ones still help.
    if (options.huge_pages) madvise(p, bytes, MADV_HUGEPAGE);
  }
  return std::unique_ptr<KvArena>(
      new KvArena(static_cast<uint8_t*>(p), bytes, page_bytes, num_pages, huge));
}

absl::StatusOr<std::unique_ptr<KvArena>> KvArena::Over(uint8_t* base, size_t bytes,
                                                       size_t page_bytes) {
  if (base == nullptr || page_bytes == 0 || bytes < page_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("cannot make a KV arena of ", page_bytes,
                                                   "-byte pages over ", bytes, " bytes"));
  }
  const size_t pages = bytes / page_bytes;
  if (pages > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return absl::InvalidArgumentError(absl::StrCat("KV arena of ", pages, " pages is too large"));
  }
  return std::unique_ptr<KvArena>(new KvArena(base, bytes, page_bytes,
                                              static_cast<int64_t>(pages), false, /*owned=*/false));
}

KvArena::KvArena(uint8_t* base, size_t bytes, size_t page_bytes, int64_t num_pages, bool huge,
                 bool owned)
    : base_(base),
      bytes_(bytes),
      page_bytes_(page_bytes),
      num_pages_(num_pages),
      explicit_huge_pages_(huge),
      owned_(owned),
      state_(num_pages, State::kFree) {
  absl::MutexLock lock(&mu_);
  AddFreeExtent(0, static_cast<int32_t>(num_pages));
  free_ = num_pages;
}

KvArena::~KvArena() {
  {
    absl::MutexLock lock(&mu_);
    while (!attachments_.empty()) attachments_.pop_back();  // latest first
  }
  if (owned_) munmap(base_, bytes_);
}

void KvArena::Attach(std::unique_ptr<ArenaAttachment> a) {
  absl::MutexLock lock(&mu_);
  attachments_.push_back(std::move(a));
}

void KvArena::AddFreeExtent(int32_t first, int32_t count) {
  // Coalesce with the neighbours so large requests keep finding single runs.
  auto next = free_by_first_.lower_bound(first);
  if (next != free_by_first_.end() && next->first == first + count) {
    count += next->second;
    free_by_size_.erase({next->second, next->first});
    next = free_by_first_.erase(next);
  }
  if (next != free_by_first_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == first) {
      first = prev->first;
      count += prev->second;
      free_by_size_.erase({prev->second, prev->first});
      free_by_first_.erase(prev);
    }
  }
  free_by_first_[first] = count;
  free_by_size_.insert({count, first});
}

void KvArena::RemoveFreeExtent(int32_t first, int32_t count) {
  free_by_first_.erase(first);
  free_by_size_.erase({count, first});
}

absl::StatusOr<std::vector<PageRun>> KvArena::Allocate(int64_t count) {
  if (count <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("cannot allocate ", count, " pages"));
  }
  absl::MutexLock lock(&mu_);
  if (count > free_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV arena has ", free_, " free pages of ", num_pages_, " (", quarantined_,
                     " quarantined); ", count, " requested"));
  }
  std::vector<PageRun> runs;
  auto fit = free_by_size_.lower_bound({static_cast<int32_t>(count), -1});
  if (fit != free_by_size_.end()) {
    const auto [size, first] = *fit;
    RemoveFreeExtent(first, size);
    if (size > count) AddFreeExtent(first + static_cast<int32_t>(count), size - count);
    runs.push_back({first, static_cast<int32_t>(count)});
  } else {
    int64_t left = count;
    while (left > 0) {
      auto largest = std::prev(free_by_size_.end());
      const auto [size, first] = *largest;
      RemoveFreeExtent(first, size);
      const int32_t take = static_cast<int32_t>(std::min<int64_t>(size, left));
      if (size > take) AddFreeExtent(first + take, size - take);
      runs.push_back({first, take});
      left -= take;
    }
  }
  for (const PageRun& r : runs) {
    std::fill(state_.begin() + r.first, state_.begin() + r.first + r.count, State::kReserved);
  }
  free_ -= count;
  return runs;
}

absl::Status KvArena::Transition(absl::Span<const PageRun> runs, State from, State to) {
  // Validate everything first so a bad call changes nothing.
  for (const PageRun& r : runs) {
    if (r.first < 0 || r.count <= 0 || r.first + int64_t{r.count} > num_pages_) {
      return absl::InvalidArgumentError(absl::StrCat("page run [", r.first, ", +", r.count,
                                                     ") is outside the arena of ", num_pages_,
                                                     " pages"));
    }
    for (int32_t id = r.first; id < r.first + r.count; ++id) {
      if (state_[id] != from) {
        return absl::FailedPreconditionError(
            absl::StrCat("page ", id, " is ", StateName(static_cast<int>(state_[id])),
                         ", expected ", StateName(static_cast<int>(from))));
      }
    }
  }
  std::vector<PageRun> sorted(runs.begin(), runs.end());
  std::sort(sorted.begin(), sorted.end(),
            [](const PageRun& a, const PageRun& b) { return a.first < b.first; });
  for (size_t i = 1; i < sorted.size(); ++i) {
    if (sorted[i].first < sorted[i - 1].first + sorted[i - 1].count) {
      return absl::InvalidArgumentError(
          absl::StrCat("page runs overlap at page ", sorted[i].first));
    }
  }
  for (const PageRun& r : runs) {
    std::fill(state_.begin() + r.first, state_.begin() + r.first + r.count, to);
    if (to == State::kFree) AddFreeExtent(r.first, r.count);
  }
  const int64_t n = CountPages(runs);
  if (to == State::kFree) free_ += n;
  if (to == State::kQuarantined) quarantined_ += n;
  if (from == State::kQuarantined) quarantined_ -= n;
  return absl::OkStatus();
}

absl::Status KvArena::Free(absl::Span<const PageRun> runs) {
  absl::MutexLock lock(&mu_);
  return Transition(runs, State::kReserved, State::kFree);
}

absl::Status KvArena::Quarantine(absl::Span<const PageRun> runs) {
  absl::MutexLock lock(&mu_);
  return Transition(runs, State::kReserved, State::kQuarantined);
}

absl::Status KvArena::ReleaseQuarantine(absl::Span<const PageRun> runs) {
  absl::MutexLock lock(&mu_);
  return Transition(runs, State::kQuarantined, State::kFree);
}

KvArenaCounters KvArena::counters() const {
  absl::MutexLock lock(&mu_);
  return KvArenaCounters{num_pages_, free_, num_pages_ - free_ - quarantined_, quarantined_};
}

}  // namespace fluxion::decode

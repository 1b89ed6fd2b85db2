#include "transfer/transport.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "transfer/transport_internal.h"

namespace fluxion::transfer {
namespace {

// Descriptor blob: magic, format version, then the fields in declaration order. Integers are
// little-endian; strings are a uint32 length and the bytes. A new field means a new format version.
constexpr char kMagic[4] = {'F', 'L', 'X', 'D'};
constexpr uint32_t kBlobFormat = 1;
// Guards ParseDescriptor against absurd lengths from a corrupt blob.
constexpr uint32_t kMaxFieldBytes = 1u << 20;

class BlobWriter {
 public:
  void U32(uint32_t v) {
    for (int i = 0; i < 4; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  void U64(uint64_t v) {
    for (int i = 0; i < 8; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  void Str(absl::string_view s) {
    U32(static_cast<uint32_t>(s.size()));
    out_.append(s.data(), s.size());
  }
  void Raw(const char* p, size_t n) { out_.append(p, n); }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

class BlobReader {
 public:
  explicit BlobReader(absl::string_view in) : in_(in) {}
  bool U32(uint32_t* v) {
    if (in_.size() < 4) return false;
    *v = 0;
    for (int i = 0; i < 4; ++i)
      *v |= static_cast<uint32_t>(static_cast<uint8_t>(in_[i])) << (8 * i);
    in_.remove_prefix(4);
    return true;
  }
  bool U64(uint64_t* v) {
    if (in_.size() < 8) return false;
    *v = 0;
    for (int i = 0; i < 8; ++i)
      *v |= static_cast<uint64_t>(static_cast<uint8_t>(in_[i])) << (8 * i);
    in_.remove_prefix(8);
    return true;
  }
  bool Str(std::string* s) {
    uint32_t n;
    if (!U32(&n) || n > kMaxFieldBytes || in_.size() < n) return false;
    s->assign(in_.data(), n);
    in_.remove_prefix(n);
    return true;
  }
  bool Raw(size_t n, absl::string_view* s) {
    if (in_.size() < n) return false;
    *s = in_.substr(0, n);
    in_.remove_prefix(n);
    return true;
  }
  bool empty() const { return in_.empty(); }

 private:
  absl::string_view in_;
};

template <typename T>
absl::Status Mismatch(absl::string_view field, const T& local, const T& remote) {
  return absl::FailedPreconditionError(
      absl::StrCat("incompatible peer: ", field, " is ", local, " here, ", remote, " at peer"));
}

}  // namespace

bool CompatibilityRecord::operator==(const CompatibilityRecord& o) const {
  return protocol_version == o.protocol_version && model_id == o.model_id &&
         kv_dtype == o.kv_dtype && num_layers == o.num_layers && num_kv_heads == o.num_kv_heads &&
         head_dim == o.head_dim && page_tokens == o.page_tokens &&
         layout_version == o.layout_version;
}

absl::Status CheckCompatible(const CompatibilityRecord& local, const CompatibilityRecord& remote) {
  // Protocol first: with a different protocol the other fields may not mean the same thing.
  if (local.protocol_version != remote.protocol_version) {
    return Mismatch("protocol_version", local.protocol_version, remote.protocol_version);
  }
  if (local.model_id != remote.model_id) {
    return Mismatch("model_id", absl::StrCat("'", local.model_id, "'"),
                    absl::StrCat("'", remote.model_id, "'"));
  }
  if (local.kv_dtype != remote.kv_dtype)
    return Mismatch("kv_dtype", local.kv_dtype, remote.kv_dtype);
  if (local.num_layers != remote.num_layers) {
    return Mismatch("num_layers", local.num_layers, remote.num_layers);
  }
  if (local.num_kv_heads != remote.num_kv_heads) {
    return Mismatch("num_kv_heads", local.num_kv_heads, remote.num_kv_heads);
  }
  if (local.head_dim != remote.head_dim)
    return Mismatch("head_dim", local.head_dim, remote.head_dim);
  if (local.page_tokens != remote.page_tokens) {
    return Mismatch("page_tokens", local.page_tokens, remote.page_tokens);
  }
  if (local.layout_version != remote.layout_version) {
    return Mismatch("layout_version", local.layout_version, remote.layout_version);
  }
  return absl::OkStatus();
}

std::string SerializeDescriptor(const PeerDescriptor& d) {
  BlobWriter w;
  w.Raw(kMagic, sizeof(kMagic));
  w.U32(kBlobFormat);
  w.Str(d.peer_name);
  w.Str(d.transport);
  w.Str(d.worker_address);
  w.Str(d.remote_key);
  w.U64(d.base_address);
  w.U64(d.length);
  w.U32(d.compat.protocol_version);
  w.Str(d.compat.model_id);
  w.U32(d.compat.kv_dtype);
  w.U32(d.compat.num_layers);
  w.U32(d.compat.num_kv_heads);
  w.U32(d.compat.head_dim);
  w.U32(d.compat.page_tokens);
  w.U32(d.compat.layout_version);
  return w.Take();
}

absl::StatusOr<PeerDescriptor> ParseDescriptor(absl::string_view blob) {
  BlobReader r(blob);
  absl::string_view magic;
  if (!r.Raw(sizeof(kMagic), &magic) || magic != absl::string_view(kMagic, sizeof(kMagic))) {
    return absl::InvalidArgumentError("not a transfer descriptor (bad magic)");
  }
  uint32_t format;
  if (!r.U32(&format)) return absl::InvalidArgumentError("truncated transfer descriptor");
  if (format != kBlobFormat) {
    return absl::InvalidArgumentError(absl::StrCat("transfer descriptor format ", format,
                                                   " (this build reads ", kBlobFormat, ")"));
  }
  PeerDescriptor d;
  CompatibilityRecord& c = d.compat;
  const bool ok = r.Str(&d.peer_name) && r.Str(&d.transport) && r.Str(&d.worker_address) &&
                  r.Str(&d.remote_key) && r.U64(&d.base_address) && r.U64(&d.length) &&
                  r.U32(&c.protocol_version) && r.Str(&c.model_id) && r.U32(&c.kv_dtype) &&
                  r.U32(&c.num_layers) && r.U32(&c.num_kv_heads) && r.U32(&c.head_dim) &&
                  r.U32(&c.page_tokens) && r.U32(&c.layout_version);
  if (!ok) return absl::InvalidArgumentError("truncated transfer descriptor");
  if (!r.empty()) return absl::InvalidArgumentError("trailing bytes after transfer descriptor");
  return d;
}

std::vector<BlockCopy> CoalesceCopies(absl::Span<const BlockCopy> copies) {
  std::vector<BlockCopy> out;
  out.reserve(copies.size());
  for (const BlockCopy& c : copies) {
    if (!out.empty()) {
      BlockCopy& last = out.back();
      const auto last_local = reinterpret_cast<uintptr_t>(last.local_addr);
      if (last.remote_addr + last.length == c.remote_addr &&
          last_local + last.length == reinterpret_cast<uintptr_t>(c.local_addr)) {
        last.length += c.length;
        continue;
      }
    }
    out.push_back(c);
  }
  return out;
}

namespace internal {

void MetricsRecorder::AddSubmitted(uint64_t copies, uint64_t ops) {
  copies_submitted_.fetch_add(copies, std::memory_order_relaxed);
  ops_issued_.fetch_add(ops, std::memory_order_relaxed);
  batches_submitted_.fetch_add(1, std::memory_order_relaxed);
}

void MetricsRecorder::AddCompleted(uint64_t bytes, absl::Duration latency) {
  bytes_written_.fetch_add(bytes, std::memory_order_relaxed);
  batches_completed_.fetch_add(1, std::memory_order_relaxed);
  const uint64_t us =
      static_cast<uint64_t>(std::max<int64_t>(0, absl::ToInt64Microseconds(latency)));
  latency_sum_us_.fetch_add(us, std::memory_order_relaxed);
  const auto& bounds = TransportMetrics::kLatencyBoundsUs;
  const size_t bucket = std::lower_bound(bounds.begin(), bounds.end(), us) - bounds.begin();
  latency_buckets_[bucket].fetch_add(1, std::memory_order_relaxed);
}

void MetricsRecorder::AddFailure(Failure cause) {
  failures_[static_cast<int>(cause)].fetch_add(1, std::memory_order_relaxed);
}

void MetricsRecorder::AddFailure(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
      return AddFailure(Failure::kInvalidArgument);
    case absl::StatusCode::kFailedPrecondition:
      return AddFailure(Failure::kIncompatible);
    case absl::StatusCode::kUnavailable:
      return AddFailure(Failure::kUnavailable);
    case absl::StatusCode::kDeadlineExceeded:
      return AddFailure(Failure::kDeadline);
    default:
      return AddFailure(Failure::kOther);
  }
}

void MetricsRecorder::AddRegistration(int64_t count, int64_t bytes) {
  registrations_.fetch_add(count, std::memory_order_relaxed);
  registered_bytes_.fetch_add(bytes, std::memory_order_relaxed);
}

void MetricsRecorder::AddLanded(uint64_t bytes) {
  landed_bytes_.fetch_add(bytes, std::memory_order_relaxed);
}

void MetricsRecorder::AddLandingRefused() {
  landing_refused_.fetch_add(1, std::memory_order_relaxed);
}

void MetricsRecorder::AddLandingRevokeTimeout() {
  landing_revoke_timeouts_.fetch_add(1, std::memory_order_relaxed);
}

TransportMetrics MetricsRecorder::Snapshot() const {
  TransportMetrics m;
  m.bytes_written = bytes_written_.load(std::memory_order_relaxed);
  m.copies_submitted = copies_submitted_.load(std::memory_order_relaxed);
  m.ops_issued = ops_issued_.load(std::memory_order_relaxed);
  m.batches_submitted = batches_submitted_.load(std::memory_order_relaxed);
  m.batches_completed = batches_completed_.load(std::memory_order_relaxed);
  m.registrations = static_cast<uint64_t>(registrations_.load(std::memory_order_relaxed));
  m.registered_bytes = static_cast<uint64_t>(registered_bytes_.load(std::memory_order_relaxed));
  m.failed_invalid_argument = failures_[static_cast<int>(Failure::kInvalidArgument)].load();
  m.failed_incompatible = failures_[static_cast<int>(Failure::kIncompatible)].load();
  m.failed_unavailable = failures_[static_cast<int>(Failure::kUnavailable)].load();
  m.failed_deadline = failures_[static_cast<int>(Failure::kDeadline)].load();
  m.failed_other = failures_[static_cast<int>(Failure::kOther)].load();
  for (size_t i = 0; i < m.latency_buckets.size(); ++i) {
    m.latency_buckets[i] = latency_buckets_[i].load(std::memory_order_relaxed);
  }
  m.latency_sum_us = latency_sum_us_.load(std::memory_order_relaxed);
  m.landed_bytes = landed_bytes_.load(std::memory_order_relaxed);
  m.landing_refused = landing_refused_.load(std::memory_order_relaxed);
  m.landing_revoke_timeouts = landing_revoke_timeouts_.load(std::memory_order_relaxed);
  return m;
}

CompletionState::CompletionState(std::shared_ptr<MetricsRecorder> metrics, uint64_t bytes,
                                 bool is_batch)
    : metrics_(std::move(metrics)), bytes_(bytes), is_batch_(is_batch), start_(absl::Now()) {}

void CompletionState::Complete(absl::Status status) {
  absl::MutexLock lock(&mu_);
  if (done_) return;
  // Metrics first, so that a waiter released below already sees them counted.
  if (is_batch_) {
    if (status.ok()) {
      metrics_->AddCompleted(bytes_, absl::Now() - start_);
    } else {
      metrics_->AddFailure(status);
    }
  }
  done_ = true;
  status_ = std::move(status);
}

bool CompletionState::done() const {
  absl::MutexLock lock(&mu_);
  return done_;
}

absl::StatusOr<bool> CompletionState::Poll() const {
  absl::MutexLock lock(&mu_);
  if (!done_) return false;
  if (!status_.ok()) return status_;
  return true;
}

absl::Status CompletionState::Wait(absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  if (!mu_.AwaitWithTimeout(absl::Condition(&done_), timeout)) {
    metrics_->AddFailure(MetricsRecorder::Failure::kDeadline);
    return absl::DeadlineExceededError(absl::StrCat(
        "transfer of ", bytes_, " bytes still in flight after ", absl::FormatDuration(timeout)));
  }
  return status_;
}

void LocalRegistry::Add(uint64_t id, uintptr_t base, size_t length, void* cookie) {
  absl::MutexLock lock(&mu_);
  by_base_.emplace(base, Entry{id, length, cookie});
  max_length_ = std::max(max_length_, length);
}

void LocalRegistry::Remove(uint64_t id) {
  absl::MutexLock lock(&mu_);
  for (auto it = by_base_.begin(); it != by_base_.end(); ++it) {
    if (it->second.id == id) {
      by_base_.erase(it);
      return;
    }
  }
}

absl::StatusOr<void*> LocalRegistry::Find(uintptr_t addr, size_t length) const {
  absl::ReaderMutexLock lock(&mu_);
  // Entries are ordered by base; a containing entry starts at or before addr and no more than
  // max_length_ bytes before it.
  auto it = by_base_.upper_bound(addr);
  while (it != by_base_.begin()) {
    --it;
    if (addr - it->first > max_length_) break;
    if (RangeInside(addr, length, it->first, it->second.length)) return it->second.cookie;
  }
  return absl::NotFoundError("no local registration contains the range");
}

bool RangeInside(uint64_t addr, uint64_t length, uint64_t base, uint64_t limit) {
  return addr >= base && length <= limit && addr - base <= limit - length;
}

absl::Status ValidateBatch(absl::Span<const BlockCopy> copies, uint64_t remote_base,
                           uint64_t remote_length, const LocalRegistry& local) {
  for (size_t i = 0; i < copies.size(); ++i) {
    const BlockCopy& c = copies[i];
    if (c.length == 0 || c.local_addr == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("copy ", i, " of ", copies.size(), ": empty copy (length ", c.length, ")"));
    }
    if (!RangeInside(c.remote_addr, c.length, remote_base, remote_length)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "copy ", i, " of ", copies.size(), ": remote range [0x", absl::Hex(c.remote_addr), ", +",
          c.length, ") lies outside the peer's registered range [0x", absl::Hex(remote_base), ", +",
          remote_length, ")"));
    }
    if (!local.Find(reinterpret_cast<uintptr_t>(c.local_addr), c.length).ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("copy ", i, " of ", copies.size(), ": local range [",
                       absl::Hex(reinterpret_cast<uintptr_t>(c.local_addr)), ", +", c.length,
                       ") lies in no registration of this transport"));
    }
  }
  return absl::OkStatus();
}

uint64_t TotalBytes(absl::Span<const BlockCopy> copies) {
  uint64_t n = 0;
  for (const BlockCopy& c : copies) n += c.length;
  return n;
}

}  // namespace internal
}  // namespace fluxion::transfer

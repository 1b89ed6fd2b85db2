#include "transfer/loopback_transport.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <new>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "transfer/descriptor_check.h"

namespace fluxion::transfer {
namespace loopback_internal {

// One transport's memory as seen by writers: its live registrations and, while progress is
// paused, the batches waiting to land. Shared by the owning transport and (weakly) by the peers
// that connected to it, so that a peer outliving it finds it gone instead of dangling.
class Core {
 public:
  Core(uint64_t id, std::string name, std::shared_ptr<internal::MetricsRecorder> metrics)
      : id_(id), name_(std::move(name)), metrics_(std::move(metrics)) {}

  uint64_t id() const { return id_; }
  const std::string& name() const { return name_; }

  void AddRegistration(uint64_t reg, uintptr_t base, size_t length) {
    absl::MutexLock lock(&mu_);
    regs_[reg] = Range{base, length};
  }
  void RemoveRegistration(uint64_t reg) {
    absl::MutexLock lock(&mu_);
    regs_.erase(reg);
  }

  // OK if `reg` is live and covers [base, base + length).
  absl::Status CheckRegistration(uint64_t reg, uint64_t base, uint64_t length) {
    absl::MutexLock lock(&mu_);
    return CheckLocked(reg, base, length);
  }

  // Lands `ops` in registration `reg` now, or queues them while paused. The state is completed
  // here, or later by Resume/Shutdown/Cancel.
  void Deliver(uint64_t reg, std::vector<BlockCopy> ops,
               std::shared_ptr<internal::CompletionState> state) {
    absl::MutexLock lock(&mu_);
    if (!alive_) {
      state->Complete(absl::UnavailableError(absl::StrCat("peer '", name_, "' is gone")));
      return;
    }
    if (paused_) {
      pending_.push_back(Pending{reg, std::move(ops), std::move(state)});
      return;
    }
    Land(reg, ops, *state);
  }

  void SetPaused(bool paused) {
    absl::MutexLock lock(&mu_);
    paused_ = paused;
    if (paused_) return;
    while (!pending_.empty()) {
      Pending p = std::move(pending_.front());
      pending_.pop_front();
      Land(p.reg, p.ops, *p.state);
    }
  }

  size_t Queued() {
    absl::MutexLock lock(&mu_);
    return pending_.size();
  }

  // Removes a queued batch (its writer is going away); completes it with `why`.
  void Cancel(const internal::CompletionState* state, const absl::Status& why) {
    absl::MutexLock lock(&mu_);
    for (auto it = pending_.begin(); it != pending_.end(); ++it) {
      if (it->state.get() == state) {
        it->state->Complete(why);
        pending_.erase(it);
        return;
      }
    }
  }

  // The owning transport is going away: fail everything queued, refuse everything later.
  void Shutdown() {
    absl::MutexLock lock(&mu_);
    alive_ = false;
    for (Pending& p : pending_) {
      p.state->Complete(absl::UnavailableError(
          absl::StrCat("peer '", name_, "' was destroyed before the copies landed")));
    }
    pending_.clear();
    regs_.clear();
  }

 private:
  struct Range {
    uintptr_t base;
    size_t length;
  };
  struct Pending {
    uint64_t reg;
    std::vector<BlockCopy> ops;
    std::shared_ptr<internal::CompletionState> state;
  };

  absl::Status CheckLocked(uint64_t reg, uint64_t base, uint64_t length)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = regs_.find(reg);
    if (it == regs_.end()) {
      return absl::FailedPreconditionError(absl::StrCat("peer '", name_, "' has no registration ",
                                                        reg, " (revoked, or a stale descriptor)"));
    }
    if (!internal::RangeInside(base, length, it->second.base, it->second.length)) {
      return absl::InvalidArgumentError(absl::StrCat("range [0x", absl::Hex(base), ", +", length,
                                                     ") lies outside registration ", reg,
                                                     " of peer '", name_, "'"));
    }
    return absl::OkStatus();
  }

  // Re-checks every op against the registration as it is now (it may have been revoked since
  // Write() validated the batch against the descriptor), then copies.
  void Land(uint64_t reg, const std::vector<BlockCopy>& ops, internal::CompletionState& state)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (state.done()) return;  // cancelled while queued
    for (const BlockCopy& op : ops) {
      absl::Status s = CheckLocked(reg, op.remote_addr, op.length);
      if (!s.ok()) {
        for (size_t i = 0; i < ops.size(); ++i) metrics_->AddLandingRefused();
        state.Complete(absl::FailedPreconditionError(s.message()));
        return;
      }
    }
    for (const BlockCopy& op : ops) {
      std::memcpy(reinterpret_cast<void*>(static_cast<uintptr_t>(op.remote_addr)), op.local_addr,
                  op.length);
      metrics_->AddLanded(op.length);
    }
    state.Complete(absl::OkStatus());
  }

  const uint64_t id_;
  const std::string name_;
  const std::shared_ptr<internal::MetricsRecorder> metrics_;  // the owning transport's
  absl::Mutex mu_;
  bool alive_ ABSL_GUARDED_BY(mu_) = true;
  bool paused_ ABSL_GUARDED_BY(mu_) = false;
  std::map<uint64_t, Range> regs_ ABSL_GUARDED_BY(mu_);
  std::deque<Pending> pending_ ABSL_GUARDED_BY(mu_);
};

namespace {

// Every loopback transport of the process, by id: the "network" descriptors name peers on.
// Leaked on purpose so that transports destroyed during static destruction still find it.
struct Hub {
  absl::Mutex mu;
  std::map<uint64_t, std::weak_ptr<Core>> cores ABSL_GUARDED_BY(mu);
  std::atomic<uint64_t> next_id{1};
};

Hub& GetHub() {
  static Hub* hub = new Hub;
  return *hub;
}

std::string EncodeId(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

absl::StatusOr<uint64_t> DecodeId(absl::string_view s, absl::string_view what) {
  if (s.size() != 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("loopback ", what, " has ", s.size(), " bytes, expected 8"));
  }
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(s[i])) << (8 * i);
  return v;
}

class LoopbackRemoteTarget final : public RemoteTarget {
 public:
  LoopbackRemoteTarget(const LoopbackTransport* owner, std::string peer_name,
                       std::weak_ptr<Core> core, uint64_t reg, uint64_t base, uint64_t length)
      : owner_(owner),
        peer_name_(std::move(peer_name)),
        core_(std::move(core)),
        reg_(reg),
        base_(base),
        length_(length) {}
  const std::string& peer_name() const override { return peer_name_; }
  uint64_t base_address() const override { return base_; }
  uint64_t length() const override { return length_; }

  const LoopbackTransport* owner() const { return owner_; }
  const std::weak_ptr<Core>& core() const { return core_; }
  uint64_t reg() const { return reg_; }

 private:
  const LoopbackTransport* const owner_;
  const std::string peer_name_;
  const std::weak_ptr<Core> core_;
  const uint64_t reg_;
  const uint64_t base_;
  const uint64_t length_;
};

}  // namespace
}  // namespace loopback_internal

using loopback_internal::Core;
using loopback_internal::GetHub;
using loopback_internal::Hub;

class LoopbackRegistration final : public Registration {
 public:
  LoopbackRegistration(LoopbackTransport* owner, uint64_t id, MemoryRegion region,
                       bool remote_write)
      : owner_(owner), id_(id), region_(region), remote_write_(remote_write) {}
  ~LoopbackRegistration() override { owner_->Deregister(id_, region_.length); }

  MemoryRegion region() const override { return region_; }

  absl::StatusOr<PeerDescriptor> Describe() const override {
    if (!remote_write_) {
      return absl::FailedPreconditionError("registration was made without remote_write");
    }
    PeerDescriptor d;
    d.peer_name = owner_->options_.node_name;
    d.transport = "loopback";
    // The same envelopes as UCX's blobs (descriptor_check.h), around 8-byte ids.
    d.worker_address =
        WrapBlob(BlobField::kWorkerAddress, loopback_internal::EncodeId(owner_->core_->id()));
    d.remote_key = WrapBlob(BlobField::kRemoteKey, loopback_internal::EncodeId(id_),
                            reinterpret_cast<uintptr_t>(region_.addr), region_.length);
    d.base_address = reinterpret_cast<uintptr_t>(region_.addr);
    d.length = region_.length;
    d.compat = owner_->options_.compat;
    return d;
  }

 private:
  LoopbackTransport* const owner_;
  const uint64_t id_;
  const MemoryRegion region_;
  const bool remote_write_;
};

LoopbackTransport::LoopbackTransport(const LoopbackOptions& options)
    : options_(options),
      metrics_(std::make_shared<internal::MetricsRecorder>()),
      core_(std::make_shared<Core>(GetHub().next_id.fetch_add(1), options.node_name, metrics_)) {
  Hub& hub = GetHub();
  absl::MutexLock lock(&hub.mu);
  hub.cores[core_->id()] = core_;
}

LoopbackTransport::~LoopbackTransport() {
  {
    Hub& hub = GetHub();
    absl::MutexLock lock(&hub.mu);
    hub.cores.erase(core_->id());
  }
  core_->Shutdown();
  // Our own batches still queued at peers would read our (soon freed) memory: cancel them.
  std::vector<Outstanding> outstanding;
  {
    absl::MutexLock lock(&mu_);
    outstanding.swap(outstanding_);
  }
  const absl::Status why = absl::UnavailableError("writer transport destroyed");
  for (Outstanding& o : outstanding) {
    if (std::shared_ptr<Core> peer = o.peer.lock()) peer->Cancel(o.state.get(), why);
    o.state->Complete(why);
  }
}

absl::StatusOr<std::unique_ptr<Registration>> LoopbackTransport::Register(
    MemoryRegion region, const RegistrationOptions& options) {
  if (region.addr == nullptr || region.length == 0) {
    metrics_->AddFailure(internal::MetricsRecorder::Failure::kInvalidArgument);
    return absl::InvalidArgumentError("cannot register a null or empty region");
  }
  static std::atomic<uint64_t> next_reg{1};
  const uint64_t id = next_reg.fetch_add(1);
  const auto base = reinterpret_cast<uintptr_t>(region.addr);
  local_.Add(id, base, region.length, nullptr);
  if (options.remote_write) core_->AddRegistration(id, base, region.length);
  metrics_->AddRegistration(1, static_cast<int64_t>(region.length));
  return std::unique_ptr<Registration>(
      new LoopbackRegistration(this, id, region, options.remote_write));
}

void LoopbackTransport::Deregister(uint64_t id, size_t length) {
  core_->RemoveRegistration(id);
  local_.Remove(id);
  metrics_->AddRegistration(-1, -static_cast<int64_t>(length));
}

absl::StatusOr<std::unique_ptr<RemoteTarget>> LoopbackTransport::Connect(
    const PeerDescriptor& peer) {
  if (peer.transport != kind()) {
    metrics_->AddFailure(internal::MetricsRecorder::Failure::kInvalidArgument);
    return absl::InvalidArgumentError(absl::StrCat(
        "descriptor of peer '", absl::CHexEscape(peer.peer_name), "' is for transport '",
        absl::CHexEscape(peer.transport.substr(0, kMaxTransportNameBytes)),
        "', this is 'loopback'"));
  }
  // The same checks as UCX's Connect(), so that tests over loopback see the same refusals.
  constexpr size_t kIdBytes = 8;
  absl::StatusOr<UnwrappedBlob> address = absl::InvalidArgumentError("unchecked");
  absl::StatusOr<UnwrappedBlob> key = address;
  absl::Status valid = ValidatePeerDescriptor(peer);
  if (valid.ok()) {
    address = UnwrapBlob(BlobField::kWorkerAddress, peer.worker_address, kIdBytes);
    key = UnwrapBlob(BlobField::kRemoteKey, peer.remote_key, kIdBytes);
    valid = !address.ok() ? address.status() : !key.ok() ? key.status() : CheckKeyScope(peer, *key);
  }
  if (!valid.ok()) {
    metrics_->AddFailure(internal::MetricsRecorder::Failure::kInvalidArgument);
    return valid;
  }
  if (absl::Status s = CheckCompatible(options_.compat, peer.compat); !s.ok()) {
    metrics_->AddFailure(internal::MetricsRecorder::Failure::kIncompatible);
    return absl::Status(s.code(), absl::StrCat("peer '", peer.peer_name, "': ", s.message()));
  }
  absl::StatusOr<uint64_t> core_id = loopback_internal::DecodeId(address->payload, "address");
  absl::StatusOr<uint64_t> reg = loopback_internal::DecodeId(key->payload, "remote key");
  if (!core_id.ok() || !reg.ok()) {
    metrics_->AddFailure(internal::MetricsRecorder::Failure::kInvalidArgument);
    return !core_id.ok() ? core_id.status() : reg.status();
  }
  std::shared_ptr<Core> core;
  {
    Hub& hub = GetHub();
    absl::MutexLock lock(&hub.mu);
    auto it = hub.cores.find(*core_id);
    if (it != hub.cores.end()) core = it->second.lock();
  }
  if (core == nullptr) {
    metrics_->AddFailure(internal::MetricsRecorder::Failure::kUnavailable);
    return absl::UnavailableError(
        absl::StrCat("peer '", peer.peer_name, "' is not running (loopback id ", *core_id, ")"));
  }
  if (absl::Status s = core->CheckRegistration(*reg, peer.base_address, peer.length); !s.ok()) {
    metrics_->AddFailure(s);
    return s;
  }
  return std::unique_ptr<RemoteTarget>(new loopback_internal::LoopbackRemoteTarget(
      this, peer.peer_name, core, *reg, peer.base_address, peer.length));
}

absl::StatusOr<std::unique_ptr<TransferHandle>> LoopbackTransport::Write(
    const RemoteTarget& target, absl::Span<const BlockCopy> copies, const WriteOptions& options) {
  const auto* t = dynamic_cast<const loopback_internal::LoopbackRemoteTarget*>(&target);
  if (t == nullptr || t->owner() != this) {
    metrics_->AddFailure(internal::MetricsRecorder::Failure::kInvalidArgument);
    return absl::InvalidArgumentError("target was not made by this transport");
  }
  if (absl::Status s = internal::ValidateBatch(copies, t->base_address(), t->length(), local_);
      !s.ok()) {
    metrics_->AddFailure(s);
    return absl::Status(s.code(), absl::StrCat("write to '", t->peer_name(), "': ", s.message()));
  }
  std::shared_ptr<Core> peer = t->core().lock();
  if (peer == nullptr) {
    metrics_->AddFailure(internal::MetricsRecorder::Failure::kUnavailable);
    return absl::UnavailableError(absl::StrCat("peer '", t->peer_name(), "' is gone"));
  }
  std::vector<BlockCopy> ops = options.coalesce
                                   ? CoalesceCopies(copies)
                                   : std::vector<BlockCopy>(copies.begin(), copies.end());
  metrics_->AddSubmitted(copies.size(), ops.size());
  auto state = std::make_shared<internal::CompletionState>(metrics_, internal::TotalBytes(copies));
  {
    // Registered before delivery so that our destructor can always find and cancel it.
    absl::MutexLock lock(&mu_);
    outstanding_.erase(std::remove_if(outstanding_.begin(), outstanding_.end(),
                                      [](const Outstanding& o) { return o.state->done(); }),
                       outstanding_.end());
    outstanding_.push_back(Outstanding{peer, state});
  }
  peer->Deliver(t->reg(), std::move(ops), state);
  return std::unique_ptr<TransferHandle>(new internal::StateHandle(state));
}

absl::Status LoopbackTransport::Flush(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  std::vector<std::shared_ptr<internal::CompletionState>> states;
  {
    absl::MutexLock lock(&mu_);
    for (const Outstanding& o : outstanding_) states.push_back(o.state);
  }
  for (const auto& s : states) {
    absl::Status st = s->Wait(std::max(absl::ZeroDuration(), deadline - absl::Now()));
    if (absl::IsDeadlineExceeded(st)) {
      return absl::DeadlineExceededError(
          absl::StrCat("flush: batches still in flight after ", absl::FormatDuration(timeout)));
    }
  }
  return absl::OkStatus();
}

void LoopbackTransport::SetProgressPausedForTesting(bool paused) { core_->SetPaused(paused); }

size_t LoopbackTransport::QueuedWritesForTesting() const { return core_->Queued(); }

std::unique_ptr<Transport> NewLoopbackTransport(const LoopbackOptions& options) {
  return std::make_unique<LoopbackTransport>(options);
}

}  // namespace fluxion::transfer

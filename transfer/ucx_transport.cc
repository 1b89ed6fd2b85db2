#include "transfer/ucx_transport.h"

#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <sys/shm.h>
#include <sys/stat.h>
#include <unistd.h>
#include <ucs/algorithm/crc.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "glog/logging.h"
#include "transfer/descriptor_check.h"
#include "transfer/transport_internal.h"
#include "transfer/ucx_handles.h"

namespace fluxion::transfer {
namespace {

using internal::MetricsRecorder;

uint64_t ReadLe(absl::string_view bytes, size_t offset, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) {
    v |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[offset + i])) << (8 * i);
  }
  return v;
}

// UCX 1.13's shared-memory components attach the peer's segment while unpacking a key (sysv:
// shmat of the key's shmid; posix: open + mmap of the file the key names), and when that fails,
// ucp_ep_rkey_unpack's error path crashes in ucp_rkey_destroy (uct_rkey_release on a key never
// unpacked: UcxBlobTest.FlippedAllocatedKeysNeverCrash found it with one flipped shmid bit).
// After a successful attach, puts are direct copies into the mapping at an offset computed from
// the key's owner address, so a forged owner address would aim our copies anywhere in this
// process. So before UCX sees such a key we check, as UCX's attach will, that the segment exists
// and we may map it read-write, and that the descriptor's range lies inside it.
// (layouts: uct_sysv_packed_rkey_t and uct_posix_packed_rkey_t, src/uct/sm/mm at v1.13.1)
constexpr size_t kSysvKeyBytes = 12;   // int shmid, uintptr_t owner_ptr
constexpr size_t kPosixKeyBytes = 24;  // uint64_t seg_id, uintptr_t address, size_t length
constexpr uint64_t kPosixProcfs = uint64_t{1} << 63;
constexpr uint64_t kPosixShmOpen = uint64_t{1} << 62;
constexpr uint64_t kPosixPidNs = uint64_t{1} << 60;
constexpr uint64_t kPosixFlags = uint64_t{0xf} << 60;

absl::Status CheckSysvKey(const PeerDescriptor& peer, absl::string_view key) {
  if (key.size() != kSysvKeyBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("sysv key record has ", key.size(), " bytes, expected ", kSysvKeyBytes));
  }
  const int shmid = static_cast<int32_t>(ReadLe(key, 0, 4));
  const uint64_t owner = ReadLe(key, 4, 8);
  shmid_ds ds = {};
  if (shmctl(shmid, IPC_STAT, &ds) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "names System V segment ", shmid, ", which does not exist here or is not ours to read"));
  }
  if (!internal::RangeInside(peer.base_address, peer.length, owner, ds.shm_segsz)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "range [0x", absl::Hex(peer.base_address), ", +", peer.length,
        ") lies outside System V segment ", shmid, " [0x", absl::Hex(owner), ", +",
        ds.shm_segsz, ")"));
  }
  void* attached = shmat(shmid, nullptr, 0);
  if (attached == reinterpret_cast<void*>(-1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("System V segment ", shmid, " cannot be attached read-write here"));
  }
  shmdt(attached);
  return absl::OkStatus();
}

absl::Status CheckPosixKey(const PeerDescriptor& peer, absl::string_view key) {
  if (key.size() < kPosixKeyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("posix key record has ", key.size(),
                                                   " bytes, at least ", kPosixKeyBytes,
                                                   " expected"));
  }
  const uint64_t seg_id = ReadLe(key, 0, 8);
  const uint64_t owner = ReadLe(key, 8, 8);
  const uint64_t length = ReadLe(key, 16, 8);
  const uint64_t mmid = seg_id & ~kPosixFlags;
  if (seg_id & kPosixPidNs) {
    return absl::InvalidArgumentError("posix key of a peer in another PID namespace (unchecked)");
  }
  if (length == 0 || !internal::RangeInside(peer.base_address, peer.length, owner, length)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "range [0x", absl::Hex(peer.base_address), ", +", peer.length,
        ") lies outside the posix segment [0x", absl::Hex(owner), ", +", length, ")"));
  }
  std::string path;
  if (seg_id & kPosixProcfs) {
    path = absl::StrCat("/proc/", mmid & ((uint64_t{1} << 30) - 1), "/fd/", mmid >> 30);
  } else if (seg_id & kPosixShmOpen) {
    path = absl::StrCat("/dev/shm/ucx_shm_posix_", absl::Hex(mmid));
  } else {
    const absl::string_view rest = key.substr(kPosixKeyBytes);
    const size_t nul = rest.find('\0');
    if (nul == absl::string_view::npos) {
      return absl::InvalidArgumentError("posix key record's directory is not terminated");
    }
    path = absl::StrCat(rest.substr(0, nul), "/ucx_shm_posix_", absl::Hex(mmid));
  }
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("names posix segment ", path, ", which cannot be opened read-write here"));
  }
  struct stat st = {};
  const bool big_enough = fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_size) >= length;
  close(fd);
  if (!big_enough) {
    return absl::InvalidArgumentError(
        absl::StrCat("posix segment ", path, " is smaller than the key's ", length, " bytes"));
  }
  return absl::OkStatus();
}

// The per-domain records of `key` that UCX would attach: those whose memory domain the peer's
// address lists with a sysv or posix transport.
absl::Status CheckSharedMemoryKeys(const PeerDescriptor& peer, absl::string_view address,
                                   absl::string_view key) {
  static const uint16_t kSysv = ucs_crc16_string("sysv");
  static const uint16_t kPosix = ucs_crc16_string("posix");
  absl::StatusOr<std::vector<UcxAddressRecord>> transports = ParseUcxWorkerAddress(address);
  absl::StatusOr<std::vector<UcxKeyRecord>> records = ParseUcxRemoteKey(key);
  if (!transports.ok()) return transports.status();
  if (!records.ok()) return records.status();
  for (const UcxKeyRecord& r : *records) {
    // Every transport record naming this md index, not only the first: UCX picks the component
    // that unpacks the key from the address, and a hostile address can give one md index to
    // several transports (a flipped md index did: a 0-byte "self" key record unpacked as sysv).
    bool sysv = false, posix = false;
    for (const UcxAddressRecord& t : *transports) {
      if (t.md_index != r.md_index) continue;
      sysv |= t.tl_name_checksum == kSysv;
      posix |= t.tl_name_checksum == kPosix;
    }
    absl::Status s = absl::OkStatus();
    if (sysv) s = CheckSysvKey(peer, r.bytes);
    if (s.ok() && posix) s = CheckPosixKey(peer, r.bytes);
    if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat("md ", r.md_index, " ", s.message()));
  }
  return absl::OkStatus();
}

class UcxTransportImpl;

// One remote worker: the cached endpoint to it. Lives as long as the transport (the endpoint's
// error callback holds its address), even after the endpoint failed or was replaced.
struct Peer {
  UcxTransportImpl* owner = nullptr;
  std::string name;
  // The validated worker address plus kUcxBlobPadding zero bytes: what ucp_ep_create read.
  std::string padded_address;
  ucp_ep_h ep = nullptr;  // null once closed
  bool failed = false;
  absl::Status failure;
  // Connect()'s round trip completed once on this endpoint: later descriptors of the same peer
  // (one per reservation run) connect without another one.
  bool proved = false;
};

// An unpacked remote key, shared by the RemoteTarget and the batches in flight with it. Its last
// owner hands the key to the transport's graveyard: the key is destroyed later under the worker
// lock (releasing it here could happen inside a UCX callback, with the lock already held).
class RemoteKey {
 public:
  RemoteKey(UcxTransportImpl* owner, ucp_rkey_h rkey) : owner_(owner), rkey_(rkey) {}
  ~RemoteKey();
  RemoteKey(const RemoteKey&) = delete;
  RemoteKey& operator=(const RemoteKey&) = delete;
  ucp_rkey_h get() const { return rkey_; }

 private:
  UcxTransportImpl* const owner_;
  ucp_rkey_h rkey_;
};

class UcxRemoteTarget final : public RemoteTarget {
 public:
  UcxRemoteTarget(UcxTransportImpl* owner, Peer* peer, std::shared_ptr<RemoteKey> key,
                  uint64_t base, uint64_t length);
  ~UcxRemoteTarget() override;
  const std::string& peer_name() const override { return peer_->name; }
  uint64_t base_address() const override { return base_; }
  uint64_t length() const override { return length_; }

  UcxTransportImpl* owner() const { return owner_; }
  Peer* peer() const { return peer_; }
  const std::shared_ptr<RemoteKey>& key() const { return key_; }

 private:
  UcxTransportImpl* const owner_;
  Peer* const peer_;
  const std::shared_ptr<RemoteKey> key_;
  const uint64_t base_;
  const uint64_t length_;
};

class UcxRegistration final : public Registration {
 public:
  // `wrapped_key`: the packed rkey in our envelope (WrapBlob), scoped to `region`.
  UcxRegistration(UcxTransportImpl* owner, uint64_t id, MemoryRegion region,
                  std::unique_ptr<ucx::MemoryHandle> memory, std::string wrapped_key,
                  bool remote_write)
      : owner_(owner),
        id_(id),
        region_(region),
        memory_(std::move(memory)),
        wrapped_key_(std::move(wrapped_key)),
        remote_write_(remote_write) {}
  ~UcxRegistration() override;
  MemoryRegion region() const override { return region_; }
  absl::StatusOr<PeerDescriptor> Describe() const override;

 private:
  UcxTransportImpl* const owner_;
  const uint64_t id_;
  const MemoryRegion region_;
  std::unique_ptr<ucx::MemoryHandle> memory_;
  const std::string wrapped_key_;
  const bool remote_write_;
};

// One submitted batch (or a Flush) waiting for its flush request's callback.
struct InflightOp {
  UcxTransportImpl* owner = nullptr;
  std::shared_ptr<internal::CompletionState> state;
  std::shared_ptr<RemoteKey> key;      // keeps the remote key alive while puts may use it
  Peer* peer = nullptr;                // null for a worker flush
  absl::Status issue_error;            // a put that failed to post; reported once the flush is done
  std::unique_ptr<uint8_t[]> scratch;  // Connect()'s probe reads into it
};

class UcxTransportImpl final : public UcxTransport {
 public:
  explicit UcxTransportImpl(const UcxOptions& options)
      : options_(options), metrics_(std::make_shared<MetricsRecorder>()) {}
  ~UcxTransportImpl() override;

  absl::Status Init();

  absl::StatusOr<std::unique_ptr<Registration>> Register(
      MemoryRegion region, const RegistrationOptions& options) override;
  absl::StatusOr<std::unique_ptr<Registration>> Allocate(
      size_t length, const RegistrationOptions& options) override;
  absl::StatusOr<std::unique_ptr<RemoteTarget>> Connect(const PeerDescriptor& peer) override;
  absl::StatusOr<std::unique_ptr<TransferHandle>> Write(const RemoteTarget& target,
                                                        absl::Span<const BlockCopy> copies,
                                                        const WriteOptions& options) override;
  absl::Status Flush(absl::Duration timeout) override;
  TransportMetrics metrics() const override { return metrics_->Snapshot(); }
  absl::StatusOr<std::string> DescribeEndpoint(const RemoteTarget& target) override;
  void SetProgressPausedForTesting(bool paused) override;

  // Called by the objects this transport hands out.
  void Deregister(uint64_t id, std::unique_ptr<ucx::MemoryHandle> memory, size_t length);
  void Bury(ucp_rkey_h rkey);
  void ObjectDestroyed() { live_objects_.fetch_sub(1); }
  const UcxOptions& options() const { return options_; }
  const std::string& wrapped_worker_address() const { return wrapped_worker_address_; }
  uint64_t ConnectProbesForTesting() const override { return probes_.load(); }

 private:
  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);
  static void OnFlushDone(void* request, ucs_status_t status, void* user_data);

  void ProgressLoop();
  // Register()/Allocate(): maps (`region.addr` non-null) or allocates, packs the key, records it.
  absl::StatusOr<std::unique_ptr<Registration>> MapAndRecord(MemoryRegion region,
                                                             const RegistrationOptions& options);
  bool MayProgress() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !paused_; }
  // Completes `op` with `status` (or its own issue error) and forgets it.
  void FinishOp(InflightOp* op, ucs_status_t status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes the flush request that ends a batch, a Flush() or a Connect() probe: completes `op` at
  // once if UCX did, else keeps it until OnFlushDone.
  void TrackFlush(std::unique_ptr<InflightOp> op, ucs_status_ptr_t request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CloseEndpoint(Peer* peer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The cached peer for `peer`'s worker address, creating its endpoint if there is none.
  // Unavailable if the peer is known dead.
  absl::StatusOr<Peer*> FindOrCreatePeer(const PeerDescriptor& peer, const std::string& address)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Everything Connect() checks before UCX sees a byte of `peer`: the fields, both envelopes, the
  // key's scope and the structure of the UCX address and key. On success, the unwrapped blobs.
  absl::Status CheckDescriptor(const PeerDescriptor& peer, std::string* address,
                               std::string* key) const;
  // Frees finished close requests; destroys buried remote keys.
  void Reap() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const UcxOptions options_;
  const std::shared_ptr<MetricsRecorder> metrics_;
  internal::LocalRegistry local_;
  std::atomic<uint64_t> next_registration_{1};
  // Registrations and remote targets handed out and not yet destroyed: they must all be gone
  // before the transport is (they release UCX objects that the worker and context own).
  std::atomic<int64_t> live_objects_{0};

  // The worker lock: every UCX call is made with it held.
  mutable absl::Mutex mu_;
  ucx::ContextPtr context_ ABSL_GUARDED_BY(mu_);
  ucx::WorkerPtr worker_ ABSL_GUARDED_BY(mu_);
  std::string worker_address_;          // set once in Init()
  std::string wrapped_worker_address_;  // set once in Init(): what Describe() hands out
  // Our own address's transport records (set once in Init()): peers' records of the same
  // transports must be at least as long (ValidateUcxWorkerAddress).
  std::vector<UcxAddressRecord> local_records_;
  std::atomic<uint64_t> probes_{0};  // Connect() round trips issued
  int event_fd_ = -1;           // set once in Init(); -1: no wakeup support, poll with sleeps
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool paused_ ABSL_GUARDED_BY(mu_) = false;
  // Peers by worker address. Entries are never erased (see Peer); a failed one stays failed.
  std::map<std::string, std::unique_ptr<Peer>> peers_ ABSL_GUARDED_BY(mu_);
  std::map<InflightOp*, std::unique_ptr<InflightOp>> inflight_ ABSL_GUARDED_BY(mu_);
  std::vector<Peer*> to_close_ ABSL_GUARDED_BY(mu_);
  std::vector<void*> closing_ ABSL_GUARDED_BY(mu_);  // ucp_ep_close_nbx requests

  absl::Mutex graveyard_mu_ ABSL_ACQUIRED_AFTER(mu_);
  std::vector<ucp_rkey_h> graveyard_ ABSL_GUARDED_BY(graveyard_mu_);

  std::thread progress_thread_;
};

RemoteKey::~RemoteKey() { owner_->Bury(rkey_); }

UcxRemoteTarget::UcxRemoteTarget(UcxTransportImpl* owner, Peer* peer,
                                 std::shared_ptr<RemoteKey> key, uint64_t base, uint64_t length)
    : owner_(owner), peer_(peer), key_(std::move(key)), base_(base), length_(length) {}

UcxRemoteTarget::~UcxRemoteTarget() { owner_->ObjectDestroyed(); }

UcxRegistration::~UcxRegistration() {
  owner_->Deregister(id_, std::move(memory_), region_.length);
  owner_->ObjectDestroyed();
}

absl::StatusOr<PeerDescriptor> UcxRegistration::Describe() const {
  if (!remote_write_) {
    return absl::FailedPreconditionError("registration was made without remote_write");
  }
  PeerDescriptor d;
  d.peer_name = owner_->options().node_name;
  d.transport = "ucx";
  d.worker_address = owner_->wrapped_worker_address();
  d.remote_key = wrapped_key_;
  d.base_address = reinterpret_cast<uintptr_t>(region_.addr);
  d.length = region_.length;
  d.compat = owner_->options().compat;
  return d;
}

absl::Status UcxTransportImpl::Init() {
  ucp_config_t* raw_config = nullptr;
  if (ucs_status_t s = ucp_config_read(nullptr, nullptr, &raw_config); s != UCS_OK) {
    return ucx::FromUcs(s, "ucp_config_read");
  }
  ucx::ConfigPtr config(raw_config);
  std::vector<std::pair<std::string, std::string>> settings = {
      {"KEEPALIVE_INTERVAL",
       absl::StrCat(absl::ToInt64Milliseconds(options_.keepalive_interval), "ms")}};
  settings.insert(settings.end(), options_.config.begin(), options_.config.end());
  for (const auto& [key, value] : settings) {
    if (ucs_status_t s = ucp_config_modify(config.get(), key.c_str(), value.c_str()); s != UCS_OK) {
      return absl::InvalidArgumentError(
          absl::StrCat("UCX setting ", key, "=", value, ": ", ucs_status_string(s)));
    }
  }

  absl::MutexLock lock(&mu_);
  ucp_params_t params = {};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  // RMA for puts; WAKEUP so that the progress thread can sleep on an event fd instead of spinning
  // (on 2-core machines a spinning progress thread per transport would starve everything else).
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 0;  // one worker, and our lock serializes context calls too
  ucp_context_h context = nullptr;
  if (ucs_status_t s = ucp_init(&params, config.get(), &context); s != UCS_OK) {
    return ucx::FromUcs(s, "ucp_init");
  }
  context_.reset(context);

  ucp_worker_params_t worker_params = {};
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker_params.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  ucp_worker_h worker = nullptr;
  if (ucs_status_t s = ucp_worker_create(context_.get(), &worker_params, &worker); s != UCS_OK) {
    return ucx::FromUcs(s, "ucp_worker_create");
  }
  worker_.reset(worker);
  if (ucp_worker_get_efd(worker_.get(), &event_fd_) != UCS_OK) {
    LOG(WARNING) << "UCX worker has no event fd; the progress thread will poll";
    event_fd_ = -1;
  }
  absl::StatusOr<std::string> address = ucx::WorkerAddressBytes(worker_.get());
  if (!address.ok()) return address.status();
  worker_address_ = *std::move(address);
  // Our own address must pass the check we apply to peers: if it does not, this UCX packs a
  // format the validator does not know (another UCX version, UCX_UNIFIED_MODE=y), and peers'
  // addresses could not be checked either.
  absl::StatusOr<std::vector<UcxAddressRecord>> records = ParseUcxWorkerAddress(worker_address_);
  if (!records.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "this node's own UCX worker address does not parse as the UCX 1.13 format this build "
        "validates peers against (UCX version ",
        UCP_API_MAJOR, ".", UCP_API_MINOR, " headers; is UCX_UNIFIED_MODE set?): ",
        records.status().message()));
  }
  local_records_ = *std::move(records);
  wrapped_worker_address_ = WrapBlob(BlobField::kWorkerAddress, worker_address_);
  progress_thread_ = std::thread([this] { ProgressLoop(); });
  return absl::OkStatus();
}

UcxTransportImpl::~UcxTransportImpl() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    if (worker_ != nullptr) ucp_worker_signal(worker_.get());
  }
  if (progress_thread_.joinable()) progress_thread_.join();
  CHECK_EQ(live_objects_.load(), 0)
      << "Registrations and RemoteTargets must be destroyed before their UcxTransport";

  absl::MutexLock lock(&mu_);
  if (worker_ == nullptr) return;  // Init() failed before the worker existed
  // Close every endpoint by force. With peer error handling, UCX then fails the endpoint's
  // outstanding requests (our flush callbacks run with UCS_ERR_CANCELED); without it, they stay
  // pending and are completed by hand below. Either way nothing waits for a peer here.
  for (auto& [address, peer] : peers_) CloseEndpoint(peer.get());
  const absl::Time deadline = absl::Now() + options_.shutdown_timeout;
  while (!closing_.empty() && absl::Now() < deadline) {
    ucp_worker_progress(worker_.get());
    Reap();
  }
  if (!closing_.empty()) LOG(WARNING) << closing_.size() << " UCX endpoints did not close in time";
  const absl::Status why = absl::UnavailableError("UCX transport shut down");
  for (auto& [raw, op] : inflight_) {
    op->state->Complete(why);
    op->key.reset();  // remote keys must go before the worker
  }
  Reap();
  // Any callback UCX still owes fires inside ucp_worker_destroy; the ops are still alive then.
  worker_.reset();
  inflight_.clear();
  context_.reset();
}

void UcxTransportImpl::ProgressLoop() {
  const int idle_sleep_ms =
      std::max<int64_t>(1, absl::ToInt64Milliseconds(options_.max_idle_sleep));
  absl::Time last_event = absl::InfinitePast();
  for (;;) {
    enum { kAgain, kYield, kSleepShort, kSleepIdle } next = kAgain;
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
      if (paused_) {
        mu_.AwaitWithTimeout(absl::Condition(this, &UcxTransportImpl::MayProgress),
                             options_.max_idle_sleep);
        continue;
      }
      // Progress in bounded rounds so that writers waiting for the lock get in between.
      unsigned events = 0;
      for (int i = 0; i < 64; ++i) {
        const unsigned n = ucp_worker_progress(worker_.get());
        events += n;
        if (n == 0) break;
      }
      for (Peer* peer : to_close_) CloseEndpoint(peer);
      to_close_.clear();
      Reap();
      const absl::Time now = absl::Now();
      if (events > 0) last_event = now;
      if (events == 0) {
        // Some progress raises no event: a send UCX queued because the peer's shared-memory FIFO
        // was full goes out only when we progress again, and "the FIFO has room" wakes nobody.
        // That holds for our puts and for UCX's own replies on the target side (it answers
        // emulated puts and flushes). Sleeping right away collapsed shared-memory puts to
        // ~0.1 GB/s; so after any event keep polling for busy_poll, and while our batches are in
        // flight sleep at most 1 ms (a hung peer must not cost a whole core). Otherwise arm the
        // worker and sleep until the network or a writer (ucp_worker_signal) wakes us.
        const bool in_flight = !inflight_.empty();
        if (now - last_event < options_.busy_poll) {
          next = kYield;
        } else if (event_fd_ < 0 || ucp_worker_arm(worker_.get()) == UCS_OK) {
          next = in_flight ? kSleepShort : kSleepIdle;
        }  // else UCS_ERR_BUSY: events arrived meanwhile, progress again
      }
    }
    if (next == kAgain) continue;
    if (next == kYield) {
      std::this_thread::yield();
      continue;
    }
    const int timeout_ms = next == kSleepShort ? 1 : idle_sleep_ms;
    if (event_fd_ >= 0) {
      pollfd pfd = {event_fd_, POLLIN, 0};
      poll(&pfd, 1, timeout_ms);
    } else {
      absl::SleepFor(absl::Microseconds(50));
    }
  }
}

void UcxTransportImpl::OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* peer = static_cast<Peer*>(arg);
  UcxTransportImpl* self = peer->owner;
  self->mu_.AssertHeld();  // callbacks run inside ucp_worker_progress, under the worker lock
  if (peer->failed) return;
  peer->failed = true;
  peer->failure = ucx::FromUcs(status, absl::StrCat("peer '", peer->name, "' failed"));
  if (peer->failure.code() != absl::StatusCode::kUnavailable) {
    peer->failure = absl::UnavailableError(peer->failure.message());
  }
  LOG(WARNING) << peer->failure;
  // UCX wants a failed endpoint closed by force; not from inside its own error callback.
  self->to_close_.push_back(peer);
}

void UcxTransportImpl::OnFlushDone(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<InflightOp*>(user_data);
  op->owner->mu_.AssertHeld();
  op->owner->FinishOp(op, status);
  ucp_request_free(request);
}

void UcxTransportImpl::FinishOp(InflightOp* op, ucs_status_t status) {
  absl::Status result = op->issue_error;
  if (result.ok() && status != UCS_OK) {
    if (op->peer != nullptr && op->peer->failed) {
      result = op->peer->failure;
    } else {
      result = ucx::FromUcs(
          status, op->peer != nullptr ? absl::StrCat("write to '", op->peer->name, "'") : "flush");
    }
  }
  op->state->Complete(std::move(result));
  inflight_.erase(op);  // drops its remote key reference (to the graveyard, not destroyed here)
}

void UcxTransportImpl::TrackFlush(std::unique_ptr<InflightOp> op, ucs_status_ptr_t request) {
  if (request == nullptr) {
    FinishOp(op.get(), UCS_OK);  // not in inflight_: erase is a no-op and `op` dies here
    return;
  }
  if (UCS_PTR_IS_ERR(request)) {
    FinishOp(op.get(), UCS_PTR_STATUS(request));
    return;
  }
  InflightOp* raw = op.get();
  inflight_.emplace(raw, std::move(op));
}

void UcxTransportImpl::CloseEndpoint(Peer* peer) {
  if (peer->ep == nullptr) return;
  ucp_request_param_t param = {};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t request = ucp_ep_close_nbx(peer->ep, &param);
  peer->ep = nullptr;
  if (!peer->failed) {
    peer->failed = true;
    peer->failure = absl::UnavailableError(absl::StrCat("endpoint to '", peer->name, "' closed"));
  }
  if (UCS_PTR_IS_PTR(request)) closing_.push_back(request);
}

void UcxTransportImpl::Reap() {
  closing_.erase(std::remove_if(closing_.begin(), closing_.end(),
                                [](void* request) {
                                  if (ucp_request_check_status(request) == UCS_INPROGRESS) {
                                    return false;
                                  }
                                  ucp_request_free(request);
                                  return true;
                                }),
                 closing_.end());
  std::vector<ucp_rkey_h> dead;
  {
    absl::MutexLock lock(&graveyard_mu_);
    dead.swap(graveyard_);
  }
  for (ucp_rkey_h rkey : dead) ucp_rkey_destroy(rkey);
}

void UcxTransportImpl::Bury(ucp_rkey_h rkey) {
  {
    absl::MutexLock lock(&graveyard_mu_);
    graveyard_.push_back(rkey);
  }
  // The progress thread reaps after its next progress round; no need to wake it for this.
}

absl::StatusOr<std::unique_ptr<Registration>> UcxTransportImpl::Register(
    MemoryRegion region, const RegistrationOptions& options) {
  if (region.addr == nullptr || region.length == 0) {
    metrics_->AddFailure(MetricsRecorder::Failure::kInvalidArgument);
    return absl::InvalidArgumentError("cannot register a null or empty region");
  }
  return MapAndRecord(region, options);
}

absl::StatusOr<std::unique_ptr<Registration>> UcxTransportImpl::Allocate(
    size_t length, const RegistrationOptions& options) {
  if (length == 0) {
    metrics_->AddFailure(MetricsRecorder::Failure::kInvalidArgument);
    return absl::InvalidArgumentError("cannot allocate 0 bytes");
  }
  return MapAndRecord({nullptr, length}, options);
}

absl::StatusOr<std::unique_ptr<Registration>> UcxTransportImpl::MapAndRecord(
    MemoryRegion region, const RegistrationOptions& options) {
  const bool allocate = region.addr == nullptr;
  std::unique_ptr<ucx::MemoryHandle> memory;
  std::string packed_key;
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<std::unique_ptr<ucx::MemoryHandle>> mapped =
        allocate ? ucx::MemoryHandle::Allocate(context_.get(), region.length)
                 : ucx::MemoryHandle::Map(context_.get(), region.addr, region.length);
    if (!mapped.ok()) {
      metrics_->AddFailure(mapped.status());
      return mapped.status();
    }
    memory = *std::move(mapped);
    if (allocate) {
      absl::StatusOr<std::pair<void*, size_t>> where = memory->Query();
      if (!where.ok()) {
        memory.reset();
        return where.status();
      }
      region.addr = where->first;
      // UCX may round up; we promise exactly `length`, zeroed.
      std::memset(region.addr, 0, region.length);
    }
    if (options.remote_write) {
      absl::StatusOr<std::string> packed = memory->PackRkey();
      if (!packed.ok()) {
        metrics_->AddFailure(packed.status());
        memory.reset();
        return packed.status();
      }
      packed_key = *std::move(packed);
      // Same reasoning as for the worker address in Init(): our own key must pass our check.
      if (absl::Status s = ValidateUcxRemoteKey(packed_key); !s.ok()) {
        memory.reset();
        return absl::InternalError(
            absl::StrCat("this node's own packed UCX key fails validation: ", s.message()));
      }
    }
  }
  const uint64_t id = next_registration_.fetch_add(1);
  local_.Add(id, reinterpret_cast<uintptr_t>(region.addr), region.length, memory->get());
  metrics_->AddRegistration(1, static_cast<int64_t>(region.length));
  live_objects_.fetch_add(1);
  std::string wrapped_key =
      options.remote_write ? WrapBlob(BlobField::kRemoteKey, packed_key,
                                      reinterpret_cast<uintptr_t>(region.addr), region.length)
                           : std::string();
  return std::unique_ptr<Registration>(new UcxRegistration(
      this, id, region, std::move(memory), std::move(wrapped_key), options.remote_write));
}

void UcxTransportImpl::Deregister(uint64_t id, std::unique_ptr<ucx::MemoryHandle> memory,
                                  size_t length) {
  local_.Remove(id);
  metrics_->AddRegistration(-1, -static_cast<int64_t>(length));
  absl::MutexLock lock(&mu_);
  memory.reset();  // ucp_mem_unmap, under the worker lock
}

absl::Status UcxTransportImpl::CheckDescriptor(const PeerDescriptor& peer, std::string* address,
                                               std::string* key) const {
  if (absl::Status s = ValidatePeerDescriptor(peer); !s.ok()) return s;
  const std::string who = absl::StrCat("descriptor of peer '", absl::CHexEscape(peer.peer_name),
                                       "': ");
  absl::StatusOr<UnwrappedBlob> a =
      UnwrapBlob(BlobField::kWorkerAddress, peer.worker_address, kMaxUcxWorkerAddressBytes);
  if (!a.ok()) return absl::InvalidArgumentError(absl::StrCat(who, a.status().message()));
  absl::StatusOr<UnwrappedBlob> k =
      UnwrapBlob(BlobField::kRemoteKey, peer.remote_key, kMaxUcxRemoteKeyBytes);
  if (!k.ok()) return absl::InvalidArgumentError(absl::StrCat(who, k.status().message()));
  if (absl::Status s = CheckKeyScope(peer, *k); !s.ok()) return s;
  // The envelope's CRC stops corruption; these stop a well-formed envelope around bytes UCX would
  // choke on (ucp_address_unpack and ucp_ep_rkey_unpack take no length and trust the blob).
  if (absl::Status s = ValidateUcxWorkerAddress(a->payload, local_records_); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(who, "worker_address: ", s.message()));
  }
  if (absl::Status s = ValidateUcxRemoteKey(k->payload); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(who, "remote_key: ", s.message()));
  }
  if (absl::Status s = CheckSharedMemoryKeys(peer, a->payload, k->payload); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(who, "remote_key: ", s.message()));
  }
  *address = std::move(a->payload);
  *key = std::move(k->payload);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<RemoteTarget>> UcxTransportImpl::Connect(
    const PeerDescriptor& peer) {
  if (peer.transport != kind()) {
    metrics_->AddFailure(MetricsRecorder::Failure::kInvalidArgument);
    return absl::InvalidArgumentError(absl::StrCat(
        "descriptor of peer '", absl::CHexEscape(peer.peer_name), "' is for transport '",
        absl::CHexEscape(peer.transport.substr(0, kMaxTransportNameBytes)), "', this is 'ucx'"));
  }
  std::string address, packed_key;
  if (absl::Status s = CheckDescriptor(peer, &address, &packed_key); !s.ok()) {
    metrics_->AddFailure(MetricsRecorder::Failure::kInvalidArgument);
    return s;
  }
  if (absl::Status s = CheckCompatible(options_.compat, peer.compat); !s.ok()) {
    metrics_->AddFailure(MetricsRecorder::Failure::kIncompatible);
    return absl::Status(s.code(), absl::StrCat("peer '", peer.peer_name, "': ", s.message()));
  }
  // UCX reads fixed-size structures out of key records; the padding keeps a short record's read
  // inside our buffer (ValidateUcxRemoteKey checked the framing, not each transport's layout).
  packed_key.append(kUcxBlobPadding, '\0');
  // Find or create the endpoint and unpack the key. The first Connect() on an endpoint then
  // proves the path with a round trip: a 1-byte get from the start of the range and a flush,
  // waited for without the lock. This way an unreachable peer is reported here rather than by
  // the first write, the first write does not pay for wireup, and the peer has sent its wireup
  // reply before we return. The last point matters on one host: UCX 1.13 aborts (an assertion,
  // removed upstream by openucx/ucx#8175) in a process whose peer vanishes while its wireup reply
  // is still pending. Later descriptors of the same peer (one per reservation run) skip it: the
  // endpoint is proved, and a round trip per run would cost a network RTT per run.
  std::shared_ptr<internal::CompletionState> probe;
  std::shared_ptr<RemoteKey> key;
  Peer* p = nullptr;
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<Peer*> found = FindOrCreatePeer(peer, address);
    if (!found.ok()) {
      metrics_->AddFailure(found.status());
      return found.status();
    }
    p = *found;
    ucp_rkey_h rkey = nullptr;
    if (ucs_status_t s = ucp_ep_rkey_unpack(p->ep, packed_key.data(), &rkey); s != UCS_OK) {
      absl::Status st = absl::InvalidArgumentError(absl::StrCat(
          "remote key of peer '", peer.peer_name, "' does not unpack: ", ucs_status_string(s)));
      metrics_->AddFailure(st);
      return st;
    }
    key = std::make_shared<RemoteKey>(this, rkey);
    if (!p->proved) {
      probe = std::make_shared<internal::CompletionState>(metrics_, 0, /*is_batch=*/false);
      probes_.fetch_add(1);
      auto op = std::make_unique<InflightOp>();
      op->owner = this;
      op->state = probe;
      op->key = key;
      op->peer = p;
      op->scratch = std::make_unique<uint8_t[]>(1);
      ucp_request_param_t get_param = {};
      ucs_status_ptr_t get =
          ucp_get_nbx(p->ep, op->scratch.get(), 1, peer.base_address, rkey, &get_param);
      if (UCS_PTR_IS_ERR(get)) {
        op->issue_error = ucx::FromUcs(UCS_PTR_STATUS(get), "probe get");
      } else if (get != nullptr) {
        ucp_request_free(get);
      }
      ucp_request_param_t param = {};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      param.cb.send = &UcxTransportImpl::OnFlushDone;
      param.user_data = op.get();
      TrackFlush(std::move(op), ucp_ep_flush_nbx(p->ep, &param));
      ucp_worker_signal(worker_.get());
    }
  }
  if (probe != nullptr) {
    if (absl::Status s = probe->Wait(options_.connect_timeout); !s.ok()) {
      s = absl::Status(s.code(),
                       absl::StrCat("connecting to peer '", peer.peer_name, "': ", s.message()));
      metrics_->AddFailure(s);
      return s;
    }
    absl::MutexLock lock(&mu_);
    p->proved = true;
  }
  live_objects_.fetch_add(1);
  return std::unique_ptr<RemoteTarget>(
      new UcxRemoteTarget(this, p, std::move(key), peer.base_address, peer.length));
}

absl::StatusOr<Peer*> UcxTransportImpl::FindOrCreatePeer(const PeerDescriptor& peer,
                                                         const std::string& address) {
  if (stop_) return absl::UnavailableError("UCX transport is shutting down");
  auto it = peers_.find(address);
  if (it == peers_.end()) {
    auto entry = std::make_unique<Peer>();
    entry->owner = this;
    entry->name = peer.peer_name;
    entry->padded_address = address;
    entry->padded_address.append(kUcxBlobPadding, '\0');
    ucp_ep_params_t params = {};
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    params.address = reinterpret_cast<const ucp_address_t*>(entry->padded_address.data());
    if (options_.peer_error_handling) {
      params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
      params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      params.err_handler.cb = &UcxTransportImpl::OnEndpointError;
      params.err_handler.arg = entry.get();
    }
    if (ucs_status_t s = ucp_ep_create(worker_.get(), &params, &entry->ep); s != UCS_OK) {
      return ucx::FromUcs(s, absl::StrCat("connecting to peer '", peer.peer_name, "'"));
    }
    it = peers_.emplace(address, std::move(entry)).first;
    ucp_worker_signal(worker_.get());  // wireup messages need progress
  }
  Peer* p = it->second.get();
  if (p->failed) {
    return absl::UnavailableError(absl::StrCat(
        p->failure.message(), " (a restarted peer has a new worker address: ask it again)"));
  }
  return p;
}

absl::StatusOr<std::unique_ptr<TransferHandle>> UcxTransportImpl::Write(
    const RemoteTarget& target, absl::Span<const BlockCopy> copies, const WriteOptions& options) {
  const auto* t = dynamic_cast<const UcxRemoteTarget*>(&target);
  if (t == nullptr || t->owner() != this) {
    metrics_->AddFailure(MetricsRecorder::Failure::kInvalidArgument);
    return absl::InvalidArgumentError("target was not made by this transport");
  }
  if (absl::Status s = internal::ValidateBatch(copies, t->base_address(), t->length(), local_);
      !s.ok()) {
    metrics_->AddFailure(s);
    return absl::Status(s.code(), absl::StrCat("write to '", t->peer_name(), "': ", s.message()));
  }
  const std::vector<BlockCopy> ops = options.coalesce
                                         ? CoalesceCopies(copies)
                                         : std::vector<BlockCopy>(copies.begin(), copies.end());
  // Local memory handles let UCX skip its registration cache lookup per put. A merged op that
  // spans two registrations has none and UCX finds its own.
  std::vector<ucp_mem_h> memh(ops.size(), nullptr);
  for (size_t i = 0; i < ops.size(); ++i) {
    absl::StatusOr<void*> cookie =
        local_.Find(reinterpret_cast<uintptr_t>(ops[i].local_addr), ops[i].length);
    if (cookie.ok()) memh[i] = static_cast<ucp_mem_h>(*cookie);
  }
  auto state = std::make_shared<internal::CompletionState>(metrics_, internal::TotalBytes(copies));
  auto op = std::make_unique<InflightOp>();
  op->owner = this;
  op->state = state;
  op->key = t->key();
  op->peer = t->peer();

  absl::MutexLock lock(&mu_);
  Peer* peer = t->peer();
  if (stop_ || peer->failed || peer->ep == nullptr) {
    absl::Status s =
        stop_ ? absl::UnavailableError("UCX transport is shutting down") : peer->failure;
    metrics_->AddFailure(s);
    return s;
  }
  metrics_->AddSubmitted(copies.size(), ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    ucp_request_param_t param = {};
    if (memh[i] != nullptr) {
      param.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
      param.memh = memh[i];
    }
    // No callback per put: the batch's flush below reports completion, and a failed put fails
    // the endpoint, which fails the flush. Requests are released at once (UCX completes them).
    ucs_status_ptr_t request = ucp_put_nbx(peer->ep, ops[i].local_addr, ops[i].length,
                                           ops[i].remote_addr, t->key()->get(), &param);
    if (UCS_PTR_IS_ERR(request)) {
      op->issue_error =
          ucx::FromUcs(UCS_PTR_STATUS(request),
                       absl::StrCat("put ", i, " of ", ops.size(), " to '", peer->name, "'"));
      break;  // what was posted still gets flushed, so the handle ends with nothing in flight
    }
    if (request != nullptr) ucp_request_free(request);
  }
  ucp_request_param_t flush_param = {};
  flush_param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  flush_param.cb.send = &UcxTransportImpl::OnFlushDone;
  flush_param.user_data = op.get();
  ucs_status_ptr_t flush = ucp_ep_flush_nbx(peer->ep, &flush_param);
  TrackFlush(std::move(op), flush);
  ucp_worker_signal(worker_.get());
  return std::unique_ptr<TransferHandle>(new internal::StateHandle(std::move(state)));
}

absl::Status UcxTransportImpl::Flush(absl::Duration timeout) {
  auto state = std::make_shared<internal::CompletionState>(metrics_, 0, /*is_batch=*/false);
  {
    auto op = std::make_unique<InflightOp>();
    op->owner = this;
    op->state = state;
    absl::MutexLock lock(&mu_);
    if (stop_) return absl::UnavailableError("UCX transport is shutting down");
    ucp_request_param_t param = {};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = &UcxTransportImpl::OnFlushDone;
    param.user_data = op.get();
    ucs_status_ptr_t request = ucp_worker_flush_nbx(worker_.get(), &param);
    TrackFlush(std::move(op), request);
    ucp_worker_signal(worker_.get());
  }
  absl::Status s = state->Wait(timeout);
  // A failed endpoint fails the worker flush too; Flush only promises "nothing is in flight".
  return absl::IsDeadlineExceeded(s) ? s : absl::OkStatus();
}

absl::StatusOr<std::string> UcxTransportImpl::DescribeEndpoint(const RemoteTarget& target) {
  const auto* t = dynamic_cast<const UcxRemoteTarget*>(&target);
  if (t == nullptr || t->owner() != this) {
    return absl::InvalidArgumentError("target was not made by this transport");
  }
  absl::MutexLock lock(&mu_);
  if (t->peer()->ep == nullptr) return t->peer()->failure;
  char* text = nullptr;
  size_t size = 0;
  FILE* stream = open_memstream(&text, &size);
  if (stream == nullptr) return absl::InternalError("open_memstream failed");
  ucp_ep_print_info(t->peer()->ep, stream);
  fclose(stream);
  std::string out(text, size);
  free(text);
  return out;
}

void UcxTransportImpl::SetProgressPausedForTesting(bool paused) {
  absl::MutexLock lock(&mu_);
  paused_ = paused;
  ucp_worker_signal(worker_.get());
}

}  // namespace

absl::StatusOr<std::unique_ptr<UcxTransport>> NewUcxTransport(const UcxOptions& options) {
  auto transport = std::make_unique<UcxTransportImpl>(options);
  if (absl::Status s = transport->Init(); !s.ok()) return s;
  return std::unique_ptr<UcxTransport>(std::move(transport));
}

}  // namespace fluxion::transfer

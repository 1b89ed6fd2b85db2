#include "transfer/ucx_transport.h"

#include <poll.h>
#include <stdio.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "glog/logging.h"
#include "transfer/descriptor_check.h"
#include "transfer/landing_wire.h"
#include "transfer/transport_internal.h"
#include "transfer/ucx_handles.h"
#include "transfer/ucx_landing.h"

namespace fluxion::transfer {
namespace {

using internal::MetricsRecorder;

// UCX 1.13's new protocol layer (UCX_PROTO_ENABLE=y, off by default in 1.13) sends a short active
// message with UCP_AM_SEND_FLAG_REPLY and a user header as four iovs out of a three-element stack
// array (ucp_am_eager_short_proto_progress_common in src/ucp/am/eager_single.c; upstream has four
// elements): every fence and ack smashes the sender's stack. So with that UCX, refuse to start
// rather than crash at the first fence (or let any peer crash a target by sending fences).
absl::Status CheckProtocolSelection(const ucp_config_t* config) {
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  if (major > 1 || (major == 1 && minor >= 14)) return absl::OkStatus();
  char* text = nullptr;
  size_t size = 0;
  FILE* stream = open_memstream(&text, &size);
  if (stream == nullptr) return absl::InternalError("open_memstream failed");
  ucp_config_print(config, stream, nullptr, UCS_CONFIG_PRINT_CONFIG);
  fclose(stream);
  const std::string printed(text, size);
  free(text);
  for (absl::string_view line : absl::StrSplit(printed, '\n')) {
    if (!absl::ConsumePrefix(&line, "UCX_PROTO_ENABLE=")) continue;
    if (line == "n" || line == "no" || line == "off" || line == "0") return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        "UCX_PROTO_ENABLE=", line, " is not supported with UCX ", major, ".", minor, ".", release,
        ": its new protocol layer overflows a stack buffer sending the active messages that "
        "acknowledge KV writes (fixed in later UCX); unset it"));
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

class UcxRemoteTarget final : public RemoteTarget {
 public:
  UcxRemoteTarget(UcxTransportImpl* owner, Peer* peer, const landing::Token& token, uint64_t base,
                  uint64_t length)
      : owner_(owner), peer_(peer), token_(token), base_(base), length_(length) {}
  ~UcxRemoteTarget() override;
  const std::string& peer_name() const override { return peer_->name; }
  uint64_t base_address() const override { return base_; }
  uint64_t length() const override { return length_; }

  UcxTransportImpl* owner() const { return owner_; }
  Peer* peer() const { return peer_; }
  const landing::Token& token() const { return token_; }

 private:
  UcxTransportImpl* const owner_;
  Peer* const peer_;
  const landing::Token token_;
  const uint64_t base_;
  const uint64_t length_;
};

class UcxRegistration final : public Registration {
 public:
  // `token`: the landing peers write through (remote_write only); `wrapped_key`: its key in our
  // envelope (WrapBlob), scoped to `region`.
  UcxRegistration(UcxTransportImpl* owner, uint64_t id, MemoryRegion region,
                  std::unique_ptr<ucx::MemoryHandle> memory, bool remote_write,
                  const landing::Token& token, std::string wrapped_key)
      : owner_(owner),
        id_(id),
        region_(region),
        memory_(std::move(memory)),
        remote_write_(remote_write),
        token_(token),
        wrapped_key_(std::move(wrapped_key)) {}
  ~UcxRegistration() override;
  MemoryRegion region() const override { return region_; }
  absl::StatusOr<PeerDescriptor> Describe() const override;

 private:
  UcxTransportImpl* const owner_;
  const uint64_t id_;
  const MemoryRegion region_;
  std::unique_ptr<ucx::MemoryHandle> memory_;
  const bool remote_write_;
  const landing::Token token_;
  const std::string wrapped_key_;
};

// One batch written (or Connect()'s round trip, a batch of no messages) from Write() until its
// target accounted for every message. Owned by the transport; the UCX requests of its sends point
// at it, so it is forgotten only when it is done and none is outstanding.
struct Batch {
  UcxTransportImpl* owner = nullptr;
  uint64_t id = 0;
  Peer* peer = nullptr;
  std::shared_ptr<internal::CompletionState> state;
  // Headers of the write messages and of the fence: UCX reads them until each send completes.
  std::vector<landing::WriteHeaderBytes> headers;
  landing::FenceHeaderBytes fence = {};
  uint64_t messages = 0;  // write messages issued
  uint64_t bytes = 0;     // their bytes
  uint64_t sent = 0;      // write messages whose send completed at this end
  uint64_t requests = 0;  // UCX send requests outstanding that point at this batch
  absl::Status send_error;
  bool fenced = false;  // a fence went out: waiting for the target's ack
  bool done = false;
  absl::Time first_fence;
  absl::Duration backoff;  // before asking again, after an ack that was not final
};

class UcxTransportImpl final : public UcxTransport {
 public:
  explicit UcxTransportImpl(const UcxOptions& options)
      : options_(options), metrics_(std::make_shared<MetricsRecorder>()) {}
  ~UcxTransportImpl() override;

  absl::Status Init();

  absl::StatusOr<std::unique_ptr<Registration>> Register(
      MemoryRegion region, const RegistrationOptions& options) override;
  absl::StatusOr<std::unique_ptr<RemoteTarget>> Connect(const PeerDescriptor& peer) override;
  absl::StatusOr<std::unique_ptr<TransferHandle>> Write(const RemoteTarget& target,
                                                        absl::Span<const BlockCopy> copies,
                                                        const WriteOptions& options) override;
  absl::Status Flush(absl::Duration timeout) override;
  TransportMetrics metrics() const override { return metrics_->Snapshot(); }
  absl::StatusOr<std::string> DescribeEndpoint(const RemoteTarget& target) override;
  void SetProgressPausedForTesting(bool paused) override;
  uint64_t ConnectProbesForTesting() const override { return probes_.load(); }
  size_t LandingBatchesForTesting() const override {
    absl::MutexLock lock(&mu_);
    return landings_->BatchesForTesting();
  }

  // Called by the objects this transport hands out.
  void Deregister(uint64_t id, std::unique_ptr<ucx::MemoryHandle> memory, bool landing,
                  const landing::Token& token, size_t length);
  void ObjectDestroyed() { live_objects_.fetch_sub(1); }
  const UcxOptions& options() const { return options_; }
  const std::string& wrapped_worker_address() const { return wrapped_worker_address_; }

 private:
  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);
  static void OnWriteSent(void* request, ucs_status_t status, void* user_data);
  static void OnFenceSent(void* request, ucs_status_t status, void* user_data);
  static ucs_status_t OnAck(void* arg, const void* header, size_t header_length, void* data,
                            size_t length, const ucp_am_recv_param_t* param);

  void ProgressLoop();
  bool MayProgress() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !paused_; }
  // A new batch towards `peer`, tracked until done. `is_batch`: a Write() (counted in the batch
  // metrics), not Connect()'s round trip.
  Batch* NewBatch(Peer* peer, uint64_t bytes, bool is_batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends (or sends again) `b`'s fence; the target answers with an ack.
  void SendFence(Batch* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `from`: the endpoint the ack arrived on; only the batch's own peer may answer for it.
  void HandleAck(const landing::Ack& ack, ucp_ep_h from) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Completes `b`'s handle with `status` (the first outcome wins) and forgets `b` once no UCX
  // request points at it.
  void Finish(Batch* b, absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeForget(Batch* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fences due again and acks overdue (UcxOptions::ack_timeout).
  void RunTimers(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CloseEndpoint(Peer* peer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The cached peer for `peer`'s worker address, creating its endpoint if there is none.
  // Unavailable if the peer is known dead.
  absl::StatusOr<Peer*> FindOrCreatePeer(const PeerDescriptor& peer, const std::string& address)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Everything Connect() checks before UCX sees a byte of `peer`: the fields, both envelopes, the
  // key's scope, the structure of the UCX address and the landing key. On success, the unwrapped
  // address and the token.
  absl::Status CheckDescriptor(const PeerDescriptor& peer, std::string* address,
                               landing::Token* token) const;
  // Frees finished close requests.
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
  // This node as a target: its landings and the handlers that land peers' writes.
  std::unique_ptr<ucx::LandingTable> landings_ ABSL_GUARDED_BY(mu_);
  std::string worker_address_;          // set once in Init()
  std::string wrapped_worker_address_;  // set once in Init(): what Describe() hands out
  // Our own address's transport records (set once in Init()): peers' records of the same
  // transports must be at least as long (ValidateUcxWorkerAddress).
  std::vector<UcxAddressRecord> local_records_;
  uint64_t stream_ = 0;  // set once in Init(): random, names our batches at every target
  std::atomic<uint64_t> probes_{0};  // Connect() round trips issued
  int event_fd_ = -1;  // set once in Init(); -1: no wakeup support, poll with sleeps
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool paused_ ABSL_GUARDED_BY(mu_) = false;
  // Peers by worker address. Entries are never erased (see Peer); a failed one stays failed.
  std::map<std::string, std::unique_ptr<Peer>> peers_ ABSL_GUARDED_BY(mu_);
  uint64_t next_batch_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, std::unique_ptr<Batch>> batches_ ABSL_GUARDED_BY(mu_);
  // (when, batch id): a fence to send again or an ack deadline to check. Stale entries (the batch
  // finished) are skipped.
  std::multimap<absl::Time, uint64_t> timers_ ABSL_GUARDED_BY(mu_);
  std::vector<Peer*> to_close_ ABSL_GUARDED_BY(mu_);
  std::vector<void*> closing_ ABSL_GUARDED_BY(mu_);  // ucp_ep_close_nbx requests

  std::thread progress_thread_;
};

UcxRemoteTarget::~UcxRemoteTarget() { owner_->ObjectDestroyed(); }

UcxRegistration::~UcxRegistration() {
  owner_->Deregister(id_, std::move(memory_), remote_write_, token_, region_.length);
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
  if (absl::Status s = CheckProtocolSelection(config.get()); !s.ok()) return s;
  absl::StatusOr<landing::Token> stream = landing::NewToken();
  if (!stream.ok()) return stream.status();
  std::memcpy(&stream_, stream->data(), sizeof(stream_));

  absl::MutexLock lock(&mu_);
  ucp_params_t params = {};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  // AM for the landing messages; WAKEUP so that the progress thread can sleep on an event fd
  // instead of spinning (on 2-core machines a spinning progress thread per transport would starve
  // everything else). No RMA: without it UCX installs no software-RMA handlers, which would write
  // wherever a peer's message says (docs/TRANSFER.md, "Target-checked landings").
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
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
  landings_ = std::make_unique<ucx::LandingTable>(&mu_, metrics_, options_.landing_limits);
  if (absl::Status s = landings_->Attach(worker_.get()); !s.ok()) return s;
  ucp_am_handler_param_t ack = {};
  ack.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                   UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  ack.id = landing::kAckAmId;
  ack.flags = UCP_AM_FLAG_WHOLE_MSG;
  ack.cb = &UcxTransportImpl::OnAck;
  ack.arg = this;
  if (ucs_status_t s = ucp_worker_set_am_recv_handler(worker_.get(), &ack); s != UCS_OK) {
    return ucx::FromUcs(s, "ucp_worker_set_am_recv_handler(ack)");
  }
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
  // outstanding requests (our send callbacks run with UCS_ERR_CANCELED); without it, they stay
  // pending and are completed by hand below. Either way nothing waits for a peer here.
  for (auto& [address, peer] : peers_) CloseEndpoint(peer.get());
  const absl::Time deadline = absl::Now() + options_.shutdown_timeout;
  while (!closing_.empty() && absl::Now() < deadline) {
    ucp_worker_progress(worker_.get());
    Reap();
  }
  if (!closing_.empty()) LOG(WARNING) << closing_.size() << " UCX endpoints did not close in time";
  const absl::Status why = absl::UnavailableError("UCX transport shut down");
  std::vector<Batch*> open;
  for (auto& [id, batch] : batches_) open.push_back(batch.get());
  for (Batch* b : open) Finish(b, why);  // those with sends outstanding stay until UCX ends them
  // Any callback UCX still owes fires inside ucp_worker_destroy; the batches and the landing
  // table are still alive then.
  worker_.reset();
  batches_.clear();
  landings_.reset();  // unmaps what revocations that timed out kept mapped
  context_.reset();
}

void UcxTransportImpl::ProgressLoop() {
  const int idle_sleep_ms =
      std::max<int64_t>(1, absl::ToInt64Milliseconds(options_.max_idle_sleep));
  absl::Time last_event = absl::InfinitePast();
  absl::Time last_sweep = absl::Now();
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
      RunTimers(now);
      if (now - last_sweep > absl::Seconds(1)) {
        landings_->Sweep(now);
        last_sweep = now;
      }
      if (events > 0) last_event = now;
      if (events == 0) {
        // Some progress raises no event: a send UCX queued because the peer's shared-memory FIFO
        // was full goes out only when we progress again, and "the FIFO has room" wakes nobody.
        // That holds for our writes and for the target's acks. Sleeping right away collapsed
        // shared-memory transfers to ~0.1 GB/s; so after any event keep polling for busy_poll,
        // and while our batches are in flight sleep at most 1 ms (a hung peer must not cost a
        // whole core). Otherwise arm the worker and sleep until the network or a writer
        // (ucp_worker_signal) wakes us.
        const bool in_flight = !batches_.empty();
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
  // Batches waiting only for this peer's ack would wait forever; those with sends outstanding
  // finish when UCX fails the sends.
  std::vector<Batch*> waiting;
  for (auto& [id, b] : self->batches_) {
    if (b->peer == peer && !b->done && b->requests == 0) waiting.push_back(b.get());
  }
  for (Batch* b : waiting) self->Finish(b, peer->failure);
  // UCX wants a failed endpoint closed by force; not from inside its own error callback.
  self->to_close_.push_back(peer);
}

Batch* UcxTransportImpl::NewBatch(Peer* peer, uint64_t bytes, bool is_batch) {
  auto b = std::make_unique<Batch>();
  b->owner = this;
  b->id = next_batch_++;
  b->peer = peer;
  b->state = std::make_shared<internal::CompletionState>(metrics_, bytes, is_batch);
  Batch* raw = b.get();
  batches_.emplace(raw->id, std::move(b));
  return raw;
}

void UcxTransportImpl::SendFence(Batch* b) {
  Peer* peer = b->peer;
  if (peer->failed || peer->ep == nullptr) {
    Finish(b, peer->failure);
    return;
  }
  b->fence = landing::PackFenceHeader({stream_, b->id, b->messages, b->bytes});
  ucp_request_param_t param = {};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
  param.cb.send = &UcxTransportImpl::OnFenceSent;
  param.user_data = b;
  ucs_status_ptr_t request = ucp_am_send_nbx(peer->ep, landing::kFenceAmId, b->fence.data(),
                                             b->fence.size(), nullptr, 0, &param);
  if (UCS_PTR_IS_ERR(request)) {
    Finish(b, peer->failed ? peer->failure
                           : ucx::FromUcs(UCS_PTR_STATUS(request),
                                          absl::StrCat("fence to '", peer->name, "'")));
    return;
  }
  if (request != nullptr) ++b->requests;
  const absl::Time now = absl::Now();
  if (!b->fenced) {
    b->fenced = true;
    b->first_fence = now;
    timers_.emplace(now + options_.ack_timeout, b->id);
  }
}

void UcxTransportImpl::OnWriteSent(void* request, ucs_status_t status, void* user_data) {
  auto* b = static_cast<Batch*>(user_data);
  UcxTransportImpl* self = b->owner;
  self->mu_.AssertHeld();
  ucp_request_free(request);
  --b->requests;
  ++b->sent;
  if (status != UCS_OK && b->send_error.ok()) {
    b->send_error = b->peer->failed ? b->peer->failure
                                    : ucx::FromUcs(status, absl::StrCat("write to '",
                                                                        b->peer->name, "'"));
  }
  if (b->done) {
    self->MaybeForget(b);
  } else if (b->peer->failed) {
    if (b->requests == 0) self->Finish(b, b->peer->failure);
  } else if (b->sent == b->messages) {
    self->SendFence(b);  // every write message left: the fence follows them on the same lane
  }
}

void UcxTransportImpl::OnFenceSent(void* request, ucs_status_t status, void* user_data) {
  auto* b = static_cast<Batch*>(user_data);
  UcxTransportImpl* self = b->owner;
  self->mu_.AssertHeld();
  ucp_request_free(request);
  --b->requests;
  if (status != UCS_OK && !b->done) {
    self->Finish(b, b->peer->failed
                        ? b->peer->failure
                        : ucx::FromUcs(status, absl::StrCat("fence to '", b->peer->name, "'")));
  }
  self->MaybeForget(b);
}

ucs_status_t UcxTransportImpl::OnAck(void* arg, const void* header, size_t header_length,
                                     void* data, size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxTransportImpl*>(arg);
  self->mu_.AssertHeld();
  (void)data;
  (void)length;
  absl::StatusOr<landing::Ack> ack = landing::ParseAck(
      absl::string_view(static_cast<const char*>(header), header == nullptr ? 0 : header_length));
  const ucp_ep_h from =
      (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 ? param->reply_ep : nullptr;
  if (ack.ok() && ack->stream == self->stream_ && from != nullptr) self->HandleAck(*ack, from);
  return UCS_OK;  // anything else (not ours, malformed, no endpoint to check) is dropped
}

void UcxTransportImpl::HandleAck(const landing::Ack& ack, ucp_ep_h from) {
  auto it = batches_.find(ack.batch);
  if (it == batches_.end()) return;
  Batch* b = it->second.get();
  // Acks travel with UCP_AM_SEND_FLAG_REPLY, so UCX names the endpoint they came through: a
  // target cannot answer for a batch written to another one.
  if (b->done || !b->fenced || from != b->peer->ep) return;
  if (ack.in_flight > 0 || ack.accepted + ack.refused < b->messages) {
    // Not everything is accounted for yet (a rendezvous receive still running, or a message that
    // travelled on another lane than the fence): ask again shortly.
    b->backoff = std::clamp(2 * b->backoff, absl::Microseconds(50), absl::Milliseconds(5));
    timers_.emplace(absl::Now() + b->backoff, b->id);
    return;
  }
  const std::string who = absl::StrCat("write to '", b->peer->name, "': ");
  absl::Status status;
  if (ack.refused > 0) {
    const std::string text = absl::StrCat(
        who, "the target refused ", ack.refused, " of ", b->messages, " messages (",
        landing::RefusalText(ack.first_refusal), "); nothing of those landed");
    switch (ack.first_refusal) {
      case landing::Refusal::kTableFull:
        status = absl::ResourceExhaustedError(text);
        break;
      case landing::Refusal::kReceiveFailed:
        status = absl::UnavailableError(text);
        break;
      default:
        status = absl::FailedPreconditionError(text);
    }
  } else if (!b->send_error.ok()) {
    status = b->send_error;
  } else if (ack.accepted_bytes != b->bytes) {
    status = absl::InternalError(absl::StrCat(who, "the target acknowledged ", ack.accepted_bytes,
                                              " of ", b->bytes, " bytes"));
  }
  Finish(b, std::move(status));
}

void UcxTransportImpl::RunTimers(absl::Time now) {
  while (!timers_.empty() && timers_.begin()->first <= now) {
    const uint64_t id = timers_.begin()->second;
    timers_.erase(timers_.begin());
    auto it = batches_.find(id);
    if (it == batches_.end() || it->second->done) continue;
    Batch* b = it->second.get();
    if (now - b->first_fence >= options_.ack_timeout) {
      Finish(b, absl::UnavailableError(absl::StrCat(
                    "write to '", b->peer->name, "': the target did not account for all ",
                    b->messages, " messages within ", absl::FormatDuration(options_.ack_timeout),
                    " of the batch's fence (not progressing, or gone unnoticed)")));
    } else if (b->backoff > absl::ZeroDuration()) {
      SendFence(b);  // a retry after an ack that was not final
    }
  }
}

void UcxTransportImpl::Finish(Batch* b, absl::Status status) {
  if (!b->done) {
    b->done = true;
    b->state->Complete(std::move(status));
  }
  MaybeForget(b);
}

void UcxTransportImpl::MaybeForget(Batch* b) {
  if (b->done && b->requests == 0) batches_.erase(b->id);
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
}

absl::StatusOr<std::unique_ptr<Registration>> UcxTransportImpl::Register(
    MemoryRegion region, const RegistrationOptions& options) {
  if (region.addr == nullptr || region.length == 0) {
    metrics_->AddFailure(MetricsRecorder::Failure::kInvalidArgument);
    return absl::InvalidArgumentError("cannot register a null or empty region");
  }
  const auto base = reinterpret_cast<uintptr_t>(region.addr);
  std::unique_ptr<ucx::MemoryHandle> memory;
  landing::Token token = {};
  {
    absl::MutexLock lock(&mu_);
    // Mapped for UCX either way: the memory handle lets rendezvous receives into a landing (and,
    // on RDMA, sends from a source) skip UCX's registration cache.
    absl::StatusOr<std::unique_ptr<ucx::MemoryHandle>> mapped =
        ucx::MemoryHandle::Map(context_.get(), region.addr, region.length);
    if (!mapped.ok()) {
      metrics_->AddFailure(mapped.status());
      return mapped.status();
    }
    memory = *std::move(mapped);
    if (options.remote_write) {
      absl::StatusOr<landing::Token> opened = landings_->Open(base, region.length, memory->get());
      if (!opened.ok()) {
        memory.reset();
        return opened.status();
      }
      token = *opened;
    }
  }
  const uint64_t id = next_registration_.fetch_add(1);
  local_.Add(id, base, region.length, nullptr);
  metrics_->AddRegistration(1, static_cast<int64_t>(region.length));
  live_objects_.fetch_add(1);
  std::string wrapped_key =
      options.remote_write
          ? WrapBlob(BlobField::kRemoteKey, landing::PackKey(token), base, region.length)
          : std::string();
  return std::unique_ptr<Registration>(new UcxRegistration(
      this, id, region, std::move(memory), options.remote_write, token, std::move(wrapped_key)));
}

void UcxTransportImpl::Deregister(uint64_t id, std::unique_ptr<ucx::MemoryHandle> memory,
                                  bool landing, const landing::Token& token, size_t length) {
  local_.Remove(id);
  metrics_->AddRegistration(-1, -static_cast<int64_t>(length));
  absl::MutexLock lock(&mu_);
  // Revoke first: from here on every message naming the token is refused. Close waits (bounded)
  // for rendezvous receives already issued into the region, and keeps `memory` if they outlive it.
  if (landing) landings_->Close(token, options_.revoke_timeout, &memory);
  memory.reset();  // ucp_mem_unmap, under the worker lock
}

absl::Status UcxTransportImpl::CheckDescriptor(const PeerDescriptor& peer, std::string* address,
                                               landing::Token* token) const {
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
  // The envelope's CRC stops corruption; this stops a well-formed envelope around an address UCX
  // would choke on (ucp_address_unpack takes no length and trusts the blob).
  if (absl::Status s = ValidateUcxWorkerAddress(a->payload, local_records_); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(who, "worker_address: ", s.message()));
  }
  absl::StatusOr<landing::Token> t = landing::ParseKey(k->payload);
  if (!t.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(who, "remote_key: ", t.status().message()));
  }
  *address = std::move(a->payload);
  *token = *t;
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
  std::string address;
  landing::Token token;
  if (absl::Status s = CheckDescriptor(peer, &address, &token); !s.ok()) {
    metrics_->AddFailure(MetricsRecorder::Failure::kInvalidArgument);
    return s;
  }
  if (absl::Status s = CheckCompatible(options_.compat, peer.compat); !s.ok()) {
    metrics_->AddFailure(MetricsRecorder::Failure::kIncompatible);
    return absl::Status(s.code(), absl::StrCat("peer '", peer.peer_name, "': ", s.message()));
  }
  // Find or create the endpoint. The first Connect() on an endpoint then proves the path with a
  // round trip (a fence of no messages, answered by the target's landing table), waited for
  // without the lock. This way an unreachable peer (or one that runs no landings) is reported here
  // rather than by the first write, the first write does not pay for wireup, and the peer has sent
  // its wireup reply before we return. The last point matters on one host: UCX 1.13 aborts (an
  // assertion, removed upstream by openucx/ucx#8175) in a process whose peer vanishes while its
  // wireup reply is still pending. Later descriptors of the same peer (one per reservation run)
  // skip it: the endpoint is proved, and a round trip per run would cost a network RTT per run.
  std::shared_ptr<internal::CompletionState> probe;
  Peer* p = nullptr;
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<Peer*> found = FindOrCreatePeer(peer, address);
    if (!found.ok()) {
      metrics_->AddFailure(found.status());
      return found.status();
    }
    p = *found;
    if (!p->proved) {
      probes_.fetch_add(1);
      Batch* b = NewBatch(p, 0, /*is_batch=*/false);
      probe = b->state;
      SendFence(b);
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
      new UcxRemoteTarget(this, p, token, peer.base_address, peer.length));
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
  std::vector<BlockCopy> ops = options.coalesce
                                   ? CoalesceCopies(copies)
                                   : std::vector<BlockCopy>(copies.begin(), copies.end());
  if (const size_t max = options_.max_message_bytes; max > 0) {
    std::vector<BlockCopy> split;
    for (const BlockCopy& op : ops) {
      for (size_t off = 0; off < op.length; off += max) {
        split.push_back({op.remote_addr + off, static_cast<const uint8_t*>(op.local_addr) + off,
                         std::min(max, op.length - off)});
      }
    }
    ops = std::move(split);
  }
  uint32_t flags = 0;
  if (options_.protocol == UcxOptions::Protocol::kEager) flags = UCP_AM_SEND_FLAG_EAGER;
  if (options_.protocol == UcxOptions::Protocol::kRendezvous) flags = UCP_AM_SEND_FLAG_RNDV;

  absl::MutexLock lock(&mu_);
  Peer* peer = t->peer();
  if (stop_ || peer->failed || peer->ep == nullptr) {
    absl::Status s =
        stop_ ? absl::UnavailableError("UCX transport is shutting down") : peer->failure;
    metrics_->AddFailure(s);
    return s;
  }
  metrics_->AddSubmitted(copies.size(), ops.size());
  Batch* b = NewBatch(peer, internal::TotalBytes(copies), /*is_batch=*/true);
  std::shared_ptr<internal::CompletionState> state = b->state;
  b->headers.reserve(ops.size());  // UCX keeps pointers to them: no reallocation from here on
  for (size_t i = 0; i < ops.size(); ++i) {
    b->headers.push_back(landing::PackWriteHeader({t->token(), stream_, b->id, ops[i].remote_addr}));
    ucp_request_param_t param = {};
    param.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = flags;
    param.cb.send = &UcxTransportImpl::OnWriteSent;
    param.user_data = b;
    ucs_status_ptr_t request =
        ucp_am_send_nbx(peer->ep, landing::kWriteAmId, b->headers.back().data(),
                        landing::kWriteHeaderBytes, ops[i].local_addr, ops[i].length, &param);
    if (UCS_PTR_IS_ERR(request)) {
      b->send_error = ucx::FromUcs(
          UCS_PTR_STATUS(request),
          absl::StrCat("write message ", i, " of ", ops.size(), " to '", peer->name, "'"));
      break;  // what was issued is still fenced, so the handle ends with nothing in flight
    }
    ++b->messages;
    b->bytes += ops[i].length;
    if (request == nullptr) {
      ++b->sent;
    } else {
      ++b->requests;
    }
  }
  if (b->sent == b->messages) SendFence(b);  // else the last OnWriteSent sends it
  ucp_worker_signal(worker_.get());
  return std::unique_ptr<TransferHandle>(new internal::StateHandle(std::move(state)));
}

absl::Status UcxTransportImpl::Flush(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  std::vector<std::shared_ptr<internal::CompletionState>> states;
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return absl::UnavailableError("UCX transport is shutting down");
    for (const auto& [id, b] : batches_) {
      if (!b->done) states.push_back(b->state);
    }
  }
  for (const auto& s : states) {
    if (absl::IsDeadlineExceeded(s->Wait(std::max(absl::ZeroDuration(), deadline - absl::Now())))) {
      return absl::DeadlineExceededError(
          absl::StrCat("flush: batches still in flight after ", absl::FormatDuration(timeout)));
    }
  }
  return absl::OkStatus();
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

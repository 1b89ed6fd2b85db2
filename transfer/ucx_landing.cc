#include "transfer/ucx_landing.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace fluxion::transfer::ucx {

using landing::Refusal;

LandingTable::LandingTable(absl::Mutex* worker_mu,
                           std::shared_ptr<internal::MetricsRecorder> metrics,
                           const UcxOptions::LandingLimits& limits)
    : worker_mu_(worker_mu), metrics_(std::move(metrics)), options_(limits) {}

absl::Status LandingTable::Attach(ucp_worker_h worker) {
  worker_mu_->AssertHeld();
  worker_ = worker;
  // UCX 1.13 grows its table of AM handlers by realloc and initializes only the id being
  // registered (ucp_worker_set_am_handler_common), so the other slots hold whatever the heap had,
  // and its receive paths read a slot's flags before checking the id against the table's length.
  // A peer naming an unused id could make UCX call through a garbage pointer or read past the
  // table. So every one of the 65536 ids gets an explicit slot with no callback (UCX drops
  // messages for those, with a warning) before our handlers go in: 1.5 MiB per worker. Upstream
  // UCX initializes new slots (ucs_array_resize with an empty handler).
  for (uint32_t id = 0xffff;; id = id == 0xffff ? 0 : id + 1) {  // 0xffff first: one realloc
    ucp_am_handler_param_t none = {};
    none.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB;
    none.id = static_cast<uint16_t>(id);
    none.cb = nullptr;
    if (ucs_status_t s = ucp_worker_set_am_recv_handler(worker, &none); s != UCS_OK) {
      return FromUcs(s, "clearing UCX's active message handler table");
    }
    if (id == 0xfffe) break;
  }
  for (const auto& [id, cb] :
       {std::pair<uint16_t, ucp_am_recv_callback_t>{landing::kWriteAmId, &LandingTable::OnWrite},
        std::pair<uint16_t, ucp_am_recv_callback_t>{landing::kFenceAmId, &LandingTable::OnFence}}) {
    ucp_am_handler_param_t param = {};
    param.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                       UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    param.id = id;
    param.flags = UCP_AM_FLAG_WHOLE_MSG;
    param.cb = cb;
    param.arg = this;
    if (ucs_status_t s = ucp_worker_set_am_recv_handler(worker, &param); s != UCS_OK) {
      return FromUcs(s, absl::StrCat("ucp_worker_set_am_recv_handler(", id, ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<landing::Token> LandingTable::Open(uintptr_t base, size_t length, ucp_mem_h memh) {
  worker_mu_->AssertHeld();
  absl::StatusOr<landing::Token> token = landing::NewToken();
  if (!token.ok()) return token.status();
  auto l = std::make_shared<Landing>();
  l->base = base;
  l->length = length;
  l->memh = memh;
  if (!landings_.emplace(*token, std::move(l)).second) {
    return absl::InternalError("getrandom returned a token already in use");
  }
  return *token;
}

bool LandingTable::Close(const landing::Token& token, absl::Duration timeout,
                         std::unique_ptr<MemoryHandle>* memory) {
  worker_mu_->AssertHeld();
  auto it = landings_.find(token);
  if (it == landings_.end()) return true;
  std::shared_ptr<Landing> l = std::move(it->second);
  landings_.erase(it);
  if (l->in_flight > 0) {
    // Releases the worker lock while waiting: the progress thread finishes the receives.
    worker_mu_->AwaitWithTimeout(
        absl::Condition(
            +[](Landing* x) ABSL_NO_THREAD_SAFETY_ANALYSIS { return x->in_flight == 0; },
            l.get()),
        timeout);
  }
  if (l->in_flight == 0) return true;
  metrics_->AddLandingRevokeTimeout();
  LOG(ERROR) << "landing [0x" << std::hex << l->base << std::dec << ", +" << l->length
             << ") revoked with " << l->in_flight << " rendezvous receives still in flight after "
             << absl::FormatDuration(timeout)
             << ": their bytes may still land; the region stays mapped until they end";
  l->parked = std::move(*memory);
  return false;
}

void LandingTable::Sweep(absl::Time now) {
  worker_mu_->AssertHeld();
  absl::erase_if(tallies_, [&](const auto& kv) {
    return kv.second.in_flight == 0 && now - kv.second.touched > options_.batch_idle;
  });
}

LandingTable::Tally* LandingTable::TallyFor(const BatchKey& key, absl::Time now) {
  auto it = tallies_.find(key);
  if (it == tallies_.end()) {
    if (tallies_.size() >= options_.max_batches) {
      // Evict the least recently touched eighth of the idle tallies (receives in flight pin
      // theirs; with max_receives below max_batches some are always idle).
      std::vector<std::pair<absl::Time, BatchKey>> idle;
      for (const auto& [k, t] : tallies_) {
        if (t.in_flight == 0) idle.emplace_back(t.touched, k);
      }
      if (idle.empty()) return nullptr;
      const size_t n = std::clamp<size_t>(options_.max_batches / 8, 1, idle.size());
      std::nth_element(idle.begin(), idle.begin() + (n - 1), idle.end());
      for (size_t i = 0; i < n; ++i) tallies_.erase(idle[i].second);
      LogRateLimited(absl::StrCat("landing batch table full (", options_.max_batches,
                                  "): evicted ", n, " idle batches"));
    }
    it = tallies_.emplace(key, Tally{}).first;
  }
  it->second.touched = now;
  return &it->second;
}

void LandingTable::Refuse(Tally* tally, Refusal why, const landing::WriteHeader* h,
                          size_t length) {
  metrics_->AddLandingRefused();
  if (tally != nullptr) {
    ++tally->refused;
    if (tally->first_refusal == Refusal::kNone) tally->first_refusal = why;
  }
  std::string what = absl::StrCat("refused a landing write of ", length, " bytes: ",
                                  landing::RefusalText(why));
  if (h != nullptr) {
    absl::StrAppend(&what, " (to 0x", absl::Hex(h->remote_addr), ", writer stream ",
                    absl::Hex(h->stream), " batch ", h->batch, ")");
  }
  LogRateLimited(what);
}

void LandingTable::LogRateLimited(const std::string& what) {
  const absl::Time now = absl::Now();
  if (now - last_log_ < absl::Seconds(1)) {
    ++suppressed_logs_;
    return;
  }
  LOG(WARNING) << what
               << (suppressed_logs_ > 0
                       ? absl::StrCat(" (and ", suppressed_logs_, " more since the last report)")
                       : std::string());
  last_log_ = now;
  suppressed_logs_ = 0;
}

ucs_status_t LandingTable::OnWrite(void* arg, const void* header, size_t header_length,
                                   void* data, size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<LandingTable*>(arg);
  self->worker_mu_->AssertHeld();  // inside ucp_worker_progress, under the worker lock
  return self->Write(header, header_length, data, length,
                     (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0);
}

ucs_status_t LandingTable::Write(const void* header, size_t header_length, void* data,
                                 size_t length, bool rendezvous) {
  // Returning UCS_OK without receiving drops the message: eager data is released, and a
  // rendezvous sender is told (ATS) that its message is done, without a byte moving.
  absl::StatusOr<landing::WriteHeader> h = landing::ParseWriteHeader(
      absl::string_view(static_cast<const char*>(header), header == nullptr ? 0 : header_length));
  if (!h.ok()) {
    Refuse(nullptr, Refusal::kMalformed, nullptr, length);
    return UCS_OK;
  }
  Tally* const found = TallyFor({h->stream, h->batch}, absl::Now());
  if (found == nullptr) {
    Refuse(nullptr, Refusal::kTableFull, &*h, length);
    return UCS_OK;
  }
  Tally& tally = *found;
  auto it = landings_.find(h->token);
  if (it == landings_.end()) {
    Refuse(&tally, Refusal::kUnknownToken, &*h, length);
    return UCS_OK;
  }
  const std::shared_ptr<Landing>& l = it->second;
  if (length == 0 || !internal::RangeInside(h->remote_addr, length, l->base, l->length)) {
    Refuse(&tally, Refusal::kOutOfRange, &*h, length);
    return UCS_OK;
  }
  void* dest = reinterpret_cast<void*>(static_cast<uintptr_t>(h->remote_addr));
  if (!rendezvous) {
    std::memcpy(dest, data, length);
    ++tally.accepted;
    tally.accepted_bytes += length;
    metrics_->AddLanded(length);
    return UCS_OK;
  }
  if (receives_.size() >= options_.max_receives) {
    Refuse(&tally, Refusal::kTableFull, &*h, length);
    return UCS_OK;
  }
  // Counted as in flight before the call: UCX may finish the receive (and run OnReceiveDone, which
  // undoes this) inside ucp_am_recv_data_nbx, e.g. a CMA get is one synchronous syscall.
  auto owned = std::make_unique<Receive>(Receive{this, {h->stream, h->batch}, l, length});
  Receive* receive = owned.get();
  receives_.emplace(receive, std::move(owned));
  ++tally.in_flight;
  ++l->in_flight;
  ucp_request_param_t param = {};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.recv_am = &LandingTable::OnReceiveDone;
  param.user_data = receive;
  if (l->memh != nullptr) {
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    param.memh = l->memh;
  }
  const std::shared_ptr<Landing> keep = l;  // `l` refers into landings_; OnReceiveDone may run
  ucs_status_ptr_t request = ucp_am_recv_data_nbx(worker_, data, dest, length, &param);
  if (UCS_PTR_IS_PTR(request)) {
    // In flight, or already finished by OnReceiveDone (which freed the request): either way
    // nothing more to do here.
    return UCS_OK;
  }
  // Finished without a callback (NULL) or failed to start: undo the bookkeeping here.
  receives_.erase(receive);
  --keep->in_flight;
  --tally.in_flight;
  if (request == nullptr) {
    ++tally.accepted;
    tally.accepted_bytes += length;
    metrics_->AddLanded(length);
  } else {
    Refuse(&tally, Refusal::kReceiveFailed, &*h, length);
  }
  // UCS_OK in every case: after ucp_am_recv_data_nbx UCX owns the descriptor.
  return UCS_OK;
}

void LandingTable::OnReceiveDone(void* request, ucs_status_t status, size_t length,
                                 void* user_data) {
  auto* r = static_cast<Receive*>(user_data);
  LandingTable* self = r->table;
  self->worker_mu_->AssertHeld();
  --r->landing->in_flight;
  auto t = self->tallies_.find(r->batch);
  Tally* tally = t == self->tallies_.end() ? nullptr : &t->second;
  if (tally != nullptr) --tally->in_flight;
  if (status == UCS_OK && length == r->length) {
    if (tally != nullptr) {
      ++tally->accepted;
      tally->accepted_bytes += length;
    }
    self->metrics_->AddLanded(length);
  } else {
    self->Refuse(tally, Refusal::kReceiveFailed, nullptr, r->length);
  }
  // Drops this receive's reference to its landing: a closed landing dies with its last receive,
  // and its parked mapping is unmapped here, under the worker lock.
  self->receives_.erase(r);
  ucp_request_free(request);
}

ucs_status_t LandingTable::OnFence(void* arg, const void* header, size_t header_length,
                                   void* data, size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<LandingTable*>(arg);
  self->worker_mu_->AssertHeld();
  (void)data;
  self->Fence(header, header_length, length, param);
  return UCS_OK;  // drops any data a hostile fence carried (a rendezvous one is answered ATS)
}

void LandingTable::Fence(const void* header, size_t header_length, size_t length,
                         const ucp_am_recv_param_t* param) {
  absl::StatusOr<landing::FenceHeader> h = landing::ParseFenceHeader(
      absl::string_view(static_cast<const char*>(header), header == nullptr ? 0 : header_length));
  const bool can_reply = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 &&
                         param->reply_ep != nullptr &&
                         (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) == 0;
  if (!h.ok() || length != 0 || !can_reply) {
    metrics_->AddLandingRefused();
    LogRateLimited(absl::StrCat("dropped a malformed landing fence: ",
                                h.ok() ? (can_reply ? "it carries data" : "no reply endpoint")
                                       : std::string(h.status().message())));
    return;
  }
  landing::Ack ack;
  ack.stream = h->stream;
  ack.batch = h->batch;
  auto it = tallies_.find({h->stream, h->batch});
  if (it != tallies_.end()) {
    const Tally& t = it->second;
    ack.accepted = t.accepted;
    ack.accepted_bytes = t.accepted_bytes;
    ack.refused = t.refused;
    ack.in_flight = t.in_flight;
    ack.first_refusal = t.first_refusal;
    // Complete: the writer learns everything now and will not ask again.
    if (t.in_flight == 0 && t.accepted + t.refused >= h->messages) tallies_.erase(it);
  }
  // The reply endpoint is valid inside this callback only (UCX destroys endpoints it created for
  // a peer when that peer fails), so the ack goes out here or never: a writer whose batch is not
  // complete yet asks again.
  auto bytes = std::make_unique<landing::AckBytes>(landing::PackAck(ack));
  ucp_request_param_t p = {};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                   UCP_OP_ATTR_FIELD_FLAGS;
  // REPLY: the writer checks that the ack came through the endpoint it sent the batch on.
  p.flags = UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_REPLY;
  p.cb.send = &LandingTable::OnAckSent;
  p.user_data = bytes.get();
  ucs_status_ptr_t request = ucp_am_send_nbx(param->reply_ep, landing::kAckAmId, bytes->data(),
                                             bytes->size(), nullptr, 0, &p);
  if (UCS_PTR_IS_PTR(request)) {
    bytes.release();  // OnAckSent frees it (UCX reads the header until the send completes)
  } else if (UCS_PTR_IS_ERR(request)) {
    LogRateLimited(absl::StrCat("cannot answer a landing fence: ",
                                ucs_status_string(UCS_PTR_STATUS(request))));
  }
}

void LandingTable::OnAckSent(void* request, ucs_status_t status, void* user_data) {
  (void)status;  // a failed ack: the writer's endpoint fails too, or it asks again
  delete static_cast<landing::AckBytes*>(user_data);
  ucp_request_free(request);
}

}  // namespace fluxion::transfer::ucx

// One Generate call on the decode node, as its phases (docs/SERVING.md, "One request on the decode
// node"). DecodeServiceImpl::GenerateCall makes one Call per RPC and runs the phases in order:
//
//   ParseAndValidate  nothing reserved: draining, the request's fields, the prefill node to use
//   Accept            registered under its id for Abort; the abort token sent to the client
//   Admit             the prompt's KV pages and sparse-state room reserved and registered
//   PrefillAndLand    the prefill node writes them; checksums verified, the state parsed, the
//                     pages adopted by the request's attention
//   JoinBatch         the first token accepted; the request joins the running batch
//   Stream            tokens streamed until the request ends, then complete or error
//
// A phase that ends the call returns its final status, having written what the client gets and
// counted the ending; nullopt means "go on". The call's pages are held by Reservations (then by
// the request's PagedKv), so every ending gives them back (or quarantines them) by itself.
//
// Internal to the service (it reaches into DecodeServiceImpl's private state); one thread.
#ifndef FLUXION_DECODE_SERVING_GENERATE_CALL_H_
#define FLUXION_DECODE_SERVING_GENERATE_CALL_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "decode/kv/kv_admission.h"
#include "decode/serving/decode_service.h"
#include "decode/serving/generate_call_steps.h"
#include "decode/serving/generate_validation.h"
#include "decode/step/sparse_attention.h"

namespace fluxion::decode {

class DecodeServiceImpl::Call {
 public:
  // What a phase decided: nullopt to go on, else the call's final status.
  using Ending = std::optional<grpc::Status>;

  Call(DecodeServiceImpl* service, grpc::ServerContext* context,
       const fluxion::v1::GenerateRequest* request,
       grpc::ServerWriter<fluxion::v1::GenerateResponse>* writer);
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;

  // Refuses (counted as rejected): UNAVAILABLE while draining; INVALID_ARGUMENT naming the field
  // (decode/serving/generate_validation.h); FAILED_PRECONDITION without prefill nodes;
  // PERMISSION_DENIED for an untrusted prefill_address.
  Ending ParseAndValidate();
  // Registers the call under its id with a fresh abort token, which the client gets now in the
  // initial metadata (before any wait), and fixes the call's deadline.
  Ending Accept();
  // Reserves, all or nothing, the prompt's pages for every layer and KV head plus the
  // sparse-state room (kv_admission.h), waiting up to --admission-timeout-ms and the deadline;
  // splits them into the two reservations and registers each run with the transport.
  Ending Admit();
  // The Prefill call and what its ending means for the pages (docs/SERVING.md, "How a Prefill
  // call ends"), then the landing checks (generate_call_steps.h, LandPrompt).
  Ending PrefillAndLand();
  // The request of the running batch; its first token (from the prefill node) accepted; joins
  // the batch unless that token already ended it.
  void JoinBatch();
  // Streams the request's tokens until it ends (finish, abort, client gone, deadline), then
  // counts the ending and writes complete or error. A resumable preemption (batch_scheduler.h)
  // does not end it: Resume, and the stream goes on.
  grpc::Status Stream();

 private:
  using Clock = std::chrono::steady_clock;
  // Erases the call's entry from the service's live requests when the call ends.
  class LiveEntry {
   public:
    LiveEntry(DecodeServiceImpl* service,
              std::multimap<std::string, std::shared_ptr<Live>>::iterator entry)
        : service_(service), entry_(entry) {}
    LiveEntry(const LiveEntry&) = delete;
    LiveEntry& operator=(const LiveEntry&) = delete;
    ~LiveEntry();

   private:
    DecodeServiceImpl* const service_;
    const std::multimap<std::string, std::shared_ptr<Live>>::iterator entry_;
  };
  // What streaming ended with.
  struct Streamed {
    Finish finish = Finish::kNone;
    uint32_t sent = 0;
    bool client_gone = false;
    bool deadline_hit = false;
    Clock::time_point t_first_sent{};
    Clock::time_point t_last_sent{};
  };

  bool Cancelled() const;
  void Count(uint64_t DecodeMetrics::*field);
  grpc::Status Reject(const absl::Status& status);  // refused before admission
  grpc::Status Fail(const absl::Status& status);    // failed after admission, before the batch
  // Ends a request cancelled (client) or aborted before it joined the batch.
  grpc::Status EndCancelled();
  // What a request ended by DecodeServiceImpl::EndLiveRequests gets, after `tokens_sent` tokens.
  absl::Status ShutdownError(uint32_t tokens_sent) const;
  Ending Prefill();  // PrefillAndLand's first half: the call and its ending
  Ending Land();     // its second half: the landing checks
  // Streams until the request ends; `s` accumulates over the request's runs in the batch.
  void StreamTokens(Streamed& s);
  // Whether the run `s` ended by a preemption the call recovers from: resumable, the client
  // still there, time and resumes left.
  bool ShouldResume(const Streamed& s);
  // Recomputes the preempted request's KV (Admit and PrefillAndLand over the prompt and every
  // generated token but the last, the prefill node's own token discarded) and joins the batch
  // where it stopped (ResumeDecodeRequest). The client-facing timing stays the first run's.
  Ending Resume();
  std::string NextPrefillId();
  grpc::Status EndStream(const Streamed& streamed);

  DecodeServiceImpl* const service_;
  grpc::ServerContext* const context_;
  const fluxion::v1::GenerateRequest& request_;
  grpc::ServerWriter<fluxion::v1::GenerateResponse>* const writer_;
  DecodeNodeMetrics* const node_metrics_;
  const Clock::time_point t_arrival_;
  const absl::Time arrival_;
  const int64_t prompt_tokens_;
  // What the next prefill computes: the request itself, or after a preemption resume_request_
  // (the prompt and the tokens generated before it), and its length.
  const fluxion::v1::GenerateRequest* prefill_input_ = &request_;
  int64_t context_tokens_ = prompt_tokens_;
  fluxion::v1::GenerateRequest resume_request_;
  int resumes_ = 0;
  std::vector<int32_t> generated_;  // every token streamed, in order (Resume's input)

  // ParseAndValidate
  std::optional<ValidatedGenerate> valid_;
  std::string prefill_address_;
  // Accept. Declared before the reservations, so that the entry goes after the pages are back.
  std::shared_ptr<Live> live_;
  std::optional<LiveEntry> live_entry_;
  std::string prefill_id_;
  absl::Time deadline_ = absl::InfiniteFuture();
  fluxion::v1::Usage usage_;
  fluxion::v1::GenerateTiming timing_;
  // Admit
  bool needs_state_ = false;
  int64_t pages_per_head_ = 0;
  int64_t meta_pages_ = 0;  // the side room's first pages: page metadata
  Clock::time_point t_admitted_{};
  Reservation kv_pages_;
  Reservation state_room_;
  // PrefillAndLand
  fluxion::v1::PrefillResponse landed_;
  PrefillTokens prefill_tokens_;  // landed_'s, checked against the request
  Clock::time_point t_prefilled_{};
  std::unique_ptr<SparseAttention> attention_;
  // JoinBatch
  std::shared_ptr<DecodeRequest> r_;
};

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_SERVING_GENERATE_CALL_H_

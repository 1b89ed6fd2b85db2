// The decode node's side of PrefillService: one channel per prefill address (cached), one call
// per request, and an ending that says whether the prefill node may still write into the pages
// it was given (docs/SERVING.md, "How a Prefill call ends and what happens to its pages"):
//
//   - the channel is connected first; if it cannot be (refused, unreachable), the request was
//     never sent and nobody has the pages' addresses;
//   - when the request is cancelled or its deadline passes while the prefill runs, Abort is sent
//     (repeatedly) and its reply awaited for `abort_wait`: the prefill node answers CANCELLED only
//     after its writes stopped, so the pages can be reused at once;
//   - any other answer of the prefill node proves it stopped too, except DEADLINE_EXCEEDED (its
//     own wait for the writes gave up: they may still land);
//   - an ending without its answer (connection broken after the request went out, no reply to
//     Abort in time) proves nothing: the caller quarantines the pages.
//
// Thread-safe.
#ifndef FLUXION_DECODE_SERVING_PREFILL_CLIENT_H_
#define FLUXION_DECODE_SERVING_PREFILL_CLIENT_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/grpc_transport.h"
#include "fluxion/v1/prefill.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace fluxion::decode {

// Why the pages of a call that ended may still be written (PrefillOutcome::hold).
enum class WriteHold {
  kNone,             // the prefill node stopped (it answered) or never got the request
  kNoReply,          // the call ended without its answer: connection lost after sending
  kAbortUnanswered,  // Abort sent, no answer within abort_wait: we cancelled the call
  kPeerGaveUp,       // it answered DEADLINE_EXCEEDED: its own wait for the writes ran out
};
const char* WriteHoldName(WriteHold hold);

struct PrefillOutcome {
  absl::StatusOr<fluxion::v1::PrefillResponse> response;
  // True when nobody can still write into the pages: the prefill node answered (hold kNone), or
  // the request never left this node. False: quarantine them (`hold` says why).
  bool peer_stopped = false;
  WriteHold hold = WriteHold::kNone;
  // False when the request was never sent (no connection could be made): a transport failure
  // that held nothing.
  bool sent = false;
  // The request's deadline passed during the call and this node aborted it: an expiry, not a
  // transport failure (`response` is DEADLINE_EXCEEDED then).
  bool expired = false;
  // `cancelled()` became true during the call and this node aborted it.
  bool cancelled = false;
};

struct PrefillClientOptions {
  // How long to wait for the prefill node's reply after sending Abort.
  absl::Duration abort_wait = absl::Seconds(2);
  // Longest wait for the channel to connect (also bounded by the call's deadline).
  absl::Duration connect_timeout = absl::Seconds(5);
};

class PrefillClient {
 public:
  // Channels use `channel` (credentials, keepalive): `fluxion decode` builds it from its
  // --prefill-tls-* flags (DecodeServiceOptions::prefill_channel); insecure by default.
  explicit PrefillClient(const PrefillClientOptions& options,
                         serving::ChannelConfig channel = {})
      : options_(options), channel_config_(std::move(channel)) {}
  explicit PrefillClient(absl::Duration abort_wait, serving::ChannelConfig channel = {})
      : PrefillClient(PrefillClientOptions{abort_wait}, std::move(channel)) {}

  // Calls Prefill at `address`; aborts it once `deadline` passes or `cancelled()` (polled every
  // 5 ms) returns true.
  PrefillOutcome Call(const std::string& address, const fluxion::v1::PrefillRequest& request,
                      absl::Time deadline, const std::function<bool()>& cancelled);

 private:
  std::shared_ptr<grpc::Channel> ChannelFor(const std::string& address);
  // OK once the channel is READY; Unavailable when it fails to connect, DeadlineExceeded /
  // Cancelled when the deadline passes or the request is cancelled first.
  absl::Status Connect(grpc::Channel& channel, const std::string& address, absl::Time deadline,
                       const std::function<bool()>& cancelled);

  const PrefillClientOptions options_;
  const serving::ChannelConfig channel_config_;
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_SERVING_PREFILL_CLIENT_H_

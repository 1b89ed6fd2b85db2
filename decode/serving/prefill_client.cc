#include "decode/serving/prefill_client.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/grpc_status.h"
#include "common/peer_failure.h"

namespace fluxion::decode {

namespace v1 = ::fluxion::v1;

const char* WriteHoldName(WriteHold hold) {
  switch (hold) {
    case WriteHold::kNone: return "none";
    case WriteHold::kNoReply: return "no_reply";
    case WriteHold::kAbortUnanswered: return "abort_unanswered";
    case WriteHold::kPeerGaveUp: return "peer_gave_up";
  }
  return "none";
}

std::shared_ptr<grpc::Channel> PrefillClient::ChannelFor(const std::string& address) {
  absl::MutexLock lock(&mu_);
  auto it = channels_.find(address);
  if (it != channels_.end()) return it->second;
  // Keepalive (a dead prefill node must surface as UNAVAILABLE quickly, not after TCP's own
  // timeouts) comes from the policy the prefill server accepts (common/grpc_transport.h).
  grpc::ChannelArguments args = serving::ChannelArguments(channel_config_);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  auto channel = serving::CreateChannel(address, channel_config_, args);
  channels_[address] = channel;
  return channel;
}

absl::Status PrefillClient::Connect(grpc::Channel& channel, const std::string& address,
                                    absl::Time deadline, const std::function<bool()>& cancelled) {
  const absl::Time give_up = std::min(deadline, absl::Now() + options_.connect_timeout);
  while (true) {
    const grpc_connectivity_state state = channel.GetState(/*try_to_connect=*/true);
    if (state == GRPC_CHANNEL_READY) return absl::OkStatus();
    if (state == GRPC_CHANNEL_TRANSIENT_FAILURE || state == GRPC_CHANNEL_SHUTDOWN) {
      return absl::UnavailableError(
          "cannot connect (refused or unreachable); the request was not sent: check that the "
          "prefill node runs at that address");
    }
    if (cancelled()) return absl::CancelledError("cancelled before the prefill node was reached");
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(
          "the request's deadline passed before the prefill node was reached; it was not sent");
    }
    if (now >= give_up) {
      return absl::UnavailableError(absl::StrCat(
          "no connection within ", absl::FormatDuration(options_.connect_timeout),
          "; the request was not sent"));
    }
    channel.WaitForStateChange(state,
                               absl::ToChronoTime(std::min(give_up, now + absl::Milliseconds(10))));
  }
}

PrefillOutcome PrefillClient::Call(const std::string& address, const v1::PrefillRequest& request,
                                   absl::Time deadline, const std::function<bool()>& cancelled) {
  PrefillOutcome out;
  auto annotate = [&address](const absl::Status& s) {
    return absl::Status(s.code(), PrefillFailureMessage(address, s.message()));
  };
  auto channel = ChannelFor(address);
  // 1. Connect before sending: a call that fails here never left this node, so nobody holds the
  // pages' addresses and they are free at once.
  if (absl::Status c = Connect(*channel, address, deadline, cancelled); !c.ok()) {
    out.peer_stopped = true;
    out.sent = false;
    out.expired = absl::IsDeadlineExceeded(c);
    out.cancelled = absl::IsCancelled(c);
    out.response = annotate(c);
    return out;
  }
  out.sent = true;

  // 2. The call. Its own gRPC deadline lies past our abort window, so that at the request's
  // deadline we abort it like a cancellation and get the prefill node's answer (CANCELLED once its
  // writes stopped) instead of a local DEADLINE_EXCEEDED that proves nothing.
  auto stub = v1::PrefillService::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(
      absl::ToChronoTime(deadline + options_.abort_wait + absl::Seconds(1)));
  v1::PrefillResponse response;
  grpc::Status status;
  absl::Notification done;
  stub->async()->Prefill(&context, &request, &response, [&](grpc::Status s) {
    status = std::move(s);
    done.Notify();
  });
  bool aborting = false, gave_up = false;
  absl::Time give_up = absl::InfiniteFuture(), next_abort = absl::InfinitePast();
  while (!done.WaitForNotificationWithTimeout(absl::Milliseconds(5))) {
    if (!aborting) {
      if (cancelled()) {
        aborting = out.cancelled = true;
      } else if (absl::Now() >= deadline) {
        aborting = out.expired = true;
      }
      if (aborting) give_up = absl::Now() + options_.abort_wait;
    }
    // Abort is idempotent and ignores ids the prefill node has not seen yet, so it is repeated
    // until the reply comes: an Abort that overtakes its Prefill call is not lost.
    if (aborting && absl::Now() >= next_abort) {
      next_abort = absl::Now() + absl::Milliseconds(50);
      grpc::ClientContext abort_context;
      abort_context.set_deadline(
          absl::ToChronoTime(std::min(give_up, absl::Now() + absl::Milliseconds(500))));
      v1::AbortRequest abort;
      abort.add_request_ids(request.request_id());
      abort.set_reason(out.expired ? "deadline passed on the decode node"
                                   : "cancelled on the decode node");
      v1::AbortResponse ignored;
      (void)stub->Abort(&abort_context, abort, &ignored);
    }
    if (aborting && absl::Now() >= give_up) {
      gave_up = true;
      context.TryCancel();
      done.WaitForNotification();
      break;
    }
  }
  if (status.ok()) {  // also when it finished just as we aborted: its writes completed
    out.response = std::move(response);
    out.peer_stopped = true;
    return out;
  }
  const absl::Status s = FromGrpcStatus(status);
  if (gave_up) {
    out.hold = WriteHold::kAbortUnanswered;
  } else {
    switch (s.code()) {
      case absl::StatusCode::kDeadlineExceeded:  // its own wait for the writes ran out
        out.hold = WriteHold::kPeerGaveUp;
        break;
      case absl::StatusCode::kUnavailable:  // the connection may have broken after sending
      case absl::StatusCode::kInternal:
      case absl::StatusCode::kUnknown:
        out.hold = WriteHold::kNoReply;
        break;
      default:  // the prefill node's own answer (CANCELLED: to our Abort), after its writes stopped
        out.hold = WriteHold::kNone;
    }
  }
  out.peer_stopped = out.hold == WriteHold::kNone;
  if (out.expired) {
    out.response = annotate(absl::DeadlineExceededError(absl::StrCat(
        "the deadline (the request's own, or --prefill-timeout-ms) passed during its prefill; "
        "aborted (",
        out.peer_stopped ? "the prefill node confirmed it stopped writing)"
                         : "no confirmation that its writes stopped: the pages are quarantined)")));
  } else {
    out.response = annotate(s);
  }
  return out;
}

}  // namespace fluxion::decode

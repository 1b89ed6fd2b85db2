#include "decode/prefill_client.h"

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/grpc_status.h"

namespace fluxion::decode {

namespace v1 = ::fluxion::v1;

namespace {

absl::Mutex g_default_mu(absl::kConstInit);
serving::ChannelConfig* g_default_channel ABSL_GUARDED_BY(g_default_mu) = nullptr;

}  // namespace

void PrefillClient::SetDefaultChannelConfig(serving::ChannelConfig channel) {
  absl::MutexLock lock(&g_default_mu);
  delete g_default_channel;
  g_default_channel = new serving::ChannelConfig(std::move(channel));
}

serving::ChannelConfig PrefillClient::DefaultChannelConfig() {
  absl::MutexLock lock(&g_default_mu);
  return g_default_channel != nullptr ? *g_default_channel : serving::ChannelConfig();
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

PrefillOutcome PrefillClient::Call(const std::string& address, const v1::PrefillRequest& request,
                                   absl::Time deadline, const std::function<bool()>& cancelled) {
  auto channel = ChannelFor(address);
  auto stub = v1::PrefillService::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(deadline));
  v1::PrefillResponse response;
  grpc::Status status;
  absl::Notification done;
  stub->async()->Prefill(&context, &request, &response, [&](grpc::Status s) {
    status = std::move(s);
    done.Notify();
  });
  bool abort_sent = false, we_cancelled = false;
  absl::Time give_up = absl::InfiniteFuture(), next_abort = absl::InfinitePast();
  while (!done.WaitForNotificationWithTimeout(absl::Milliseconds(5))) {
    if (!abort_sent && cancelled()) {
      abort_sent = true;
      give_up = absl::Now() + abort_wait_;
    }
    // Abort is idempotent and ignores ids the prefill node has not seen yet, so it is repeated
    // until the reply comes: an Abort that overtakes its Prefill call is not lost.
    if (abort_sent && absl::Now() >= next_abort) {
      next_abort = absl::Now() + absl::Milliseconds(50);
      grpc::ClientContext abort_context;
      abort_context.set_deadline(absl::ToChronoTime(std::min(give_up, absl::Now() + absl::Milliseconds(500))));
      v1::AbortRequest abort;
      abort.add_request_ids(request.request_id());
      abort.set_reason("cancelled on the decode node");
      v1::AbortResponse ignored;
      (void)stub->Abort(&abort_context, abort, &ignored);
    }
    if (abort_sent && absl::Now() >= give_up) {
      we_cancelled = true;
      context.TryCancel();
      done.WaitForNotification();
      break;
    }
  }
  PrefillOutcome out;
  if (status.ok()) {
    out.response = std::move(response);
    out.peer_stopped = true;
    return out;
  }
  const absl::Status s = FromGrpcStatus(status);
  out.response = absl::Status(s.code(), absl::StrCat("prefill node ", address, ": ", s.message()));
  switch (s.code()) {
    // Answers the prefill node gives itself, after validation or after its writes stopped.
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kUnimplemented:
      out.peer_stopped = true;
      break;
    case absl::StatusCode::kCancelled:
      out.peer_stopped = !we_cancelled;  // its reply to our Abort, not our own TryCancel
      break;
    default:  // Unavailable, DeadlineExceeded, Internal, Unknown: nothing proven
      out.peer_stopped = false;
  }
  return out;
}

}  // namespace fluxion::decode

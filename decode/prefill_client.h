// The decode node's side of PrefillService: one channel per prefill address (cached), one call
// per request, and cancellation that respects the protocol: when the request is cancelled while
// its prefill runs, send Abort and wait (bounded) for the prefill node's reply, because only a
// reply proves it stopped writing into our pages. Without one, the pages must be quarantined.
//
// Thread-safe.
#ifndef FLUXION_DECODE_PREFILL_CLIENT_H_
#define FLUXION_DECODE_PREFILL_CLIENT_H_

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

struct PrefillOutcome {
  absl::StatusOr<fluxion::v1::PrefillResponse> response;
  // True when the prefill node itself answered (OK, or an error it returned): it has stopped
  // writing and the pages may be reused. False when the call ended without its answer (broken
  // connection, deadline, our own cancellation): writes may still be in flight.
  bool peer_stopped = false;
};

class PrefillClient {
 public:
  // `abort_wait`: how long to wait for the prefill node's reply after sending Abort. Channels
  // use `channel` (credentials, keepalive), or the process default.
  explicit PrefillClient(absl::Duration abort_wait)
      : PrefillClient(abort_wait, DefaultChannelConfig()) {}
  PrefillClient(absl::Duration abort_wait, serving::ChannelConfig channel)
      : abort_wait_(abort_wait), channel_config_(std::move(channel)) {}

  // The process default: what `fluxion decode` builds from its --prefill-tls-* flags, set before
  // it builds the service (DecodeServiceImpl constructs its client with the one-argument
  // constructor). Insecure until set.
  static void SetDefaultChannelConfig(serving::ChannelConfig channel);
  static serving::ChannelConfig DefaultChannelConfig();

  // Calls Prefill at `address` until `deadline`, polling `cancelled` every 10 ms.
  PrefillOutcome Call(const std::string& address, const fluxion::v1::PrefillRequest& request,
                      absl::Time deadline, const std::function<bool()>& cancelled);

 private:
  std::shared_ptr<grpc::Channel> ChannelFor(const std::string& address);

  const absl::Duration abort_wait_;
  const serving::ChannelConfig channel_config_;
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_PREFILL_CLIENT_H_

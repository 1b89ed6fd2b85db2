// How every Fluxion gRPC channel and server is built: one keepalive policy that clients and
// servers agree on, and the channel constructor every client uses (docs/TLS.md, "Keepalive").
//
// Why one place: a client that pings more often than the server's ping policy allows is sent
// GOAWAY `too_many_pings` (ENHANCE_YOUR_CALM), which kills the calls in flight with UNAVAILABLE.
// The decode node's channel to the prefill node pinged every 2 s, idle or not, while the prefill
// server kept grpc's default policy (pings without calls refused, at most one per 5 minutes
// without data): a spurious `peer_unreachable` after a couple of idle minutes.
//
// Thread-safe (pure functions).
#ifndef FLUXION_COMMON_GRPC_TRANSPORT_H_
#define FLUXION_COMMON_GRPC_TRANSPORT_H_

#include <memory>
#include <string>

#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/server_interceptor.h"

namespace fluxion::serving {

struct KeepalivePolicy {
  // A client pings after this long without traffic, with or without calls open, so that a dead
  // peer surfaces as UNAVAILABLE within ping_interval + ping_timeout rather than after TCP's
  // timeouts (minutes).
  absl::Duration ping_interval = absl::Seconds(2);
  // ... and closes the connection when the ping is not answered within this.
  absl::Duration ping_timeout = absl::Seconds(2);

  // What a server accepts: one ping per half interval (timers jitter), calls open or not.
  absl::Duration min_accepted_ping_interval() const { return ping_interval / 2; }
};

// The client side of `policy`, added to `args`.
void SetClientKeepalive(const KeepalivePolicy& policy, grpc::ChannelArguments* args);

// The server side of `policy`: pings from SetClientKeepalive() clients are always accepted.
void SetServerPingPolicy(const KeepalivePolicy& policy, grpc::ServerBuilder* builder);

// A server interceptor that turns grpc's answer to a request that does not parse as the method's
// request message into INVALID_ARGUMENT naming the method. grpc 1.51 answers INTERNAL with an
// empty message from sync services (GenericDeserialize reports proto3's empty
// InitializationErrorString()) and UNIMPLEMENTED with an empty message from callback services
// (the router). The call never reaches the service either way. Unary and server-streaming
// methods (all of fluxion.v1).
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
UnparsableRequestInterceptorFactory();

// What a client channel needs besides its target.
struct ChannelConfig {
  std::shared_ptr<grpc::ChannelCredentials> credentials;  // nullptr: insecure
  std::string tls_server_name;  // checked instead of the target's host when not empty
  KeepalivePolicy keepalive;
};

// `config`'s channel arguments: keepalive and the TLS name override. Callers add their own
// (reconnect backoff) before CreateChannel().
grpc::ChannelArguments ChannelArguments(const ChannelConfig& config);

// A channel to `target` with `config`'s credentials and `args` (default: ChannelArguments()).
std::shared_ptr<grpc::Channel> CreateChannel(const std::string& target,
                                             const ChannelConfig& config);
std::shared_ptr<grpc::Channel> CreateChannel(const std::string& target, const ChannelConfig& config,
                                             const grpc::ChannelArguments& args);

}  // namespace fluxion::serving

#endif  // FLUXION_COMMON_GRPC_TRANSPORT_H_

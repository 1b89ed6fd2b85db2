#include "common/grpc_transport.h"

#include <algorithm>
#include <string>

namespace fluxion::serving {
namespace {

int Millis(absl::Duration d) {
  return static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(d), 1, INT32_MAX));
}

namespace hooks = grpc::experimental;

class UnparsableRequestInterceptor : public hooks::Interceptor {
 public:
  explicit UnparsableRequestInterceptor(hooks::ServerRpcInfo* info) : info_(info) {}

  void Intercept(hooks::InterceptorBatchMethods* methods) override {
    // The request of a unary or server-streaming call is the first message received; the server
    // deserializes it before this hook and passes nullptr when that failed.
    if (methods->QueryInterceptionHookPoint(hooks::InterceptionHookPoints::POST_RECV_MESSAGE) &&
        !seen_request_) {
      seen_request_ = true;
      unparsable_ = methods->GetRecvMessage() == nullptr;
    }
    // The method never ran, so the status is grpc's own: INTERNAL from sync handlers,
    // UNIMPLEMENTED from callback ones (both with an empty message).
    if (unparsable_ &&
        methods->QueryInterceptionHookPoint(hooks::InterceptionHookPoints::PRE_SEND_STATUS) &&
        !methods->GetSendStatus().ok()) {
      methods->ModifySendStatus(grpc::Status(
          grpc::StatusCode::INVALID_ARGUMENT,
          std::string("the request to ") + info_->method() +
              " is not a serialized protobuf message of the method's request type (is the "
              "client sending raw bytes, or built from another .proto?)"));
    }
    methods->Proceed();
  }

 private:
  hooks::ServerRpcInfo* const info_;
  bool seen_request_ = false;
  bool unparsable_ = false;
};

class UnparsableRequestFactory : public hooks::ServerInterceptorFactoryInterface {
 public:
  hooks::Interceptor* CreateServerInterceptor(hooks::ServerRpcInfo* info) override {
    // Client- and bidi-streaming calls read later, where nullptr also means the end of the stream.
    if (info->type() != hooks::ServerRpcInfo::Type::UNARY &&
        info->type() != hooks::ServerRpcInfo::Type::SERVER_STREAMING) {
      return nullptr;
    }
    return new UnparsableRequestInterceptor(info);
  }
};

}  // namespace

std::unique_ptr<hooks::ServerInterceptorFactoryInterface> UnparsableRequestInterceptorFactory() {
  return std::make_unique<UnparsableRequestFactory>();
}

void SetClientKeepalive(const KeepalivePolicy& policy, grpc::ChannelArguments* args) {
  args->SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, Millis(policy.ping_interval));
  args->SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, Millis(policy.ping_timeout));
  args->SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // grpc stops pinging after 2 pings without data and waits 5 minutes between pings without
  // data by default; the point of the keepalive is to notice a dead peer on a quiet channel.
  args->SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  args->SetInt(GRPC_ARG_HTTP2_MIN_SENT_PING_INTERVAL_WITHOUT_DATA_MS, Millis(policy.ping_interval));
}

void SetServerPingPolicy(const KeepalivePolicy& policy, grpc::ServerBuilder* builder) {
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                              Millis(policy.min_accepted_ping_interval()));
  // grpc's default, stated: a client that still pings too often is told to stop after two.
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 2);
}

grpc::ChannelArguments ChannelArguments(const ChannelConfig& config) {
  grpc::ChannelArguments args;
  SetClientKeepalive(config.keepalive, &args);
  if (!config.tls_server_name.empty()) {
    args.SetSslTargetNameOverride(config.tls_server_name);
  }
  return args;
}

std::shared_ptr<grpc::Channel> CreateChannel(const std::string& target,
                                             const ChannelConfig& config) {
  return CreateChannel(target, config, ChannelArguments(config));
}

std::shared_ptr<grpc::Channel> CreateChannel(const std::string& target, const ChannelConfig& config,
                                             const grpc::ChannelArguments& args) {
  std::shared_ptr<grpc::ChannelCredentials> credentials = config.credentials;
  if (credentials == nullptr) credentials = grpc::InsecureChannelCredentials();
  return grpc::CreateCustomChannel(target, credentials, args);
}

}  // namespace fluxion::serving

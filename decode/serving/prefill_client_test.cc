// The decode node's prefill client against a real in-process PrefillService over mutual TLS:
// the node-to-node path with client certificates required.
#include "decode/serving/prefill_client.h"

#include <memory>
#include <string>

#include "common/grpc_security.h"
#include "common/grpc_testing.h"
#include "common/server_main.h"
#include "common/test_temp_dir.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fluxion::decode {
namespace {

namespace v1 = ::fluxion::v1;
using ::testing::HasSubstr;

class EchoPrefillService final : public v1::PrefillService::Service {
 public:
  grpc::Status Prefill(grpc::ServerContext*, const v1::PrefillRequest* request,
                       v1::PrefillResponse* response) override {
    response->set_node_name("echo:" + request->request_id());
    return grpc::Status::OK;
  }
};

class PrefillClientTlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!serving::testing::HaveOpenssl()) GTEST_SKIP() << "openssl not installed (tools/setup.sh)";
    ASSERT_TRUE(serving::testing::MakeTestPki(dir_.dir(), &pki_).ok());
    auto credentials = serving::ServerCredentials(pki_.Server(/*require_client_cert=*/true));
    ASSERT_TRUE(credentials.ok()) << credentials.status();
    serving::GrpcServerOptions options;
    options.credentials = *credentials;
    int port = 0;
    auto server = serving::StartGrpcServer("127.0.0.1:0", &service_, &port, options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    address_ = "localhost:" + std::to_string(port);
  }

  serving::ChannelConfig Config(bool with_cert) {
    auto config = serving::ClientChannelConfig(pki_.Client(with_cert));
    EXPECT_TRUE(config.ok()) << config.status();
    return *config;
  }

  PrefillOutcome Call(PrefillClient& client) {
    v1::PrefillRequest request;
    request.set_request_id("r1");
    return client.Call(address_, request, absl::Now() + absl::Seconds(20), [] { return false; });
  }

  ScopedTestTempDir dir_;
  serving::testing::TestPki pki_;
  EchoPrefillService service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

// DecodeServiceImpl builds its client from DecodeServiceOptions::prefill_channel, which
// `fluxion decode` fills from its --prefill-tls-* flags.
TEST_F(PrefillClientTlsTest, DecodeToPrefillWorksOverMutualTls) {
  PrefillClient client(absl::Seconds(1), Config(/*with_cert=*/true));
  PrefillOutcome outcome = Call(client);
  ASSERT_TRUE(outcome.response.ok()) << outcome.response.status();
  EXPECT_EQ(outcome.response->node_name(), "echo:r1");
  EXPECT_TRUE(outcome.peer_stopped);
}

TEST_F(PrefillClientTlsTest, ADecodeNodeWithoutAClientCertificateIsRefused) {
  PrefillClient client(absl::Seconds(1), Config(/*with_cert=*/false));
  PrefillOutcome outcome = Call(client);
  EXPECT_EQ(outcome.response.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(outcome.response.status().message(), HasSubstr(address_));
  // The channel never connected (the handshake was refused), so the request was never sent and
  // nothing can be writing: the pages may be freed at once (docs/SERVING.md, "How a Prefill call
  // ends").
  EXPECT_TRUE(outcome.peer_stopped);
  // The insecure default reaches no TLS server either.
  PrefillClient plain(absl::Seconds(1));
  EXPECT_EQ(Call(plain).response.status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace fluxion::decode

// The router's channels to its nodes over mutual TLS (--backend-tls-*): health checks and GetLoad
// reach a decode node that requires client certificates only with the router's certificate.
#include <memory>
#include <string>

#include "absl/time/clock.h"
#include "cluster/backends.h"
#include "common/grpc_security.h"
#include "common/grpc_testing.h"
#include "common/server_main.h"
#include "common/test_temp_dir.h"
#include "gtest/gtest.h"
#include "grpcpp/health_check_service_interface.h"

namespace fluxion::cluster {
namespace {

class LoadOnlyDecodeService final : public v1::DecodeService::Service {
 public:
  grpc::Status GetLoad(grpc::ServerContext*, const v1::GetLoadRequest*,
                       v1::DecodeLoad* load) override {
    load->set_total_kv_pages(100);
    load->set_free_kv_pages(100);
    return grpc::Status::OK;
  }
};

class BackendsTlsTest : public ::testing::Test {
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
    server_->GetHealthCheckService()->SetServingStatus("fluxion.v1.DecodeService", true);
    address_ = "localhost:" + std::to_string(port);
  }

  // Polls (each round bounded by rpc_timeout) until the node is healthy or `rounds` pass.
  std::unique_ptr<Backends> PollWith(const serving::ClientTlsOptions& tls, int rounds) {
    Backends::Options options;
    options.decode_addresses = {address_};
    options.start_poller = false;
    options.rpc_timeout = absl::Seconds(5);  // a TLS handshake on a loaded machine
    auto config = serving::ClientChannelConfig(tls);
    EXPECT_TRUE(config.ok()) << config.status();
    options.channel = *config;
    auto backends = Backends::Create(options);
    EXPECT_TRUE(backends.ok()) << backends.status();
    for (int i = 0; i < rounds && (*backends)->HealthyCount(Role::kDecode) == 0; ++i) {
      (*backends)->PollOnce();
    }
    return *std::move(backends);
  }

  ScopedTestTempDir dir_;
  serving::testing::TestPki pki_;
  LoadOnlyDecodeService service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

TEST_F(BackendsTlsTest, RouterWithAClientCertificateSeesTheNodeHealthy) {
  auto backends = PollWith(pki_.Client(/*with_cert=*/true), 10);
  EXPECT_EQ(backends->HealthyCount(Role::kDecode), 1);
  EXPECT_EQ(backends->Snapshot(Role::kDecode)[0].decode_load.free_kv_pages(), 100u);
}

TEST_F(BackendsTlsTest, RouterWithoutOneIsRefused) {
  auto without_cert = PollWith(pki_.Client(/*with_cert=*/false), 3);
  EXPECT_EQ(without_cert->HealthyCount(Role::kDecode), 0);
  auto plain = PollWith(serving::ClientTlsOptions(), 3);
  EXPECT_EQ(plain->HealthyCount(Role::kDecode), 0);
  EXPECT_FALSE(plain->Snapshot(Role::kDecode)[0].last_error.empty());
}

}  // namespace
}  // namespace fluxion::cluster

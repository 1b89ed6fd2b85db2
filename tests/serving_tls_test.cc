// The `fluxion` binary's TLS flags end to end: a prefill node that requires client certificates,
// a decode node that presents one on its channel to it (--prefill-tls-*) and serves TLS itself,
// and a client over TLS. Real processes, real UCX over TCP loopback, the tiny model.
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "common/grpc_security.h"
#include "common/grpc_testing.h"
#include "common/grpc_transport.h"
#include "common/test_temp_dir.h"
#include "gtest/gtest.h"
#include "grpcpp/generic/generic_stub.h"
#include "tests/serving_cluster.h"

namespace fluxion::testing {
namespace {

namespace v1 = ::fluxion::v1;

struct Streamed {
  grpc::Status status;
  std::vector<uint32_t> tokens;
  bool complete = false;
};

Streamed Generate(const std::shared_ptr<grpc::Channel>& channel,
                  const v1::GenerateRequest& request) {
  auto stub = v1::DecodeService::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  auto reader = stub->Generate(&context, request);
  Streamed out;
  v1::GenerateResponse message;
  while (reader->Read(&message)) {
    for (uint32_t t : message.chunk().token_ids()) out.tokens.push_back(t);
    if (message.has_complete()) out.complete = true;
  }
  out.status = reader->Finish();
  return out;
}

class ServingTlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!serving::testing::HaveOpenssl()) GTEST_SKIP() << "openssl not installed (tools/setup.sh)";
    ASSERT_TRUE(serving::testing::MakeTestPki(dir_.dir(), &pki_).ok());
  }

  std::vector<std::string> ServerTlsArgs(bool require_client_cert) const {
    std::vector<std::string> args = {"--tls-cert", pki_.server_cert, "--tls-key", pki_.server_key};
    if (require_client_cert) {
      args.insert(args.end(), {"--tls-client-ca", pki_.ca, "--tls-require-client-cert"});
    }
    return args;
  }

  ScopedTestTempDir dir_;
  serving::testing::TestPki pki_;
};

TEST_F(ServingTlsTest, DecodeReachesAPrefillNodeThatRequiresClientCertificates) {
  std::vector<std::string> ucx = UcxArgs("tcp");
  std::vector<std::string> pargs = {"--model", TinyModelDir()};
  pargs.insert(pargs.end(), ucx.begin(), ucx.end());
  for (const std::string& a : ServerTlsArgs(/*require_client_cert=*/true)) pargs.push_back(a);
  auto prefill = ServerProcess::Start("prefill", pargs);
  ASSERT_NE(prefill, nullptr);

  std::vector<std::string> dargs = {"--model", TinyModelDir(), "--kv-pages", "1024",
                                    "--nohuge-pages", "--prefill-address", prefill->address(),
                                    "--prefill-tls-ca", pki_.ca, "--prefill-tls-cert",
                                    pki_.client_cert, "--prefill-tls-key", pki_.client_key};
  dargs.insert(dargs.end(), ucx.begin(), ucx.end());
  for (const std::string& a : ServerTlsArgs(/*require_client_cert=*/false)) dargs.push_back(a);
  auto decode = ServerProcess::Start("decode", dargs);
  ASSERT_NE(decode, nullptr);

  auto config = serving::ClientChannelConfig(pki_.Client(/*with_cert=*/false));
  ASSERT_TRUE(config.ok()) << config.status();
  auto channel = serving::CreateChannel(decode->address(), *config);
  Streamed r =
      Generate(channel, GreedyRequest("tls-1", BytePrompt("the key is 42."), 4, "full", ""));
  ASSERT_TRUE(r.status.ok()) << r.status.error_code() << ": " << r.status.error_message() << "\n"
                             << decode->Log();
  EXPECT_TRUE(r.complete);
  EXPECT_EQ(r.tokens.size(), 4u);

  // A plain client is refused by the decode node's TLS server.
  Streamed plain = Generate(serving::CreateChannel(decode->address(), serving::ChannelConfig()),
                            GreedyRequest("tls-2", BytePrompt("x"), 1, "full", ""));
  EXPECT_EQ(plain.status.error_code(), grpc::StatusCode::UNAVAILABLE);

  // Garbage bytes to the live decode service: INVALID_ARGUMENT naming the method (the service's
  // own code never sees them).
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
  const std::string garbage("\x0a\x7f\x01\x02", 4);
  grpc::Slice slice(garbage);
  grpc::ByteBuffer request(&slice, 1), response;
  grpc::Status status;
  absl::Notification done;
  stub.UnaryCall(&context, "/fluxion.v1.DecodeService/Generate", grpc::StubOptions(), &request,
                 &response, [&](grpc::Status s) {
                   status = std::move(s);
                   done.Notify();
                 });
  done.WaitForNotification();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
}

// Without --prefill-tls-cert the prefill node refuses the decode node: the request fails with
// UNAVAILABLE naming the prefill node, not a hang or a crash.
TEST_F(ServingTlsTest, DecodeWithoutAClientCertificateIsRefusedByThePrefillNode) {
  std::vector<std::string> ucx = UcxArgs("tcp");
  std::vector<std::string> pargs = {"--model", TinyModelDir()};
  pargs.insert(pargs.end(), ucx.begin(), ucx.end());
  for (const std::string& a : ServerTlsArgs(/*require_client_cert=*/true)) pargs.push_back(a);
  auto prefill = ServerProcess::Start("prefill", pargs);
  ASSERT_NE(prefill, nullptr);
  std::vector<std::string> dargs = {"--model", TinyModelDir(), "--kv-pages", "1024",
                                    "--nohuge-pages", "--prefill-address", prefill->address(),
                                    "--prefill-tls-ca", pki_.ca, "--quarantine-ms", "100"};
  dargs.insert(dargs.end(), ucx.begin(), ucx.end());
  auto decode = ServerProcess::Start("decode", dargs);
  ASSERT_NE(decode, nullptr);
  Streamed r = Generate(serving::CreateChannel(decode->address(), serving::ChannelConfig()),
                        GreedyRequest("tls-3", BytePrompt("x"), 1, "full", ""));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE) << r.status.error_message();
  EXPECT_NE(r.status.error_message().find("prefill node"), std::string::npos)
      << r.status.error_message();
}

}  // namespace
}  // namespace fluxion::testing

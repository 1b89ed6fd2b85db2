// Forged KV targets against real processes (docs/SECURITY.md, "Sealed prefill requests"): a
// `fluxion prefill` and a `fluxion decode` over UCX (TCP on loopback, and shared memory), and an
// attacker who can reach the prefill node's gRPC port and has captured one real PrefillRequest (a
// recording prefill node the decode node trusts hands it over). The attacker re-targets the
// captured request -- one range widened to the whole arena, one moved beyond it, the seal
// stripped -- and sends it to the real prefill node while another request decodes. Each must be
// refused (PERMISSION_DENIED) before anything is written. The captured request replayed as it is
// (a valid seal the prefill node never saw) after its reservation ended must fail at the decode
// node, whose landings for it are revoked. Throughout, the decoding request's tokens equal an
// undisturbed run's, and both nodes keep serving.
#include <algorithm>
#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/server_main.h"
#include "common/wait_testing.h"
#include "fluxion/v1/prefill.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/serving_cluster.h"
#include "transfer/descriptor_check.h"

namespace fluxion::testing {
namespace {

namespace v1 = ::fluxion::v1;

// A prefill node the decode node trusts that keeps the first request it gets and refuses it.
class RecordingPrefill final : public v1::PrefillService::Service {
 public:
  grpc::Status Prefill(grpc::ServerContext*, const v1::PrefillRequest* request,
                       v1::PrefillResponse*) override {
    absl::MutexLock lock(&mu_);
    if (!captured_.has_value()) captured_ = *request;
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "recorded");
  }
  std::optional<v1::PrefillRequest> captured() {
    absl::MutexLock lock(&mu_);
    return captured_;
  }

 private:
  absl::Mutex mu_;
  std::optional<v1::PrefillRequest> captured_ ABSL_GUARDED_BY(mu_);
};

grpc::Status SendPrefill(const std::string& address, const v1::PrefillRequest& request) {
  auto stub = v1::PrefillService::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  v1::PrefillResponse response;
  return stub->Prefill(&context, request, &response);
}

// What the attacker does with a captured request: one range of `base` and the arena's length, its
// key's envelope re-wrapped with that scope (the CRC is no secret), every other range dropped and
// the pages, sparse state and page metadata counted from `base`.
void Retarget(uint64_t base, v1::PrefillRequest* r) {
  v1::KvTarget* kv = r->mutable_kv_target();
  absl::StatusOr<transfer::UnwrappedBlob> key = transfer::UnwrapBlob(
      transfer::BlobField::kRemoteKey, kv->ranges(0).remote_key(), transfer::kMaxUcxRemoteKeyBytes);
  ASSERT_TRUE(key.ok()) << key.status();
  v1::RemoteRange range;
  range.set_base_address(base);
  range.set_length(kv->arena_bytes());
  range.set_remote_key(transfer::WrapBlob(transfer::BlobField::kRemoteKey, key->payload, base,
                                          kv->arena_bytes()));
  kv->clear_ranges();
  *kv->add_ranges() = range;
  kv->set_arena_base_address(base);
  if (r->has_sparse_target()) r->mutable_sparse_target()->set_base_address(base);
  if (r->has_page_meta_target()) r->mutable_page_meta_target()->set_base_address(base);
}

class ServingForgeryTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ServingForgeryTest, RetargetedCapturedRequestsAreRefusedAndWriteNothing) {
  RecordingPrefill recorder;
  int recorder_port = 0;
  auto recorder_server = serving::StartGrpcServer("127.0.0.1:0", &recorder, &recorder_port);
  ASSERT_TRUE(recorder_server.ok()) << recorder_server.status();
  const std::string recorder_address = absl::StrCat("127.0.0.1:", recorder_port);

  std::vector<std::string> ucx = UcxArgs(GetParam());
  std::vector<std::string> pargs = {"--model", TinyModelDir()};
  pargs.insert(pargs.end(), ucx.begin(), ucx.end());
  auto prefill = ServerProcess::Start("prefill", pargs);
  ASSERT_NE(prefill, nullptr);
  std::vector<std::string> dargs = {"--model", TinyModelDir(), "--kv-pages", "4096",
                                    "--prefill-address",
                                    prefill->address() + "," + recorder_address,
                                    "--quarantine-ms", "1000", "--nohuge-pages"};
  dargs.insert(dargs.end(), ucx.begin(), ucx.end());
  auto decode = ServerProcess::Start("decode", dargs);
  ASSERT_NE(decode, nullptr);
  DecodeClient client(decode->address());

  // The capture: a request sent through the recorder (it fails there, as the attacker wants).
  const std::vector<uint32_t> prompt = BytePrompt("The key to the blue vault is 4417. The key is");
  GenerateResult captured_call =
      client.Generate(GreedyRequest("victim-capture", prompt, 4, "full", recorder_address));
  EXPECT_FALSE(captured_call.status.ok() && !captured_call.has_error);
  std::optional<v1::PrefillRequest> captured = recorder.captured();
  ASSERT_TRUE(captured.has_value());
  ASSERT_TRUE(captured->has_seal());
  ASSERT_GT(captured->kv_target().ranges_size(), 0);

  // An undisturbed run of the request that will decode during the attack.
  const v1::GenerateRequest long_request =
      GreedyRequest("decoding", prompt, 1500, "full", prefill->address());
  const GenerateResult undisturbed = client.Generate(long_request, absl::Seconds(120));
  ASSERT_TRUE(undisturbed.status.ok()) << undisturbed.status.error_message();
  ASSERT_EQ(undisturbed.tokens.size(), 1500u);

  std::vector<std::pair<std::string, v1::PrefillRequest>> forgeries;
  // One range over the whole arena (its key re-wrapped with that scope and the envelope's CRC
  // recomputed), and another prompt of the same length: its KV differs from what the pages hold
  // and lands in the captured request's page ids, which the decoding request (same length,
  // allocated first-fit after the capture freed them) now owns.
  v1::PrefillRequest widened = *captured;
  std::reverse(widened.mutable_prompt_token_ids()->begin(),
               widened.mutable_prompt_token_ids()->end());
  Retarget(widened.kv_target().arena_base_address(), &widened);
  forgeries.emplace_back("widened", widened);
  // The same, moved a GiB past the arena's end.
  v1::PrefillRequest beyond = *captured;
  Retarget(beyond.kv_target().arena_base_address() + beyond.kv_target().arena_bytes() +
               (uint64_t{1} << 30),
           &beyond);
  forgeries.emplace_back("beyond the arena", beyond);
  v1::PrefillRequest unsealed = *captured;
  unsealed.clear_seal();
  forgeries.emplace_back("unsealed", unsealed);

  // The captured request itself, seal intact, replayed after its reservation ended (the recorder
  // answered, so the decode node revoked its keys and its pages went to the decoding request).
  // The seal is valid and this prefill node never saw it, so it acts on it; the decode node
  // refuses every write to the revoked landings, and the call fails.
  const v1::PrefillRequest stale = *captured;

  GenerateResult disturbed;
  std::atomic<bool> victim_done{false};
  std::thread victim([&] {
    disturbed = client.Generate(long_request, absl::Seconds(120));
    victim_done = true;
  });
  // Until it decodes (prefilled, not finished). A victim that finished first makes the check
  // below weaker, never wrong.
  WaitFor([&] {
    if (victim_done) return true;
    const v1::DecodeLoad load = client.Load();
    return load.running_requests() == 1 && load.prefilling_requests() == 0;
  });
  for (const auto& [what, forged] : forgeries) {
    const grpc::Status s = SendPrefill(prefill->address(), forged);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED)
        << what << ": " << s.error_message();
  }
  const grpc::Status stale_status = SendPrefill(prefill->address(), stale);
  EXPECT_FALSE(stale_status.ok()) << "a stale target took the prefill node's writes";
  victim.join();
  ASSERT_TRUE(disturbed.status.ok()) << disturbed.status.error_message() << "\n" << decode->Log();
  EXPECT_EQ(disturbed.tokens, undisturbed.tokens) << "a forged write reached the decoding request";

  // Both nodes keep serving.
  const GenerateResult after =
      client.Generate(GreedyRequest("after", prompt, 8, "full", prefill->address()));
  EXPECT_TRUE(after.status.ok()) << after.status.error_message();
  EXPECT_EQ(after.tokens.size(), 8u);
  recorder_server->get()->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

INSTANTIATE_TEST_SUITE_P(Ucx, ServingForgeryTest, ::testing::Values("tcp", "sm"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace fluxion::testing

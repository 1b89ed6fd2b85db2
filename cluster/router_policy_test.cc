#include "cluster/router_policy.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fluxion::cluster {
namespace {

using ::testing::HasSubstr;

BackendState Decode(const std::string& address, uint64_t free_pages, uint32_t running,
                    float kv_usage = -1) {
  BackendState s;
  s.address = address;
  s.role = Role::kDecode;
  s.healthy = true;
  s.has_load = true;
  s.decode_load.set_free_kv_pages(free_pages);
  s.decode_load.set_total_kv_pages(1000);
  s.decode_load.set_page_tokens(16);
  s.decode_load.set_running_requests(running);
  s.decode_load.set_kv_usage(kv_usage >= 0 ? kv_usage : 1 - free_pages / 1000.0f);
  s.decode_load.set_admittable_prompt_tokens(1 << 20);
  return s;
}

BackendState Prefill(const std::string& address, uint64_t queued_tokens) {
  BackendState s;
  s.address = address;
  s.role = Role::kPrefill;
  s.healthy = true;
  s.prefill_load.set_queued_prompt_tokens(queued_tokens);
  return s;
}

TEST(RouterPolicyTest, DecodePrefersFreePagesAndFewerRunningRequests) {
  EXPECT_EQ(*PickDecode({Decode("a", 100, 0), Decode("b", 900, 0)}, 10, 0.95, {}), "b");
  // 90% free but 9 running (0.09) loses to 50% free and idle (0.5).
  EXPECT_EQ(*PickDecode({Decode("a", 900, 9), Decode("b", 500, 0)}, 10, 0.95, {}), "b");
}

TEST(RouterPolicyTest, RequestsSentSinceTheLastLoadAnswerCount) {
  BackendState a = Decode("a", 900, 0), b = Decode("b", 800, 0);
  EXPECT_EQ(*PickDecode({a, b}, 10, 0.95, {}), "a");
  a.pending_requests = 1;
  EXPECT_EQ(*PickDecode({a, b}, 10, 0.95, {}), "b");
}

TEST(RouterPolicyTest, PendingPromptTokensReduceEstimatedFreePages) {
  BackendState a = Decode("a", 900, 0), b = Decode("b", 800, 0);
  a.decode_load.mutable_server()->mutable_layout()->set_num_layers(2);
  a.decode_load.mutable_server()->mutable_layout()->set_num_kv_heads(2);
  a.pending_prompt_tokens = 16 * 50;  // 50 pages per (layer, head) x 4 = 200 pages
  EXPECT_NEAR(DecodeScore(a), 0.7, 1e-9);
  EXPECT_EQ(*PickDecode({a, b}, 10, 0.95, {}), "b");
}

TEST(RouterPolicyTest, UnhealthyAndExcludedNodesAreSkippedAndCountedWhenNoneIsLeft) {
  BackendState a = Decode("a", 900, 0), b = Decode("b", 100, 0);
  a.healthy = false;
  a.last_error = "health check: NOT_SERVING";
  EXPECT_EQ(*PickDecode({a, b}, 10, 0.95, {}), "b");
  auto none = PickDecode({a, b}, 10, 0.95, {"b"});
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(none.status().message(),
            "no healthy decode node (2 known: 1 failed this request, 1 unhealthy); retry later");
}

TEST(RouterPolicyTest, ShedsOnlyWhenEveryHealthyNodeIsAboveTheThreshold) {
  auto shed = PickDecode({Decode("a", 30, 0), Decode("b", 20, 0)}, 10, 0.95, {});
  EXPECT_EQ(shed.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(shed.status().message(), HasSubstr("0.95"));
  // One node below the threshold takes the request even though its score is worse.
  EXPECT_EQ(*PickDecode({Decode("a", 900, 50, 0.96f), Decode("b", 60, 0, 0.94f)}, 10, 0.95, {}),
            "b");
}

TEST(RouterPolicyTest, NodesWithRoomForThePromptComeFirst) {
  BackendState a = Decode("a", 900, 0), b = Decode("b", 300, 0);
  a.decode_load.set_admittable_prompt_tokens(1000);
  EXPECT_EQ(*PickDecode({a, b}, 5000, 0.95, {}), "b");
  EXPECT_EQ(*PickDecode({a, b}, 500, 0.95, {}), "a");
}

TEST(RouterPolicyTest, PrefillWithFewestQueuedTokensAndExcludedOnlyAsLastResort) {
  BackendState p1 = Prefill("p1", 5000), p2 = Prefill("p2", 10);
  EXPECT_EQ(*PickPrefill({p1, p2}, {}), "p2");
  p2.pending_prompt_tokens = 6000;
  EXPECT_EQ(*PickPrefill({p1, p2}, {}), "p1");
  EXPECT_EQ(*PickPrefill({p1, p2}, {"p1"}), "p2");
  EXPECT_EQ(*PickPrefill({p1}, {"p1"}), "p1");
  p1.healthy = false;
  EXPECT_EQ(PickPrefill({p1}, {}).status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace fluxion::cluster

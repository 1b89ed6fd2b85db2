#include "prefill/seal_replay_guard.h"

#include "gtest/gtest.h"

namespace fluxion::prefill {
namespace {

fluxion::v1::PrefillSeal Seal(const std::string& mac, absl::Time expires) {
  fluxion::v1::PrefillSeal s;
  s.set_mac(mac);
  s.set_expires_unix_ms(static_cast<uint64_t>(absl::ToUnixMillis(expires)));
  return s;
}

const absl::Time kNow = absl::FromUnixSeconds(1'800'000'000);

TEST(SealReplayGuardTest, ASealIsAdmittedOnceUntilItExpires) {
  SealReplayGuard guard;
  const auto a = Seal("mac-a", kNow + absl::Seconds(10));
  EXPECT_TRUE(guard.Admit(a, kNow).ok());
  EXPECT_EQ(guard.Admit(a, kNow + absl::Seconds(1)).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(guard.Admit(Seal("mac-b", kNow + absl::Seconds(10)), kNow).ok());
  EXPECT_EQ(guard.live(), 2u);
  // Past its expiry the seal is forgotten (CheckPrefillSeal refuses it by then anyway).
  EXPECT_TRUE(guard.Admit(Seal("mac-c", kNow + absl::Seconds(30)), kNow + absl::Seconds(11)).ok());
  EXPECT_EQ(guard.live(), 1u);
}

TEST(SealReplayGuardTest, FullGuardAsksToRetryLaterAndFreesAsSealsExpire) {
  SealReplayGuard guard(/*max_live=*/2);
  EXPECT_TRUE(guard.Admit(Seal("a", kNow + absl::Seconds(1)), kNow).ok());
  EXPECT_TRUE(guard.Admit(Seal("b", kNow + absl::Seconds(5)), kNow).ok());
  EXPECT_EQ(guard.Admit(Seal("c", kNow + absl::Seconds(5)), kNow).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(guard.Admit(Seal("c", kNow + absl::Seconds(5)), kNow + absl::Seconds(2)).ok());
}

}  // namespace
}  // namespace fluxion::prefill

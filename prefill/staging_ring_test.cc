#include "prefill/staging_ring.h"

#include <memory>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace fluxion::prefill {
namespace {

// A write whose completion the test decides.
struct FakeWrite {
  bool done = false;
  absl::Status error;
};

class FakeHandle : public transfer::TransferHandle {
 public:
  explicit FakeHandle(std::shared_ptr<FakeWrite> w) : w_(std::move(w)) {}
  absl::StatusOr<bool> Poll() override {
    if (!w_->error.ok()) return w_->error;
    return w_->done;
  }
  absl::Status Wait(absl::Duration) override {
    if (!w_->error.ok()) return w_->error;
    return w_->done ? absl::OkStatus() : absl::DeadlineExceededError("still in flight");
  }

 private:
  std::shared_ptr<FakeWrite> w_;
};

// Commits one slot of `bytes` and returns its write; the slot's offset goes to `*at`.
std::shared_ptr<FakeWrite> Fill(StagingRing& ring, uint8_t* base, size_t bytes, size_t* at) {
  absl::StatusOr<uint8_t*> room = ring.TryAcquire(bytes);
  EXPECT_TRUE(room.ok()) << room.status();
  EXPECT_NE(*room, nullptr);
  *at = static_cast<size_t>(*room - base);
  auto w = std::make_shared<FakeWrite>();
  std::vector<std::unique_ptr<transfer::TransferHandle>> writes;
  writes.push_back(std::make_unique<FakeHandle>(w));
  ring.Commit(std::move(writes));
  return w;
}

TEST(StagingRingTest, RoomIsReusedOnlyAfterItsWritesComplete) {
  std::vector<uint8_t> memory(100);
  StagingRing ring(memory.data(), memory.size());
  size_t a = 0, b = 0, c = 0;
  auto wa = Fill(ring, memory.data(), 40, &a);
  auto wb = Fill(ring, memory.data(), 40, &b);
  EXPECT_EQ(a, 0u);
  EXPECT_EQ(b, 40u);
  EXPECT_EQ(ring.in_flight_bytes(), 80u);
  // 30 bytes: 20 are left at the end and the start is held by the first slot.
  EXPECT_EQ(*ring.TryAcquire(30), nullptr);
  wb->done = true;  // completed out of order: the oldest still holds the ring's start
  EXPECT_EQ(*ring.TryAcquire(30), nullptr);
  wa->done = true;
  auto wc = Fill(ring, memory.data(), 30, &c);
  EXPECT_EQ(c, 0u);  // both freed; an empty ring starts over at 0
  EXPECT_EQ(ring.in_flight_bytes(), 30u);
}

TEST(StagingRingTest, WrapsAroundAndNeverOverlapsASlotInFlight) {
  std::vector<uint8_t> memory(100);
  StagingRing ring(memory.data(), memory.size());
  size_t at = 0;
  auto w1 = Fill(ring, memory.data(), 50, &at);
  auto w2 = Fill(ring, memory.data(), 30, &at);  // [50, 80)
  w1->done = true;
  auto w3 = Fill(ring, memory.data(), 40, &at);  // 20 left at the end: wraps to 0
  EXPECT_EQ(at, 0u);
  EXPECT_EQ(*ring.TryAcquire(11), nullptr);  // [40, 50) is free, [50, 80) is held
  auto w4 = Fill(ring, memory.data(), 10, &at);
  EXPECT_EQ(at, 40u);
  EXPECT_EQ(*ring.TryAcquire(1), nullptr);  // [0, 80) held; [80, 100) lies past the wrap
  w2->done = true;
  auto w5 = Fill(ring, memory.data(), 50, &at);  // the oldest is now [0, 40): [50, 100) is free
  EXPECT_EQ(at, 50u);
}

TEST(StagingRingTest, RefusesARequestLargerThanTheRing) {
  std::vector<uint8_t> memory(64);
  StagingRing ring(memory.data(), memory.size());
  EXPECT_EQ(ring.TryAcquire(65).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ring.TryAcquire(0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ring.TryAcquire(64).ok());
}

TEST(StagingRingTest, AFailedWriteFreesItsSlotAndIsReportedOnce) {
  std::vector<uint8_t> memory(100);
  StagingRing ring(memory.data(), memory.size());
  size_t at = 0;
  auto w = Fill(ring, memory.data(), 100, &at);
  w->error = absl::UnavailableError("peer gone");
  EXPECT_EQ(ring.TryAcquire(10).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(ring.empty());
  absl::StatusOr<uint8_t*> again = ring.TryAcquire(10);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, memory.data());
}

TEST(StagingRingTest, WaitKeepsASlotWhoseWritesAreStillInFlight) {
  std::vector<uint8_t> memory(100);
  StagingRing ring(memory.data(), memory.size());
  size_t at = 0;
  auto w1 = Fill(ring, memory.data(), 30, &at);
  auto w2 = Fill(ring, memory.data(), 30, &at);
  w1->done = true;
  EXPECT_EQ(ring.WaitAll(absl::Now()).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(ring.in_flight_bytes(), 30u);  // the first is freed, the second still held
  w2->done = true;
  EXPECT_TRUE(ring.WaitOldest(absl::Now()).ok());
  EXPECT_TRUE(ring.empty());
  EXPECT_TRUE(ring.WaitOldest(absl::Now()).ok());  // nothing left: nothing to wait for
}

}  // namespace
}  // namespace fluxion::prefill

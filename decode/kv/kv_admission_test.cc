// The page lifecycle of decode::Reservation: freed or quarantined when it dies, waiters woken by
// construction, per-reservation remote keys revoked exactly when no peer may write any more.
#include "decode/kv/kv_admission.h"

#include <atomic>
#include <cstring>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "common/wait_testing.h"
#include "decode/kv/paged_kv.h"
#include "gtest/gtest.h"
#include "transfer/loopback_transport.h"

namespace fluxion::decode {
namespace {

constexpr size_t kPageBytes = 256;

class FakeClock {
 public:
  absl::Time Now() {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }

 private:
  absl::Mutex mu_;
  absl::Time now_ = absl::FromUnixSeconds(1000);
};

class KvAdmissionTest : public ::testing::Test {
 protected:
  KvAdmissionTest() : arena_(*KvArena::Create(kPageBytes, 64, {/*huge_pages=*/false})) {
    options_.now = [this] { return clock_.Now(); };
    options_.release_thread = false;  // the test drives leases with ReleaseExpired()
    // Waiters wake only when pages come back, never by polling: a missed wake-up hangs the
    // waiter until its (long) deadline and fails the test.
    options_.poll_interval = absl::InfiniteDuration();
    admission_ = std::make_unique<KvAdmission>(arena_.get(), options_);
  }

  Reservation Reserve(int64_t pages) {
    absl::StatusOr<Reservation> r =
        admission_->Reserve(pages, absl::Now() + absl::Seconds(60), [] { return false; });
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? std::move(*r) : Reservation();
  }

  // Waits (bounded, generously) until `n` requests wait for pages.
  void AwaitWaiting(int64_t n) {
    ASSERT_TRUE(WaitFor([&] { return admission_->waiting() == n; }, kGenerousWait,
                        absl::Milliseconds(1)))
        << admission_->waiting();
  }

  FakeClock clock_;
  std::unique_ptr<KvArena> arena_;
  KvAdmissionOptions options_;
  std::unique_ptr<KvAdmission> admission_;
};

TEST_F(KvAdmissionTest, ReservationFreesItsPagesWhenItDies) {
  {
    Reservation r = Reserve(10);
    EXPECT_EQ(r.pages(), 10);
    EXPECT_EQ(arena_->counters().free, 54);
    Reservation moved = std::move(r);
    EXPECT_TRUE(r.empty());
    EXPECT_EQ(arena_->counters().free, 54);
  }
  EXPECT_EQ(arena_->counters().free, 64);
  EXPECT_EQ(admission_->stats().freed, 1u);
}

// A request larger than the whole arena can never be admitted: a permanent answer (OUT_OF_RANGE,
// which HTTP clients get as 400) naming the flag, not RESOURCE_EXHAUSTED ("try again later").
// Short of pages for now is RESOURCE_EXHAUSTED after the deadline.
TEST_F(KvAdmissionTest, NeverAdmissibleIsOutOfRangeAndShortForNowIsResourceExhausted) {
  absl::StatusOr<Reservation> never =
      admission_->Reserve(65, absl::Now() + absl::Seconds(60), [] { return false; });
  EXPECT_EQ(never.status().code(), absl::StatusCode::kOutOfRange) << never.status();
  EXPECT_NE(never.status().message().find("--kv-pages"), std::string::npos) << never.status();
  Reservation most = Reserve(60);
  absl::StatusOr<Reservation> later =
      admission_->Reserve(10, absl::InfinitePast(), [] { return false; });
  EXPECT_EQ(later.status().code(), absl::StatusCode::kResourceExhausted) << later.status();
}

TEST_F(KvAdmissionTest, SplitHalvesOwnTheirPagesSeparately) {
  Reservation kv = Reserve(12);
  absl::StatusOr<Reservation> state = kv.SplitAfter(10);
  ASSERT_TRUE(state.ok());
  EXPECT_EQ(kv.pages(), 10);
  EXPECT_EQ(state->pages(), 2);
  state->Release();
  EXPECT_EQ(arena_->counters().free, 54);
  kv.SetPeerMayWrite(absl::Seconds(1));
  EXPECT_FALSE(kv.SplitAfter(5).ok());  // a peer knows the runs as they are
  kv.SetPeerStopped();
}

TEST_F(KvAdmissionTest, DyingReservationWakesAWaiterWithoutAnyoneCallingNotify) {
  Reservation big = Reserve(60);
  std::atomic<bool> admitted{false};
  std::thread waiter([&] {
    absl::StatusOr<Reservation> r =
        admission_->Reserve(10, absl::Now() + absl::Seconds(120), [] { return false; });
    admitted = r.ok();
  });
  AwaitWaiting(1);
  big.Release();
  waiter.join();  // hangs for 120 s (and fails) if the release did not wake it
  EXPECT_TRUE(admitted.load());
}

TEST_F(KvAdmissionTest, DyingPagedKvWakesAWaiter) {
  // The served path: the prompt's reservation is adopted by the request's PagedKv, which grows by
  // page groups; when the request ends, its sequence dies and must wake the admission's waiters
  // (the callers used to call KvAdmission::Notify() by hand).
  const KvShape shape{1, 1, static_cast<int64_t>(kPageBytes / 2 / 2 / 16), 16};
  ASSERT_EQ(shape.page_bytes(), kPageBytes);
  Reservation prompt = Reserve(60);
  std::vector<int32_t> ids;
  for (const PageRun& r : prompt.runs()) {
    for (int32_t p = r.first; p < r.first + r.count; ++p) ids.push_back(p);
  }
  absl::StatusOr<PageBounds> bounds =
      PagedKv::ComputeBounds(*arena_, {1, 60, shape.head_dim, 16}, ids, 16);
  ASSERT_TRUE(bounds.ok()) << bounds.status();
  absl::StatusOr<std::unique_ptr<PagedKv>> kv = PagedKv::Adopt(
      std::move(prompt), {1, 60, shape.head_dim, 16}, ids, 16, std::move(*bounds));
  ASSERT_TRUE(kv.ok()) << kv.status();
  std::atomic<bool> admitted{false};
  std::thread waiter([&] {
    absl::StatusOr<Reservation> r =
        admission_->Reserve(10, absl::Now() + absl::Seconds(120), [] { return false; });
    admitted = r.ok();
  });
  AwaitWaiting(1);
  kv->reset();
  waiter.join();
  EXPECT_TRUE(admitted.load());
}

TEST_F(KvAdmissionTest, PeerThatMayStillWriteKeepsPagesQuarantinedForTheLeaseThenFree) {
  {
    Reservation r = Reserve(8);
    r.SetPeerMayWrite(absl::Seconds(30));
  }
  EXPECT_EQ(arena_->counters().quarantined, 8);
  EXPECT_EQ(arena_->counters().free, 56);
  EXPECT_EQ(admission_->stats().quarantined, 1u);
  clock_.Advance(absl::Seconds(30) - absl::Milliseconds(1));
  EXPECT_EQ(admission_->ReleaseExpired(), 0);
  EXPECT_EQ(arena_->counters().quarantined, 8);
  clock_.Advance(absl::Milliseconds(1));
  EXPECT_EQ(admission_->ReleaseExpired(), 1);
  EXPECT_EQ(arena_->counters().quarantined, 0);
  EXPECT_EQ(arena_->counters().free, 64);
  EXPECT_EQ(admission_->stats().lease_expired, 1u);
}

TEST_F(KvAdmissionTest, PeerThatConfirmedItStoppedFreesPagesAtOnce) {
  {
    Reservation r = Reserve(8);
    r.SetPeerMayWrite(absl::Seconds(30));
    r.SetPeerStopped();  // e.g. the prefill node answered CANCELLED after our Abort
  }
  EXPECT_EQ(arena_->counters().quarantined, 0);
  EXPECT_EQ(arena_->counters().free, 64);
}

// Two loopback transports in one process: the decode side (owns the arena) and a writer standing
// in for the prefill node.
class ReservationKeyTest : public KvAdmissionTest {
 protected:
  ReservationKeyTest()
      : decode_({"decode", {}}), writer_({"prefill", {}}) {
    // The arena as a whole is registered (as `fluxion decode` does); its key is never sent.
    arena_reg_ = *decode_.Register({arena_->base(), arena_->bytes()}, {true});
    source_.assign(kPageBytes * 64, 0);
    source_reg_ = *writer_.Register({source_.data(), source_.size()}, {false});
  }

  // Writes `byte` over [addr, addr + length) through `target`; the batch's final status.
  absl::Status WriteBytes(const transfer::RemoteTarget& target, uint64_t addr, size_t length,
                          uint8_t byte) {
    std::memset(source_.data(), byte, length);
    absl::StatusOr<std::unique_ptr<transfer::TransferHandle>> h =
        writer_.Write(target, {{addr, source_.data(), length}});
    if (!h.ok()) return h.status();
    return (*h)->Wait(absl::Seconds(10));
  }

  bool PagesHold(const Reservation& r, uint8_t byte) {
    for (const PageRun& run : r.runs()) {
      const uint8_t* p = arena_->page(run.first);
      for (size_t i = 0; i < run.count * kPageBytes; ++i) {
        if (p[i] != byte) return false;
      }
    }
    return true;
  }

  transfer::LoopbackTransport decode_;
  transfer::LoopbackTransport writer_;
  std::unique_ptr<transfer::Registration> arena_reg_;
  std::vector<uint8_t> source_;
  std::unique_ptr<transfer::Registration> source_reg_;
};

TEST_F(ReservationKeyTest, EachRunGetsItsOwnKeyScopedToIt) {
  Reservation r = Reserve(6);
  ASSERT_TRUE(r.RegisterRuns(&decode_).ok());
  ASSERT_EQ(r.ranges().size(), r.runs().size());
  const transfer::PeerDescriptor& d = r.ranges()[0];
  EXPECT_EQ(d.base_address, reinterpret_cast<uintptr_t>(arena_->page(r.runs()[0].first)));
  EXPECT_EQ(d.length, r.runs()[0].count * kPageBytes);
  EXPECT_NE(d.remote_key, arena_reg_->Describe()->remote_key);
  auto target = writer_.Connect(d);
  ASSERT_TRUE(target.ok()) << target.status();
  EXPECT_TRUE(WriteBytes(**target, d.base_address, d.length, 0x11).ok());
  EXPECT_TRUE(PagesHold(r, 0x11));
  // One byte past the range: refused before anything is written, neighbour untouched.
  const uint8_t before = arena_->page(r.runs()[0].first + r.runs()[0].count)[0];
  EXPECT_EQ(WriteBytes(**target, d.base_address + d.length, 1, 0x22).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(WriteBytes(**target, d.base_address - 1, 2, 0x22).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(arena_->page(r.runs()[0].first + r.runs()[0].count)[0], before);
  r.SetPeerStopped();
}

TEST_F(ReservationKeyTest, StaleKeyOfAFinishedReservationCannotWriteTheNextOnesPages) {
  Reservation a = Reserve(6);
  ASSERT_TRUE(a.RegisterRuns(&decode_).ok());
  const transfer::PeerDescriptor stale = a.ranges()[0];
  auto stale_target = writer_.Connect(stale);
  ASSERT_TRUE(stale_target.ok());
  ASSERT_TRUE(WriteBytes(**stale_target, stale.base_address, stale.length, 0x33).ok());
  const std::vector<PageRun> a_runs = a.runs();
  a.SetPeerMayWrite(absl::Seconds(30));
  a.SetPeerStopped();  // the peer replied
  a.Release();

  // The same pages go to another request (best fit hands back the same run).
  Reservation b = Reserve(6);
  ASSERT_EQ(b.runs(), a_runs);
  ASSERT_TRUE(b.RegisterRuns(&decode_).ok());
  std::memset(arena_->page(b.runs()[0].first), 0x5a, b.pages() * kPageBytes);

  // The old connection and a fresh connect from the old descriptor both fail; nothing changes.
  EXPECT_FALSE(WriteBytes(**stale_target, stale.base_address, stale.length, 0x66).ok());
  EXPECT_FALSE(writer_.Connect(stale).ok());
  EXPECT_TRUE(PagesHold(b, 0x5a));
  b.SetPeerStopped();
}

TEST_F(ReservationKeyTest, QuarantinedPagesKeepTheirKeyUntilTheLeaseEndsThenItIsRevoked) {
  Reservation a = Reserve(4);
  ASSERT_TRUE(a.RegisterRuns(&decode_).ok());
  const transfer::PeerDescriptor d = a.ranges()[0];
  auto target = writer_.Connect(d);
  ASSERT_TRUE(target.ok());
  a.SetPeerMayWrite(absl::Seconds(30));
  a.Release();  // no reply: quarantined
  // A write still in flight may land in the quarantined pages (nobody else owns them)...
  EXPECT_TRUE(WriteBytes(**target, d.base_address, d.length, 0x44).ok());
  clock_.Advance(absl::Seconds(30));
  EXPECT_EQ(admission_->ReleaseExpired(), 1);
  // ...but from the end of the lease on, the key is revoked: nothing lands any more.
  EXPECT_FALSE(WriteBytes(**target, d.base_address, d.length, 0x55).ok());
  EXPECT_EQ(reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(d.base_address))[0], 0x44);
}

}  // namespace
}  // namespace fluxion::decode

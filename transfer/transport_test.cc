// Unit tests of the seam's pure pieces: coalescing, descriptor encoding, compatibility checks,
// range arithmetic, the local registry and completion states.
#include "transfer/transport.h"

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "transfer/transport_internal.h"

namespace fluxion::transfer {
namespace {

using ::testing::HasSubstr;

const uint8_t* At(uintptr_t a) { return reinterpret_cast<const uint8_t*>(a); }

TEST(CoalesceCopiesTest, MergesRunsContiguousOnBothSides) {
  const std::vector<BlockCopy> in = {
      {1000, At(5000), 100}, {1100, At(5100), 100}, {1200, At(5200), 100},  // one run
      {1300, At(5300), 10},  // remote contiguous, local too: still the same run
      {2000, At(5310), 10},  // remote jumps: new op
      {2010, At(9000), 10},  // local jumps: new op
      {2020, At(9010), 10},  // contiguous with the previous: merged
  };
  const std::vector<BlockCopy> out = CoalesceCopies(in);
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[0].remote_addr, 1000u);
  EXPECT_EQ(out[0].length, 310u);
  EXPECT_EQ(out[1].remote_addr, 2000u);
  EXPECT_EQ(out[1].length, 10u);
  EXPECT_EQ(out[2].remote_addr, 2010u);
  EXPECT_EQ(out[2].local_addr, At(9000));
  EXPECT_EQ(out[2].length, 20u);
}

TEST(CoalesceCopiesTest, KeepsOrderAndDoesNotSort) {
  // Page 1 then page 0: contiguous only in reverse order, so nothing merges.
  const std::vector<BlockCopy> in = {{1100, At(5100), 100}, {1000, At(5000), 100}};
  EXPECT_EQ(CoalesceCopies(in).size(), 2u);
  EXPECT_TRUE(CoalesceCopies({}).empty());
}

CompatibilityRecord Compat() {
  CompatibilityRecord c;
  c.model_id = "m";
  c.kv_dtype = 2;
  c.num_layers = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.page_tokens = 16;
  c.layout_version = 1;
  return c;
}

TEST(DescriptorTest, RoundTripsEveryField) {
  PeerDescriptor d;
  d.peer_name = "decode-7/1700000000";
  d.transport = "ucx";
  d.worker_address = std::string("\0\x01\xff worker", 10);
  d.remote_key = std::string(300, '\x7f');
  d.base_address = 0x7f0000001000ull;
  d.length = 16ull << 30;
  d.compat = Compat();
  absl::StatusOr<PeerDescriptor> back = ParseDescriptor(SerializeDescriptor(d));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->peer_name, d.peer_name);
  EXPECT_EQ(back->transport, d.transport);
  EXPECT_EQ(back->worker_address, d.worker_address);
  EXPECT_EQ(back->remote_key, d.remote_key);
  EXPECT_EQ(back->base_address, d.base_address);
  EXPECT_EQ(back->length, d.length);
  EXPECT_TRUE(back->compat == d.compat);
}

TEST(DescriptorTest, TruncatedOrForeignBlobIsInvalidArgument) {
  PeerDescriptor d;
  d.compat = Compat();
  const std::string blob = SerializeDescriptor(d);
  for (size_t n = 0; n < blob.size(); ++n) {
    EXPECT_EQ(ParseDescriptor(blob.substr(0, n)).status().code(),
              absl::StatusCode::kInvalidArgument)
        << n;
  }
  EXPECT_EQ(ParseDescriptor(blob + "x").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ParseDescriptor("GARBAGE-GARBAGE").status().message(), HasSubstr("magic"));
  std::string future = blob;
  future[4] = 9;  // format version
  EXPECT_THAT(ParseDescriptor(future).status().message(), HasSubstr("format 9"));
}

TEST(CheckCompatibleTest, NamesTheFirstDifferingFieldWithBothValues) {
  EXPECT_TRUE(CheckCompatible(Compat(), Compat()).ok());
  CompatibilityRecord other = Compat();
  other.head_dim = 64;
  other.page_tokens = 32;
  absl::Status s = CheckCompatible(Compat(), other);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("head_dim is 128 here, 64 at peer"));
  other = Compat();
  other.protocol_version = 2;
  other.model_id = "x";
  EXPECT_THAT(CheckCompatible(Compat(), other).message(), HasSubstr("protocol_version"));
}

TEST(RangeInsideTest, HandlesEdgesAndOverflow) {
  using internal::RangeInside;
  EXPECT_TRUE(RangeInside(100, 10, 100, 10));
  EXPECT_TRUE(RangeInside(105, 5, 100, 10));
  EXPECT_FALSE(RangeInside(105, 6, 100, 10));
  EXPECT_FALSE(RangeInside(99, 1, 100, 10));
  EXPECT_FALSE(RangeInside(100, 11, 100, 10));
  const uint64_t max = std::numeric_limits<uint64_t>::max();
  EXPECT_FALSE(RangeInside(max - 1, 4, 100, 10));
  EXPECT_FALSE(RangeInside(110, max, 100, 10));
  EXPECT_TRUE(RangeInside(max - 9, 10, max - 9, 10));
}

TEST(LocalRegistryTest, FindsTheContainingEntryAmongOverlaps) {
  internal::LocalRegistry r;
  int a, b, c;
  r.Add(1, 1000, 1000, &a);  // [1000, 2000)
  r.Add(2, 1500, 100, &b);   // [1500, 1600), inside the first
  r.Add(3, 5000, 10, &c);
  void* either = *r.Find(1500, 100);
  EXPECT_TRUE(either == &a || either == &b);
  EXPECT_EQ(*r.Find(1550, 100), &a);  // only the wide one holds all of it
  EXPECT_EQ(*r.Find(1000, 1000), &a);
  EXPECT_FALSE(r.Find(1999, 2).ok());
  EXPECT_EQ(*r.Find(5000, 10), &c);
  EXPECT_FALSE(r.Find(4999, 2).ok());
  r.Remove(1);
  EXPECT_FALSE(r.Find(1550, 100).ok());
  EXPECT_EQ(*r.Find(1500, 100), &b);
}

TEST(CompletionStateTest, FirstOutcomeWinsAndWaitHonoursTheDeadline) {
  auto metrics = std::make_shared<internal::MetricsRecorder>();
  internal::CompletionState s(metrics, 4096);
  EXPECT_EQ(s.Wait(absl::Milliseconds(20)).code(), absl::StatusCode::kDeadlineExceeded);
  // Completed from another thread, most likely while the Wait below blocks (the sleep makes that
  // the usual order; the outcome is the same if Complete comes first).
  std::thread t([&] {
    absl::SleepFor(absl::Milliseconds(20));
    s.Complete(absl::OkStatus());
  });
  EXPECT_TRUE(s.Wait(absl::Seconds(10)).ok());
  t.join();
  s.Complete(absl::UnavailableError("late"));  // ignored
  EXPECT_TRUE(s.Wait(absl::ZeroDuration()).ok());
  const TransportMetrics m = metrics->Snapshot();
  EXPECT_EQ(m.bytes_written, 4096u);
  EXPECT_EQ(m.batches_completed, 1u);
  EXPECT_EQ(m.failed_deadline, 1u);
  EXPECT_EQ(m.failed_unavailable, 0u);
}

TEST(MetricsRecorderTest, LatencyGoesToTheRightBucket) {
  internal::MetricsRecorder m;
  m.AddCompleted(1, absl::Microseconds(5));   // <= 10
  m.AddCompleted(1, absl::Microseconds(10));  // <= 10
  m.AddCompleted(1, absl::Microseconds(11));  // <= 30
  m.AddCompleted(1, absl::Seconds(100));      // overflow bucket
  const TransportMetrics s = m.Snapshot();
  EXPECT_EQ(s.latency_buckets[0], 2u);
  EXPECT_EQ(s.latency_buckets[1], 1u);
  EXPECT_EQ(s.latency_buckets.back(), 1u);
  EXPECT_EQ(s.latency_sum_us, 5u + 10u + 11u + 100000000u);
}

}  // namespace
}  // namespace fluxion::transfer

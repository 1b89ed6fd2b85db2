#include "decode/kv/kv_arena.h"

#include <cstring>
#include <random>

#include "gtest/gtest.h"

namespace fluxion::decode {
namespace {

constexpr size_t kPageBytes = 8192;  // 16 tokens x 128 dims x bf16, K and V

std::unique_ptr<KvArena> MakeArena(int64_t pages) {
  auto arena = KvArena::Create(kPageBytes, pages);
  EXPECT_TRUE(arena.ok()) << arena.status();
  return std::move(*arena);
}

void ExpectCounters(const KvArena& a, int64_t free, int64_t reserved, int64_t quarantined) {
  KvArenaCounters c = a.counters();
  EXPECT_EQ(c.total, a.num_pages());
  EXPECT_EQ(c.free, free);
  EXPECT_EQ(c.reserved, reserved);
  EXPECT_EQ(c.quarantined, quarantined);
}

TEST(KvArenaTest, PagesAreDisjointWritableAndAddressedById) {
  auto arena = MakeArena(64);
  auto runs = arena->Allocate(64);
  ASSERT_TRUE(runs.ok());
  for (int32_t id = 0; id < 64; ++id) std::memset(arena->page(id), id, kPageBytes);
  for (int32_t id = 0; id < 64; ++id) {
    EXPECT_EQ(arena->page(id), arena->base() + id * kPageBytes);
    EXPECT_EQ(arena->page(id)[0], id);
    EXPECT_EQ(arena->page(id)[kPageBytes - 1], id);
  }
}

TEST(KvArenaTest, AllocationFromAFreshArenaIsOneContiguousRun) {
  auto arena = MakeArena(100);
  auto runs = arena->Allocate(40);
  ASSERT_TRUE(runs.ok());
  ASSERT_EQ(runs->size(), 1u);
  EXPECT_EQ((*runs)[0].count, 40);
  ExpectCounters(*arena, 60, 40, 0);
}

TEST(KvArenaTest, AllocateReturnsResourceExhaustedWhenFullAndReservesNothing) {
  auto arena = MakeArena(10);
  ASSERT_TRUE(arena->Allocate(7).ok());
  auto too_many = arena->Allocate(4);
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(too_many.status().message().find("3 free pages"), std::string::npos)
      << too_many.status();
  ExpectCounters(*arena, 3, 7, 0);
  EXPECT_EQ(arena->Allocate(0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(KvArenaTest, FragmentedAllocationUsesLargestRunsAndFreeCoalesces) {
  auto arena = MakeArena(30);
  std::vector<std::vector<PageRun>> blocks;
  for (int i = 0; i < 6; ++i) blocks.push_back(*arena->Allocate(5));
  // Free every other block: free extents of 5 pages at 0, 10, 20.
  for (int i = 0; i < 6; i += 2) ASSERT_TRUE(arena->Free(blocks[i]).ok());
  auto runs = arena->Allocate(12);
  ASSERT_TRUE(runs.ok());
  EXPECT_EQ(CountPages(*runs), 12);
  EXPECT_EQ(runs->size(), 3u);
  ASSERT_TRUE(arena->Free(*runs).ok());
  for (int i = 1; i < 6; i += 2) ASSERT_TRUE(arena->Free(blocks[i]).ok());
  ExpectCounters(*arena, 30, 0, 0);
  // Everything coalesced back into one extent.
  auto all = arena->Allocate(30);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->size(), 1u);
}

TEST(KvArenaTest, DoubleFreeIsFailedPreconditionAndChangesNothing) {
  auto arena = MakeArena(10);
  auto runs = *arena->Allocate(4);
  ASSERT_TRUE(arena->Free(runs).ok());
  absl::Status s = arena->Free(runs);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  ExpectCounters(*arena, 10, 0, 0);
}

TEST(KvArenaTest, OverlappingOrOutOfRangeRunsAreRejected) {
  auto arena = MakeArena(10);
  auto runs = *arena->Allocate(10);
  EXPECT_EQ(arena->Free({{0, 4}, {2, 4}}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(arena->Free({{8, 5}}).code(), absl::StatusCode::kInvalidArgument);
  ExpectCounters(*arena, 0, 10, 0);
}

TEST(KvArenaTest, QuarantinedPagesAreNotReusedUntilReleased) {
  auto arena = MakeArena(8);
  auto runs = *arena->Allocate(8);
  ASSERT_TRUE(arena->Quarantine(runs).ok());
  ExpectCounters(*arena, 0, 0, 8);
  EXPECT_EQ(arena->Allocate(1).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(arena->Free(runs).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(arena->ReleaseQuarantine(runs).ok());
  ExpectCounters(*arena, 8, 0, 0);
  EXPECT_TRUE(arena->Allocate(8).ok());
}

TEST(KvArenaTest, RandomAllocateFreeSequenceNeverLeaksOrDoubleHandsOut) {
  auto arena = MakeArena(500);
  std::mt19937 rng(5);
  std::vector<std::vector<PageRun>> live;
  std::vector<int> owner(500, -1);
  for (int step = 0; step < 2000; ++step) {
    if (live.empty() || rng() % 2) {
      auto runs = arena->Allocate(1 + rng() % 40);
      if (!runs.ok()) continue;
      for (const PageRun& r : *runs) {
        for (int32_t id = r.first; id < r.first + r.count; ++id) {
          ASSERT_EQ(owner[id], -1) << "page " << id << " handed out twice";
          owner[id] = step;
        }
      }
      live.push_back(*runs);
    } else {
      size_t i = rng() % live.size();
      for (const PageRun& r : live[i]) {
        for (int32_t id = r.first; id < r.first + r.count; ++id) owner[id] = -1;
      }
      ASSERT_TRUE(arena->Free(live[i]).ok());
      live.erase(live.begin() + i);
    }
    int64_t held = 0;
    for (const auto& runs : live) held += CountPages(runs);
    ASSERT_EQ(arena->counters().reserved, held);
  }
  for (const auto& runs : live) ASSERT_TRUE(arena->Free(runs).ok());
  ExpectCounters(*arena, 500, 0, 0);
}

TEST(KvArenaTest, CreateRejectsNonsenseSizes) {
  EXPECT_EQ(KvArena::Create(0, 10).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(KvArena::Create(8192, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(KvArena::Create(size_t{1} << 40, int64_t{1} << 30).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(KvArenaTest, OverExternalMemoryUsesItAndLeavesItMapped) {
  std::vector<uint8_t> memory(10 * 4096 + 100, 0);
  auto arena = KvArena::Over(memory.data(), memory.size(), 4096);
  ASSERT_TRUE(arena.ok()) << arena.status();
  EXPECT_EQ((*arena)->num_pages(), 10);
  EXPECT_EQ((*arena)->base(), memory.data());
  auto runs = (*arena)->Allocate(10);
  ASSERT_TRUE(runs.ok());
  (*arena)->page(9)[4095] = 7;  // the last page lies inside the caller's memory
  EXPECT_EQ(memory[10 * 4096 - 1], 7);
  EXPECT_FALSE((*arena)->Allocate(1).ok());
  arena->reset();
  EXPECT_EQ(memory[10 * 4096 - 1], 7);  // still ours, not unmapped
  EXPECT_EQ(KvArena::Over(nullptr, 4096, 4096).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(KvArena::Over(memory.data(), 100, 4096).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace fluxion::decode

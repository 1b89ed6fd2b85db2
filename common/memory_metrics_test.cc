#include "common/memory_metrics.h"

#include <cstdlib>
#include <cstring>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace fluxion::metrics {
namespace {

TEST(MemoryMetricsTest, InUseFollowsAllocationsAndResidentMemoryIsRead) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer's allocator replaces glibc's: mallinfo2 counts nothing";
#endif
  EXPECT_GT(ReadResidentBytes(), 1u << 20);
  const MallocUsage before = ReadMallocUsage();
  std::vector<void*> blocks;
  constexpr size_t kBlock = 64 << 10, kBlocks = 512;  // 32 MiB in arena-sized blocks
  for (size_t i = 0; i < kBlocks; ++i) {
    void* p = std::malloc(kBlock);
    ASSERT_NE(p, nullptr);
    std::memset(p, 1, kBlock);  // touched, so the allocation is not elided
    blocks.push_back(p);
  }
  const MallocUsage during = ReadMallocUsage();
  EXPECT_GE(during.in_use_bytes, before.in_use_bytes + kBlock * kBlocks);
  for (void* p : blocks) std::free(p);
  const MallocUsage after = ReadMallocUsage();
  EXPECT_LE(after.in_use_bytes + kBlock * kBlocks, during.in_use_bytes + (1u << 20));
}

TEST(MemoryMetricsTest, TheGaugesAreRendered) {
  Registry registry;
  AddMemoryMetrics(&registry);
  const std::string text = registry.Render();
  for (const char* name : {"fluxion_process_resident_bytes", "fluxion_malloc_in_use_bytes",
                           "fluxion_malloc_free_held_bytes"}) {
    EXPECT_TRUE(absl::StrContains(text, std::string("# TYPE ") + name + " gauge")) << name;
  }
}

}  // namespace
}  // namespace fluxion::metrics

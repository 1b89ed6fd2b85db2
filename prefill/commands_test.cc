// --malloc-arena-max (prefill/commands.h): the cap reaches glibc, and the flag's checks.
#include "prefill/commands.h"

#include <malloc.h>
#include <stdio.h>

#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/barrier.h"
#include "gtest/gtest.h"

namespace fluxion::prefill {
namespace {

// glibc's arenas as malloc_info reports them (one <heap nr=...> per arena but the main one).
int HeapsInMallocInfo() {
  char* text = nullptr;
  size_t size = 0;
  FILE* out = open_memstream(&text, &size);
  malloc_info(0, out);
  fclose(out);
  std::string xml(text, size);
  free(text);
  int heaps = 0;
  for (size_t at = xml.find("<heap nr="); at != std::string::npos;
       at = xml.find("<heap nr=", at + 1)) {
    ++heaps;
  }
  return heaps;
}

// Under AddressSanitizer malloc is ASan's allocator: glibc's arenas (and mallopt's cap on them)
// are not in play, and malloc_info reports none, so there is nothing to measure there.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kGlibcMalloc = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kGlibcMalloc = false;
#else
constexpr bool kGlibcMalloc = true;
#endif
#else
constexpr bool kGlibcMalloc = true;
#endif

TEST(MallocArenaMaxTest, CapsTheArenasThreadsGet) {
  if (!kGlibcMalloc) GTEST_SKIP() << "AddressSanitizer replaces glibc's malloc and its arenas";
  // Run first, before this process has threads: each thread that first allocates while the
  // others are alive gets a new arena unless the cap is reached (glibc's arena_get2), so 8
  // threads alive at once would make 8 more arenas under glibc's default (8 per core).
  absl::StatusOr<int64_t> applied = ApplyMallocArenaMax(2, nullptr);
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_EQ(*applied, 2);
  constexpr int kThreads = 8;
  absl::Barrier* all_allocated = new absl::Barrier(kThreads + 1);
  absl::Barrier* may_exit = new absl::Barrier(kThreads + 1);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&] {
      void* volatile p = malloc(4096);  // volatile: the compiler may not elide the pair
      if (all_allocated->Block()) delete all_allocated;
      if (may_exit->Block()) delete may_exit;
      free(p);
    });
  }
  if (all_allocated->Block()) delete all_allocated;
  const int heaps = HeapsInMallocInfo();
  if (may_exit->Block()) delete may_exit;
  for (auto& t : threads) t.join();
  EXPECT_LE(heaps, 2) << kThreads << " threads allocating at once made " << heaps << " arenas";
}

TEST(MallocArenaMaxTest, OutOfRangeIsRefusedNamingTheFlag) {
  for (int64_t bad : {-1, 65, 1000}) {
    absl::StatusOr<int64_t> r = ApplyMallocArenaMax(bad, nullptr);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("--malloc-arena-max"), std::string::npos);
  }
}

TEST(MallocArenaMaxTest, ZeroLeavesGlibcAloneAndTheEnvironmentWins) {
  EXPECT_EQ(*ApplyMallocArenaMax(0, nullptr), 0);
  EXPECT_EQ(*ApplyMallocArenaMax(2, "4"), 4);  // glibc already took the variable
  EXPECT_EQ(*ApplyMallocArenaMax(2, "many"), 0);  // glibc ignores a non-number
  EXPECT_EQ(*ApplyMallocArenaMax(100, "3"), 3);  // not the flag's to refuse then
}

}  // namespace
}  // namespace fluxion::prefill

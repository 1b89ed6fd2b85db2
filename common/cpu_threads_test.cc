#include "common/cpu_threads.h"

#include <string>
#include <vector>

#include "common/flag_set.h"
#include "gtest/gtest.h"

namespace fluxion {
namespace {

absl::StatusOr<int> Resolve(CpuRole role, const std::vector<std::string>& args, int available) {
  FlagSet flags("fluxion test", "");
  CpuThreadsFlag flag(flags, role);
  if (absl::Status s = flags.Parse(args); !s.ok()) return s;
  return flag.Resolve(available);
}

absl::StatusOr<std::vector<int64_t>> ResolveList(const std::vector<std::string>& args,
                                                 int available) {
  FlagSet flags("fluxion test", "");
  CpuThreadsListFlag flag(flags, {1, 0});
  if (absl::Status s = flags.Parse(args); !s.ok()) return s;
  return flag.Resolve(available);
}

TEST(CpuThreadsTest, DefaultIsEveryAvailableCpuOfflineAndOneLessOnServingNodes) {
  EXPECT_EQ(DefaultCpuThreads(CpuRole::kOffline, 16), 16);
  EXPECT_EQ(DefaultCpuThreads(CpuRole::kServing, 16), 16 - kServingReservedCpus);
  EXPECT_EQ(DefaultCpuThreads(CpuRole::kServing, 2), 1);
  EXPECT_EQ(DefaultCpuThreads(CpuRole::kServing, 1), 1);  // never 0
  EXPECT_EQ(DefaultCpuThreads(CpuRole::kOffline, 0), 1);
  EXPECT_EQ(*Resolve(CpuRole::kOffline, {}, 8), 8);
  EXPECT_EQ(*Resolve(CpuRole::kServing, {}, 8), 7);
  EXPECT_EQ(*Resolve(CpuRole::kServing, {"--cpu-threads", "0"}, 8), 7);
}

TEST(CpuThreadsTest, AvailableCpusFollowsTheAffinityMask) {
  EXPECT_GE(AvailableCpus(), 1);
}

TEST(CpuThreadsTest, AnExplicitCountWinsAndMayExceedTheCpus) {
  EXPECT_EQ(*Resolve(CpuRole::kServing, {"--cpu-threads", "3"}, 8), 3);
  EXPECT_EQ(*Resolve(CpuRole::kOffline, {"--cpu-threads=12"}, 8), 12);
}

TEST(CpuThreadsTest, BadValuesAreRefusedNamingTheFlag) {
  absl::StatusOr<int> negative = Resolve(CpuRole::kOffline, {"--cpu-threads", "-1"}, 8);
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(negative.status().message().find("--cpu-threads"), std::string::npos);
  absl::StatusOr<int> huge = Resolve(CpuRole::kOffline, {"--cpu-threads", "100000"}, 8);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
  // --threads is not a flag: FlagSet refuses it like any unknown one.
  EXPECT_FALSE(Resolve(CpuRole::kOffline, {"--threads", "2"}, 8).ok());
}

TEST(CpuThreadsTest, SweepListsReplaceZeroByTheAvailableCpus) {
  EXPECT_EQ(*ResolveList({}, 4), (std::vector<int64_t>{1, 4}));
  EXPECT_EQ(*ResolveList({"--cpu-threads", "2,0,8"}, 4), (std::vector<int64_t>{2, 4, 8}));
  EXPECT_EQ(ResolveList({"--cpu-threads", "1,-1"}, 4).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace fluxion

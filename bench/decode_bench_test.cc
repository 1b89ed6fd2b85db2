// `fluxion bench decode`'s one flag set: --help documents both measurements, and a flag of one
// measurement given to the other is a usage error (exit 2) rather than silently ignored. Nothing
// here runs a measurement.
#include "bench/decode_bench.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fluxion::bench {
namespace {

using ::testing::HasSubstr;

TEST(DecodeBenchCommandTest, HelpDocumentsTheCpuExecutorsAndTheDevice) {
  ::testing::internal::CaptureStdout();
  const int rc = RunDecodeBench({"--help"});
  const std::string help = ::testing::internal::GetCapturedStdout();
  EXPECT_EQ(rc, 0);
  EXPECT_THAT(help, HasSubstr("usage: fluxion bench decode"));
  EXPECT_THAT(help, HasSubstr("Without --device"));
  EXPECT_THAT(help, HasSubstr("With --device cpu|cuda"));
  EXPECT_THAT(help, HasSubstr("--model"));  // the CPU executors'
  EXPECT_THAT(help, HasSubstr("--kv"));
  EXPECT_THAT(help, HasSubstr("--profile"));  // the hybrid step's
  EXPECT_THAT(help, HasSubstr("--micro-batches"));
  EXPECT_THAT(help, HasSubstr("--guard"));  // both
}

TEST(DecodeBenchCommandTest, RefusesADeviceFlagWithoutDevice) {
  ::testing::internal::CaptureStderr();
  const int rc = RunDecodeBench({"--profile", "conservative"});
  EXPECT_EQ(rc, 2);
  EXPECT_THAT(::testing::internal::GetCapturedStderr(), HasSubstr("--profile needs --device"));
}

TEST(DecodeBenchCommandTest, RefusesAnExecutorFlagWithDevice) {
  ::testing::internal::CaptureStderr();
  const int rc = RunDecodeBench({"--device", "cpu", "--model", "models/x"});
  EXPECT_EQ(rc, 2);
  EXPECT_THAT(::testing::internal::GetCapturedStderr(),
              HasSubstr("--model applies to the CPU executors only"));
}

TEST(DecodeBenchCommandTest, DeviceTakesOneCpuThreadsValue) {
  ::testing::internal::CaptureStderr();
  const int rc = RunDecodeBench({"--device", "cpu", "--cpu-threads", "1,2"});
  EXPECT_EQ(rc, 2);
  EXPECT_THAT(::testing::internal::GetCapturedStderr(), HasSubstr("takes one value"));
}

TEST(DecodeBenchCommandTest, CpuExecutorsCheckTheirOwnRanges) {
  ::testing::internal::CaptureStderr();
  const int rc = RunDecodeBench({"--kv", "neither"});
  EXPECT_EQ(rc, 2);
  EXPECT_THAT(::testing::internal::GetCapturedStderr(),
              HasSubstr("--kv must be auto, prefill or random"));
}

}  // namespace
}  // namespace fluxion::bench

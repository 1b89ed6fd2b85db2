#include "decode/step/step_executor_factory.h"

#include "gtest/gtest.h"

namespace fluxion::decode {
namespace {

TEST(StepExecutorFactoryTest, DeviceNamesParseOnceAndAnUnknownOneIsInvalid) {
  EXPECT_EQ(*ParseStepDevice("cpu"), StepDevice::kCpu);
  EXPECT_EQ(*ParseStepDevice("cuda"), StepDevice::kCuda);
  EXPECT_EQ(ParseStepDevice("gpu").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(StepExecutorFactoryTest, HybridOptionsNoExecutorServesAreInvalid) {
  CudaHybridOptions ok;
  EXPECT_TRUE(ValidateCudaHybridOptions(ok).ok());
  CudaHybridOptions three = ok;
  three.micro_batches = 3;
  EXPECT_EQ(ValidateCudaHybridOptions(three).code(), absl::StatusCode::kInvalidArgument);
  CudaHybridOptions one_slot = ok;
  one_slot.micro_batches = 2;
  one_slot.max_requests = 1;
  EXPECT_EQ(ValidateCudaHybridOptions(one_slot).code(), absl::StatusCode::kInvalidArgument);
  CudaHybridOptions share = ok;
  share.device_read_share = 1.5;
  EXPECT_EQ(ValidateCudaHybridOptions(share).code(), absl::StatusCode::kInvalidArgument);
  CudaHybridOptions guard = ok;
  guard.stall_guard.enabled = true;
  guard.stall_guard.min_scale = 0;
  EXPECT_EQ(ValidateCudaHybridOptions(guard).code(), absl::StatusCode::kInvalidArgument);
}

TEST(StepExecutorFactoryTest, CompactSlotsFitTheBudgetAndNeverExceedTheWindow) {
  const model::AttentionShape llama8b{32, 32, 8, 128, 0.0884f};
  // 132 bytes per token, layer and KV head: 128K tokens take ~4.1 GiB, so 16 GiB hold 3.
  EXPECT_EQ(CompactSlotsFor(llama8b, 131072, 16, 128), 3);
  EXPECT_EQ(CompactSlotsFor(llama8b, 131072, 16, 2), 2);
  EXPECT_EQ(CompactSlotsFor(llama8b, 131072, 0, 128), 0);
}

}  // namespace
}  // namespace fluxion::decode

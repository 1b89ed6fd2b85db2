// `fluxion eval tasks --device cuda` on the device (skips without one): the trained tiny model's
// task samples decoded through the CUDA hybrid executor (NewCudaHybridEvalExecutor, what the
// command decodes with) against the CPU path, compared by eval_compare.h. The full comparison the
// issue asks for is the command's (docs/TASKS.md, "Decode path"); this is its smoke test with
// bounds loose enough for bf16: the CUDA dense halves round every GEMM input to bf16 (whole-step
// logits within 2e-2 of the largest, model/cuda_dense_ops_test.cc), and `full` here also reads bf16
// pages where the CPU path keeps fp32 K/V. The measured noise is printed for the log.
#include <cuda_runtime.h>

#include <cstdlib>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "bench/eval/cuda_eval_executor.h"
#include "bench/eval/eval_compare.h"
#include "bench/eval/task_eval.h"
#include "bench/eval/tasks.h"
#include "decode/sparse/fluxion_predictor.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_pool.h"
#include "model/model.h"
#include "tests/eval_runs_testing.h"

namespace fluxion::eval {
namespace {

bool HaveDevice() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

std::string ModelDir() {
  const char* dir = std::getenv("FLUXION_SOURCE_DIR");
  return std::string(dir != nullptr ? dir : ".") + "/models/fluxion-tiny-retrieval";
}

TEST(EvalCudaTest, TheCudaHybridPathGivesTheCpuPathsOutcomesUpToBf16NearTies) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  auto model = model::Model::Load(ModelDir());
  ASSERT_TRUE(model.ok()) << model.status();
  const kernels::cpu::CpuPool pool(4);
  auto executor = NewCudaHybridEvalExecutor(model->get(), &pool);
  ASSERT_TRUE(executor.ok()) << executor.status();

  TaskEvalOptions options;
  options.contexts = {1024};
  options.samples = 2;
  // fluxion+guard: the error guard's exact checks read the layer's output back from the device
  // (HybridBatchAttention::GuardChecks), a path only this test takes on a GPU.
  options.policies = {"full", "quest@0.2", "fixed_32_0.05", "lfps@0.2", "fluxion@0.2",
                      "fluxion@0.2+guard"};
  options.max_new_tokens = 16;
  auto predictor = decode::sparse::ResolvePredictor("", ModelDir());
  ASSERT_TRUE(predictor.ok()) << predictor.status();
  options.fluxion_predictor = *predictor;
  options.output_projection =
      std::make_shared<const model::OutputProjection>((*model)->output_projection());
  const std::map<std::string, EvalRun> cpu = RunByPolicy(**model, options, "cpu");
  options.executor = executor->get();
  const std::map<std::string, EvalRun> cuda = RunByPolicy(**model, options, "cuda");

  for (const std::string& policy : options.policies) {
    SCOPED_TRACE(policy);
    // Measured on the H200 (2026-12-02): margin noise 0.035 for `full`, 0.005-0.009 for
    // lfps / fluxion, 0.07-0.11 for quest / fixed_32 (their top blocks follow q, which the CUDA
    // dense ops round to bf16: a near-tied block can flip and move logits further). About 2x.
    const bool ranks_blocks = policy.rfind("quest", 0) == 0 || policy.rfind("fixed_", 0) == 0;
    const double tolerance = policy == "full" ? 0.1 : ranks_blocks ? 0.25 : 0.05;
    CompareOptions compare;
    compare.near_tie_relative = 2 * tolerance;
    const EvalComparison c = CompareEvalRuns(cpu.at(policy), cuda.at(policy), compare);
    ASSERT_EQ(c.noise.size(), 1u);
    std::cout << policy << ": " << c.identical << " identical, " << c.near_ties << " near-ties, "
              << c.divergences << " divergences; noise top logit " << c.noise[0].top_logit
              << ", margin " << c.noise[0].margin << " over " << c.noise[0].steps << " steps\n";
    EXPECT_EQ(c.samples.size(), 2 * TaskNames().size());
    EXPECT_LE(c.noise[0].top_logit, tolerance);
    EXPECT_LE(c.noise[0].margin, tolerance);
    EXPECT_EQ(c.divergences, 0);
  }
}

}  // namespace
}  // namespace fluxion::eval

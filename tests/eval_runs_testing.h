// Test helper shared by eval_device_test and eval_cuda_test: a task eval's per-sample outcomes
// grouped by policy, as `fluxion eval tasks --json` records them for `eval compare`.
#ifndef FLUXION_TESTS_EVAL_RUNS_TESTING_H_
#define FLUXION_TESTS_EVAL_RUNS_TESTING_H_

#include <map>
#include <string>

#include "bench/eval/eval_compare.h"
#include "bench/eval/task_eval.h"
#include "gtest/gtest.h"
#include "model/model.h"

namespace fluxion::eval {

inline std::map<std::string, EvalRun> RunByPolicy(const model::Model& model,
                                                  const TaskEvalOptions& options,
                                                  const std::string& device) {
  std::map<std::string, EvalRun> runs;
  TaskEvalCallbacks callbacks;
  callbacks.on_sample_done = [&](const SampleOutcome& o) {
    for (const PolicyOutcome& p : o.policies) {
      EvalRun& run = runs[p.policy];
      run.device = device;
      run.samples.push_back({{o.sample.task, o.sample.context, o.sample.seed, p.policy},
                             p.tokens,
                             p.correct,
                             p.margins,
                             p.top_logits});
    }
  };
  auto results = RunTaskEval(model, options, callbacks);
  EXPECT_TRUE(results.ok()) << results.status();
  return runs;
}

}  // namespace fluxion::eval

#endif  // FLUXION_TESTS_EVAL_RUNS_TESTING_H_

// Decision profiles end to end on the trained tiny model: what `fluxion eval tasks
// --record-profile` records from lfps and fluxion, replayed through the same eval, gives back the
// recorded shares (decode/sparse/decision_profile.h).
#include <cstdlib>
#include <map>
#include <string>

#include "bench/eval/task_eval.h"
#include "bench/eval/tasks.h"
#include "decode/sparse/decision_profile.h"
#include "decode/sparse/fluxion_predictor.h"
#include "gtest/gtest.h"
#include "model/model.h"

namespace fluxion::eval {
namespace {

using decode::sparse::DecisionProfile;
using decode::sparse::DecisionRecorder;
using decode::sparse::PolicyDecisions;
using decode::sparse::SelectionStats;

std::string SourceDir() {
  const char* dir = std::getenv("FLUXION_SOURCE_DIR");
  return dir != nullptr ? dir : ".";
}

// The eval's summed SelectionStats per policy label.
std::map<std::string, SelectionStats> RunEval(const model::Model& model, TaskEvalOptions options,
                                              DecisionRecorder* recorder) {
  std::map<std::string, SelectionStats> stats;
  TaskEvalCallbacks callbacks;
  callbacks.on_sample_done = [&](const SampleOutcome& o) {
    for (const PolicyOutcome& p : o.policies) {
      stats[p.policy].Add(p.selection);
      if (recorder != nullptr) recorder->Add(*PolicyConfigOf(p.policy), p.selection);
    }
  };
  auto results = RunTaskEval(model, options, callbacks);
  EXPECT_TRUE(results.ok()) << results.status();
  return stats;
}

// Mean decided budget over the retrieval head-steps, and the share of them at `block`.
double MeanBudget(const SelectionStats& s) {
  double sum = 0, n = 0;
  for (const auto& [choice, count] : s.retrieval) {
    sum += choice.second * decode::sparse::kBudgetUnit * count;
    n += count;
  }
  return n > 0 ? sum / n : 0;
}
double BlockShare(const SelectionStats& s, int64_t block) {
  double at = 0, n = 0;
  for (const auto& [choice, count] : s.retrieval) {
    at += choice.first == block ? count : 0;
    n += count;
  }
  return n > 0 ? at / n : 0;
}

// Record lfps and fluxion at 2K (budget 0.1: ~140 middle rows per head), replay the profile on
// the same prompts. Streaming and bypass shares within 0.05; the mean retrieval budget within
// 0.003 of the context (it is a weight on the uniform budget drawn per head, and budgets move
// little between heads on this model); per-block shares within 0.25, because the model has 24
// KV heads and a block is drawn per head (3 binomial standard deviations at p = 0.5 over 24 are
// 0.31; DecisionProfileTest checks convergence over many heads).
TEST(ProfileRecordTest, ReplayingARecordedProfileGivesTheRecordedShares) {
  const std::string dir = SourceDir() + "/models/fluxion-tiny-retrieval";
  auto model = model::Model::Load(dir);
  ASSERT_TRUE(model.ok()) << "cannot load " << dir << ": " << model.status();
  TaskEvalOptions options;
  options.tasks = {"niah_single", "aggregate"};
  options.contexts = {2048};
  options.samples = 1;
  options.first_seed = kFirstEvalSeed;
  options.policies = {"lfps@0.1", "fluxion@0.1"};
  auto predictor = decode::sparse::ResolvePredictor("", dir);
  ASSERT_TRUE(predictor.ok()) << predictor.status();
  options.fluxion_predictor = *predictor;

  DecisionRecorder recorder;
  const auto recorded_stats = RunEval(**model, options, &recorder);
  absl::StatusOr<DecisionProfile> recorded = recorder.Build("tiny-2k", "{}");
  ASSERT_TRUE(recorded.ok()) << recorded.status();
  ASSERT_EQ(recorded->policies().size(), 2u);
  absl::StatusOr<DecisionProfile> loaded = DecisionProfile::Parse(recorded->Serialize());
  ASSERT_TRUE(loaded.ok()) << loaded.status();

  options.decision_profile = std::make_shared<const DecisionProfile>(*loaded);
  const auto replayed_stats = RunEval(**model, options, nullptr);
  for (const PolicyDecisions& d : loaded->policies()) {
    const std::string label = d.policy + "@0.1";
    ASSERT_TRUE(replayed_stats.count(label)) << label;
    const SelectionStats& rec = recorded_stats.at(label);
    const SelectionStats& rep = replayed_stats.at(label);
    ASSERT_GT(rep.selections, 0) << label;
    const double n = static_cast<double>(rep.selections);
    EXPECT_NEAR(rep.streaming / n, d.streaming_share, 0.05) << label;
    EXPECT_NEAR(rep.bypassed / n, d.bypass_share, 0.05) << label;
    EXPECT_NEAR(MeanBudget(rep), MeanBudget(rec), 0.003) << label;
    for (int64_t block : {int64_t{1}, int64_t{16}, int64_t{32}, int64_t{64}}) {
      EXPECT_NEAR(BlockShare(rep, block), BlockShare(rec, block), 0.25)
          << label << " block " << block;
    }
  }
}

}  // namespace
}  // namespace fluxion::eval

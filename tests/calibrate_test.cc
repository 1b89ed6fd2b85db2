// `fluxion calibrate` on a checkpoint that ships without a predictor (our trained model's weights
// and config alone): the `fluxion` policy is refused before, and served from the fitted file after.
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "bench/eval/calibrate_command.h"
#include "bench/eval/eval_command.h"
#include "common/test_temp_dir.h"
#include "decode/sparse/fluxion_predictor.h"
#include "gtest/gtest.h"

namespace fluxion::eval {
namespace {

namespace fs = std::filesystem;

std::string TrainedModelDir() {
  const char* dir = std::getenv("FLUXION_SOURCE_DIR");
  return std::string(dir != nullptr ? dir : ".") + "/models/fluxion-tiny-retrieval";
}

// The trained model without its fluxion_predictor.json.
std::string CopyWithoutPredictor(const ScopedTestTempDir& temp) {
  const std::string dir = temp.File("model");
  fs::create_directories(dir);
  for (const char* name : {"config.json", "model.safetensors"}) {
    fs::copy_file(TrainedModelDir() + "/" + name, dir + "/" + name);
  }
  return dir;
}

std::vector<std::string> FluxionEval(const std::string& model) {
  return {"--model", model, "--policy", "fluxion", "--tasks", "niah_single", "--contexts", "1024",
          "--samples", "1", "--cpu-threads", "1"};
}

TEST(CalibrateTest, FitsAPredictorTheFluxionPolicyThenRunsWith) {
  ScopedTestTempDir temp;
  const std::string model = CopyWithoutPredictor(temp);
  // Refused, naming the command that fixes it (the message is checked in fluxion_predictor_test).
  EXPECT_EQ(RunEvalTasksCommand(FluxionEval(model)), 1);

  // Two tasks at 1K and 4K, two prompts each: streaming heads at 1K, tier rows at 4K.
  const std::string work = temp.File("work");
  ASSERT_EQ(RunCalibrateCommand({"--model", model, "--tasks", "niah_single,vt", "--contexts",
                                 "1024,4096", "--samples", "2", "--folds", "2", "--cpu-threads",
                                 "1", "--work-dir", work}),
            0);
  const auto predictor = decode::sparse::RequirePredictor("", model);
  ASSERT_TRUE(predictor.ok()) << predictor.status();
  ASSERT_NE(*predictor, nullptr);
  EXPECT_TRUE(fs::exists(work + "/heads.csv"));
  EXPECT_TRUE(fs::exists(work + "/capture/index.json"));
  EXPECT_EQ(RunEvalTasksCommand(FluxionEval(model)), 0);
}

TEST(CalibrateTest, UsageErrorsStopBeforeAnyModelTime) {
  ScopedTestTempDir temp;
  const std::string model = CopyWithoutPredictor(temp);
  EXPECT_EQ(RunCalibrateCommand({"--model", model, "--samples", "0"}), 2);
  EXPECT_EQ(RunCalibrateCommand({"--model", model, "--tasks", "nope"}), 2);
  EXPECT_EQ(RunCalibrateCommand({"--model", model, "--folds", "1"}), 2);
  // Longer than the model's 32,768 positions.
  EXPECT_EQ(RunCalibrateCommand({"--model", model, "--contexts", "40000"}), 2);
  EXPECT_EQ(RunCalibrateCommand({"--model", temp.File("absent")}), 1);
  EXPECT_FALSE(fs::exists(model + "/" + decode::sparse::kPredictorFileName));
}

}  // namespace
}  // namespace fluxion::eval

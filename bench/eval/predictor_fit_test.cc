#include "bench/eval/predictor_fit.h"

#include <cmath>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "decode/sparse/fluxion_predictor.h"
#include "gtest/gtest.h"
#include "common/test_temp_dir.h"

namespace fluxion::eval {
namespace {

double Sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }

TEST(PredictorFitTest, LogisticFitIsTheRegularisedOptimumAndRecoversTheGeneratingModel) {
  std::mt19937_64 rng(3);
  std::normal_distribution<double> normal;
  std::uniform_real_distribution<double> uniform;
  std::vector<std::vector<double>> z;
  std::vector<double> y;
  for (int i = 0; i < 20000; ++i) {
    z.push_back({normal(rng), normal(rng)});
    y.push_back(uniform(rng) < Sigmoid(1.5 * z.back()[0] - 2.0 * z.back()[1] + 0.3) ? 1.0 : 0.0);
  }
  const double lambda = 1e-3;
  const LogisticModel m = FitLogistic(z, y, lambda);
  ASSERT_EQ(m.weights.size(), 2u);
  EXPECT_NEAR(m.weights[0], 1.5, 0.1);
  EXPECT_NEAR(m.weights[1], -2.0, 0.1);
  EXPECT_NEAR(m.bias, 0.3, 0.1);
  // Optimality: the gradient of mean log loss + lambda/2 |w|^2 vanishes.
  double g0 = 0, g1 = 0, gb = 0;
  for (size_t i = 0; i < z.size(); ++i) {
    const double r =
        Sigmoid(m.weights[0] * z[i][0] + m.weights[1] * z[i][1] + m.bias) - y[i];
    g0 += r * z[i][0] / z.size();
    g1 += r * z[i][1] / z.size();
    gb += r / z.size();
  }
  EXPECT_NEAR(g0 + lambda * m.weights[0], 0.0, 1e-9);
  EXPECT_NEAR(g1 + lambda * m.weights[1], 0.0, 1e-9);
  EXPECT_NEAR(gb, 0.0, 1e-9);
}

constexpr char kHeader[] =
    "sample,task,context,seed,step,position,layer,num_layers,kv_head,middle_share,"
    "need_fraction,sink_mass,local_mass,entropy,layer_frac,contribution,e_0,e_002,e_005,"
    "e_merged_0,e_merged_002,e_merged_005,middle_rows_0,middle_rows_002,middle_rows_005\n";

// A head-table line of sample `seed`'s (layer, 0) at decode step `step`.
std::string Row(uint64_t seed, int step, int layer, double middle_share, double e0, double e002,
                int64_t rows002) {
  return absl::StrCat("s", seed, ",niah_single,4096,", seed, ",", step, ",", 4000 + step, ",",
                      layer, ",8,0,", middle_share, ",0.5,0.01,", 1 - middle_share, ",3.0,",
                      layer / 8.0, ",0.1,", e0, ",", e002, ",0.001,0,0,0,0,", rows002, ",100\n");
}

TEST(PredictorFitTest, HeadTableRowsAverageOverStepsPerHead) {
  const ScopedTestTempDir dir;
  const std::string path = dir.File("heads.csv");
  std::ofstream(path) << kHeader << Row(500000, 0, 1, 0.9, 0.2, 0.1, 40)
                      << Row(500000, 1, 1, 0.9, 0.4, 0.3, 38) << Row(500000, 0, 2, 0.01, 0.0, 0.0, 40);
  const auto heads = ReadHeadTable(path);
  ASSERT_TRUE(heads.ok()) << heads.status();
  ASSERT_EQ(heads->size(), 2u);
  EXPECT_EQ((*heads)[0].sample, "s500000");
  EXPECT_EQ((*heads)[0].context, 4096);
  EXPECT_NEAR((*heads)[0].e[0], 0.3, 1e-12);
  EXPECT_NEAR((*heads)[0].e[1], 0.2, 1e-12);
  EXPECT_EQ((*heads)[0].middle_rows_002, 38);
  EXPECT_DOUBLE_EQ((*heads)[0].x[0], 0.9);
  EXPECT_DOUBLE_EQ((*heads)[0].x[5], 1 / 8.0);

  std::ofstream(path) << "sample,task\ns,niah\n";
  EXPECT_EQ(ReadHeadTable(path).status().code(), absl::StatusCode::kInvalidArgument);
  std::ofstream(path) << kHeader << "s1,niah_single,4096,x,0,0,1,8,0,0.9,0.5\n";
  const auto bad = ReadHeadTable(path);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find(":2"), std::string::npos) << bad.status();
  EXPECT_EQ(ReadHeadTable(path + ".missing").status().code(), absl::StatusCode::kNotFound);
}

TEST(PredictorFitTest, TheFittedFileLoadsAndSeparatesStreamingFromRetrievalHeads) {
  // Heads with a small middle share are streaming (e_0 ~ 0); the others need the middle, and the
  // deep ones need the 0.05 tier. Twelve samples, eight layers each.
  std::vector<CalibrationHead> heads;
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> jitter(-0.02, 0.02);
  for (uint64_t seed = 500000; seed < 500012; ++seed) {
    for (int layer = 0; layer < 8; ++layer) {
      CalibrationHead h;
      h.sample = absl::StrCat("s", seed);
      h.task = "niah_single";
      h.context = 4096;
      h.seed = seed;
      const bool streaming = layer < 2;
      const double share = (streaming ? 0.05 : 0.9) + jitter(rng);
      h.x = {share, 0.5, 0.01, 1 - share, streaming ? 1.0 : 5.0, layer / 8.0};
      h.e = {streaming ? 0.001 : 0.3, layer >= 5 ? 0.1 : 0.01, 0.005};
      h.middle_rows_002 = 40;
      heads.push_back(h);
    }
  }
  FitOptions options;
  options.command = "test";
  const auto doc = FitPredictor(heads, options);
  ASSERT_TRUE(doc.ok()) << doc.status();
  const auto predictor = decode::sparse::FluxionPredictor::Parse(doc->dump());
  ASSERT_TRUE(predictor.ok()) << predictor.status();
  EXPECT_TRUE(predictor->Predict({0.05, 0.5, 0.01, 0.95, 1.0, 0.0}).streaming);
  const decode::sparse::HeadPrediction shallow = predictor->Predict({0.9, 0.5, 0.01, 0.1, 5.0, 0.25});
  EXPECT_FALSE(shallow.streaming);
  EXPECT_DOUBLE_EQ(shallow.tier, 0.02);
  EXPECT_DOUBLE_EQ(predictor->Predict({0.9, 0.5, 0.01, 0.1, 5.0, 0.75}).tier, 0.05);
  EXPECT_EQ((*doc)["validation"]["streaming"]["accuracy"], 1.0);
  EXPECT_EQ((*doc)["calibration"]["samples"], 12);
  EXPECT_EQ((*doc)["calibration"]["tier_heads"], 72);

  // One class only: nothing to fit, said so.
  for (CalibrationHead& h : heads) h.e[0] = 0.5;
  const auto none = FitPredictor(heads, options);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(none.status().message().find("retrieval"), std::string::npos) << none.status();
}

}  // namespace
}  // namespace fluxion::eval

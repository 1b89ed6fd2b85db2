// The seam logic of the fused and graphed decode step, on the CPU: FuseParams (layer.h), the layer
// body's fused path, and the runner's graph bookkeeping (decode_step.h), driven through a CPU
// DenseOps that offers both capabilities. Its fused operations are the CPU ops composed (GEMM
// input = fp32), and its "graphs" record the operations issued while capturing as closures over
// the same pointers and sizes, replayed later, which is what a CUDA graph does; a host copy or a
// Sync while recording fails the capture, as on CUDA. The device versions of the same checks are
// in cuda_dense_ops_test.cc.
//
// Tolerance: fused vs plain CPU differs only in blocking (one product over stacked weight rows
// instead of three, the bias added after the product instead of inside it): 1e-5 of the largest
// logit, as decode_step_test.cc's batch-vs-alone. Graphs vs no graphs replay the same operations
// on the same data: bit-identical.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

#include "gtest/gtest.h"
#include "model/cpu_dense_ops.h"
#include "model/decode_step.h"
#include "model/layer.h"
#include "model/model.h"
#include "model/random_model.h"

namespace fluxion::model {
namespace {

double RelDiff(const float* a, const float* b, int64_t n) {
  double diff = 0, scale = 1;
  for (int64_t i = 0; i < n; ++i) {
    diff = std::max(diff, std::abs(double(a[i]) - b[i]));
    scale = std::max(scale, std::abs(double(b[i])));
  }
  return diff / scale;
}

class RecordedGraph : public OpsGraph {
 public:
  std::vector<std::function<void()>> ops;
};

class FusedGraphCpuOps : public CpuDenseOps, public FusedDenseOps, public OpsGraphs {
 public:
  FusedDenseOps* fused() override { return offer_fused ? this : nullptr; }
  OpsGraphs* graphs() override { return offer_graphs ? this : nullptr; }

  void MatMul(const float* x, WeightRef w, const float* bias, float* y, int64_t m, int64_t n,
              int64_t k, bool accumulate) override {
    Issue([=] { CpuDenseOps::MatMul(x, w, bias, y, m, n, k, accumulate); });
  }
  void RmsNorm(const float* x, const float* weight, float eps, float* y, int64_t m,
               int64_t d) override {
    Issue([=] { CpuDenseOps::RmsNorm(x, weight, eps, y, m, d); });
  }
  void ApplyRope(float* x, const int64_t* positions, const float* inv_freq, int64_t n,
                 int64_t heads, int64_t head_dim) override {
    Issue([=] { CpuDenseOps::ApplyRope(x, positions, inv_freq, n, heads, head_dim); });
  }
  void SiluMul(const float* gate, const float* up, float* out, int64_t n) override {
    Issue([=] { CpuDenseOps::SiluMul(gate, up, out, n); });
  }
  void CopyFromHost(void* dst, const void* src, size_t bytes) override {
    if (recording_ != nullptr) capture_failed_ = true;  // a copy that waits: not recordable
    CpuDenseOps::CopyFromHost(dst, src, bytes);
  }
  void CopyToHost(void* dst, const void* src, size_t bytes) override {
    if (recording_ != nullptr) capture_failed_ = true;
    CpuDenseOps::CopyToHost(dst, src, bytes);
  }
  absl::Status Sync() override {
    if (recording_ != nullptr) capture_failed_ = true;
    return absl::OkStatus();
  }

  size_t GemmInputBytes(int64_t n) const override { return n * sizeof(float); }
  void RmsNormToGemmInput(const float* x, const float* weight, float eps, void* xg, int64_t m,
                          int64_t d) override {
    RmsNorm(x, weight, eps, static_cast<float*>(xg), m, d);
  }
  void ToGemmInput(const float* x, void* xg, int64_t n) override {
    Issue([=] { std::memmove(xg, x, n * sizeof(float)); });
  }
  void MatMulGemmInput(const void* xg, WeightRef w, const float* bias, float* y, int64_t m,
                       int64_t n, int64_t k, bool accumulate) override {
    MatMul(static_cast<const float*>(xg), w, bias, y, m, n, k, accumulate);
  }
  void SplitQkvRope(const float* qkv, const float* bias, const int64_t* positions,
                    const float* inv_freq, float* q, float* k, float* v, int64_t m, int64_t heads,
                    int64_t kv_heads, int64_t head_dim) override {
    ++split_calls;
    Issue([=] {
      const int64_t qw = heads * head_dim, kw = kv_heads * head_dim, row = qw + 2 * kw;
      for (int64_t t = 0; t < m; ++t) {
        for (int64_t j = 0; j < row; ++j) {
          const float x = qkv[t * row + j] + (bias != nullptr ? bias[j] : 0.0f);
          if (j < qw) {
            q[t * qw + j] = x;
          } else if (j < qw + kw) {
            k[t * kw + j - qw] = x;
          } else {
            v[t * kw + j - qw - kw] = x;
          }
        }
      }
    });
    ApplyRope(q, positions, inv_freq, m, heads, head_dim);
    ApplyRope(k, positions, inv_freq, m, kv_heads, head_dim);
  }
  void SiluMulToGemmInput(const float* gate_up, void* outg, int64_t m, int64_t f) override {
    Issue([=] {
      float* out = static_cast<float*>(outg);
      for (int64_t t = 0; t < m; ++t) {
        CpuDenseOps::SiluMul(gate_up + t * 2 * f, gate_up + t * 2 * f + f, out + t * f, f);
      }
    });
  }

  absl::Status BeginCapture() override {
    if (fail_captures) return absl::UnavailableError("test: capture refused");
    recording_ = std::make_unique<RecordedGraph>();
    capture_failed_ = false;
    return absl::OkStatus();
  }
  absl::StatusOr<std::unique_ptr<OpsGraph>> EndCapture() override {
    std::unique_ptr<RecordedGraph> g = std::move(recording_);
    if (capture_failed_) return absl::InternalError("test: a copy or Sync while recording");
    ++captures;
    return std::unique_ptr<OpsGraph>(std::move(g));
  }
  void Replay(OpsGraph& graph) override {
    for (auto& op : static_cast<RecordedGraph&>(graph).ops) op();
  }
  uint64_t generation() const override { return generation_value; }

  bool offer_fused = true;
  bool offer_graphs = true;
  bool fail_captures = false;
  uint64_t generation_value = 0;
  int64_t captures = 0;
  int64_t split_calls = 0;  // SplitQkvRope issued: the fused path ran

 private:
  void Issue(std::function<void()> op) {
    if (recording_ != nullptr) {
      recording_->ops.push_back(std::move(op));
    } else {
      op();
    }
  }
  std::unique_ptr<RecordedGraph> recording_;
  bool capture_failed_ = false;
};

class FusedStepTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    ModelConfig c = PresetConfig("tiny").value();
    if (GetParam() == "qwen2") {  // q/k/v bias: the stacked bias goes through the split
      c.architecture = Architecture::kQwen2;
      c.qkv_bias = true;
      c.tie_word_embeddings = true;
      c.num_kv_heads = 1;
      c.rope = RopeConfig{RopeType::kDefault, 10000.0};
    }
    dir_ = ::testing::TempDir() + "/fluxion_fused_step_test_" + GetParam() + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name() + "_" +
           std::to_string(getpid());
    ASSERT_TRUE(WriteRandomModel(c, 29, dir_).ok());
    auto model = Model::Load(dir_);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::move(*model);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // `steps` decode steps of `batches[step % size]` requests through `ops` (attention on the host,
  // teacher-forced with fixed tokens), logits of every step appended to *logits.
  void RunSteps(DenseOps& ops, DecodeStepRunner& runner, const std::vector<int64_t>& batches,
                int steps, std::vector<float>* logits) {
    const int64_t vocab = model_->config().vocab_size;
    const int64_t max_b = *std::max_element(batches.begin(), batches.end());
    std::vector<std::unique_ptr<Sequence>> seqs;
    std::vector<float> scratch, outs[2];
    for (int64_t i = 0; i < max_b; ++i) {
      seqs.push_back(model_->NewSequence());
      std::vector<int32_t> prompt(3 + 5 * i, static_cast<int32_t>(i + 1));
      ASSERT_TRUE(model_->Forward(*seqs[i], prompt, &scratch).ok());
    }
    for (int step = 0; step < steps; ++step) {
      const int64_t b = batches[step % batches.size()];
      std::vector<Sequence*> ptrs;
      std::vector<int32_t> tokens;
      std::vector<int64_t> positions;
      for (int64_t i = 0; i < b; ++i) {
        ptrs.push_back(seqs[i].get());
        tokens.push_back(static_cast<int32_t>((7 * step + 3 * i) % vocab));
        positions.push_back(seqs[i]->length());
      }
      SequenceBatchAttention attention(ptrs, model_->attention_shape(), &ops);
      // Two caller buffers in turn, NaN before each step: a graph that kept an earlier step's
      // logits pointer would leave this one unwritten.
      std::vector<float>& out = outs[step % 2];
      out.assign(b * vocab, NAN);
      const absl::Status s = runner.Step(tokens, positions, attention, out.data());
      ASSERT_TRUE(s.ok()) << s;
      logits->insert(logits->end(), out.begin(), out.end());
    }
  }

  std::unique_ptr<DecodeStepRunner> NewRunner(DenseOps& ops) {
    auto r = DecodeStepRunner::Create(*model_, &ops);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? std::move(*r) : nullptr;
  }

  std::string dir_;
  std::unique_ptr<Model> model_;
};

// FuseParams stacks q/k/v and gate/up per layer on ops that offer fused operations: the stack
// holds the separate matrices' rows in order, q/k/v/gate/up then view their rows of it (so the
// plain path computes what it did), biases likewise; on ops without the capability it does
// nothing.
TEST_P(FusedStepTest, FuseParamsStacksRowsAndKeepsTheSeparateViews) {
  const ModelConfig& c = model_->config();
  FusedGraphCpuOps ops;
  auto params = model_->UploadParams(ops);
  ASSERT_TRUE(params.ok()) << params.status();
  std::vector<LayerParams> before = params->layers;
  ASSERT_TRUE(FuseParams(ops, &*params).ok());
  const int64_t h = c.hidden_size;
  for (size_t l = 0; l < before.size(); ++l) {
    const LayerParams& w = params->layers[l];
    ASSERT_NE(w.qkv.weight.data, nullptr) << l;
    ASSERT_NE(w.gate_up.weight.data, nullptr) << l;
    EXPECT_EQ(w.qkv.out, before[l].q.out + before[l].k.out + before[l].v.out);
    EXPECT_EQ(w.gate_up.out, 2 * c.intermediate_size);
    const float* qkv = static_cast<const float*>(w.qkv.weight.data);
    EXPECT_EQ(w.q.weight.data, qkv);
    EXPECT_EQ(w.k.weight.data, qkv + w.q.out * h);
    EXPECT_EQ(w.v.weight.data, qkv + (w.q.out + w.k.out) * h);
    const float* gu = static_cast<const float*>(w.gate_up.weight.data);
    EXPECT_EQ(w.up.weight.data, gu + c.intermediate_size * h);
    int64_t row = 0;
    for (const LinearParams* p : {&before[l].q, &before[l].k, &before[l].v}) {
      const float* original = static_cast<const float*>(p->weight.data);
      ASSERT_EQ(std::memcmp(qkv + row * h, original, p->out * h * sizeof(float)), 0) << l;
      if (c.qkv_bias) {
        ASSERT_EQ(std::memcmp(w.qkv.bias + row, p->bias, p->out * sizeof(float)), 0) << l;
      }
      row += p->out;
    }
    EXPECT_EQ(w.qkv.bias != nullptr, c.qkv_bias);
    EXPECT_EQ(std::memcmp(gu, before[l].gate.weight.data, c.intermediate_size * h * 4), 0);
    EXPECT_EQ(std::memcmp(gu + c.intermediate_size * h, before[l].up.weight.data,
                          c.intermediate_size * h * 4),
              0);
  }
  CpuDenseOps plain;
  auto plain_params = model_->UploadParams(plain);
  ASSERT_TRUE(plain_params.ok());
  ASSERT_TRUE(FuseParams(plain, &*plain_params).ok());
  EXPECT_EQ(plain_params->layers[0].qkv.weight.data, nullptr);
  EXPECT_EQ(plain_params->layers[0].q.weight.data, before[0].q.weight.data);
}

// The runner on fused ops (graphs off) computes the plain CPU step's logits.
TEST_P(FusedStepTest, FusedStepMatchesThePlainCpuStep) {
  CpuDenseOps plain;
  FusedGraphCpuOps fused;
  fused.offer_graphs = false;
  auto plain_runner = NewRunner(plain);
  auto fused_runner = NewRunner(fused);
  std::vector<float> want, got;
  RunSteps(plain, *plain_runner, {3}, 4, &want);
  RunSteps(fused, *fused_runner, {3}, 4, &got);
  ASSERT_EQ(got.size(), want.size());
  EXPECT_LE(RelDiff(got.data(), want.data(), got.size()), 1e-5);
  EXPECT_NE(fused_runner->params().layers[0].qkv.weight.data, nullptr);
  EXPECT_EQ(fused.split_calls, 4 * model_->config().num_layers);
}

// Graphs: the first step at a batch size runs eagerly, the second records, later ones replay,
// per batch size; a larger batch (new buffers) and a new backend generation re-record; the
// results are bit-identical to the same runner with graphs off.
TEST_P(FusedStepTest, GraphedStepsEqualEagerStepsAcrossBatchSizesAndInvalidations) {
  const int64_t segments = model_->config().num_layers + 1;
  FusedGraphCpuOps eager_ops, graph_ops;
  auto eager = NewRunner(eager_ops);
  eager->set_use_graphs(false);
  auto graphed = NewRunner(graph_ops);
  std::vector<float> want, got;
  // Batch 2 (steps 0-2), then 4 (steps 3-5: new buffers), then 2 again (re-recorded after the
  // buffers changed).
  RunSteps(eager_ops, *eager, {2, 2, 2, 4, 4, 4, 2, 2}, 8, &want);
  RunSteps(graph_ops, *graphed, {2, 2, 2, 4, 4, 4, 2, 2}, 8, &got);
  ASSERT_EQ(got.size(), want.size());
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0);
  EXPECT_TRUE(graphed->graph_status().ok()) << graphed->graph_status();
  EXPECT_EQ(eager_ops.captures, 0);
  // Recorded: batch 2 at step 1, batch 4 at step 4, batch 2 again at step 7 (step 6 warms it up
  // on the new buffers). Replayed from graphs: steps 1, 2, 4, 5, 7.
  EXPECT_EQ(graph_ops.captures, 3 * segments);
  EXPECT_EQ(graphed->graph_replays(), 5 * segments);

  // A new backend generation (scratch reallocated) drops the graphs: the next step at a size runs
  // eagerly again, the one after records.
  graph_ops.generation_value = 1;
  const int64_t captures = graph_ops.captures;
  got.clear();
  want.clear();
  RunSteps(eager_ops, *eager, {2}, 3, &want);
  RunSteps(graph_ops, *graphed, {2}, 3, &got);
  EXPECT_EQ(graph_ops.captures, captures + segments);
  EXPECT_EQ(graphed->graph_replays(), 7 * segments);
  ASSERT_EQ(got.size(), want.size());
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0);
}

// A failed capture turns graphs off with the reason, and the step still computes the eager result.
TEST_P(FusedStepTest, AFailedCaptureFallsBackToEagerSteps) {
  FusedGraphCpuOps eager_ops, graph_ops;
  graph_ops.fail_captures = true;
  auto eager = NewRunner(eager_ops);
  eager->set_use_graphs(false);
  auto graphed = NewRunner(graph_ops);
  std::vector<float> want, got;
  RunSteps(eager_ops, *eager, {2}, 3, &want);
  RunSteps(graph_ops, *graphed, {2}, 3, &got);
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0);
  EXPECT_EQ(graphed->graph_status().code(), absl::StatusCode::kUnavailable)
      << graphed->graph_status();
  EXPECT_NE(graphed->graph_status().message().find("graphs off"), std::string::npos);
  EXPECT_EQ(graphed->graph_replays(), 0);
}

INSTANTIATE_TEST_SUITE_P(Families, FusedStepTest, ::testing::Values("llama", "qwen2"));

}  // namespace
}  // namespace fluxion::model

// The ping-pong decode step executor (docs/EXECUTOR.md section 8; ALGORITHMS.md §2.4.6): the batch
// split into two micro-batches A and B, each stepped by its own hybrid pipeline
// (hybrid_step_executor.h: its own DenseOps -- stream, scratch, CUDA graphs -- and its own
// ResidentWindow -- slots) on its own driver thread, so that while the CPU works on one
// micro-batch's layer the device runs the other's dense work. Without it the hybrid step
// serialises per layer and the GPU idles 25-85% of a step at 8B shapes (bench/results/README.md,
// section 6).
//
// Shared by the two pipelines: ONE copy of the weights (in A's DenseOps's memory; B borrows them,
// DenseOps::CanUseWeightsOf, so 16 GB at 8B are never uploaded twice), the CPU pool, and one
// CpuLane (cpu_lane.h) through which the thread that called Step runs the CPU phase of their
// layers, one at a time, FIFO: two CPU phases at once would each get half the cores and half the
// host-memory bandwidth, so overlapping them buys nothing, while a CPU phase of one overlaps the
// other's GPU work; and one thread starting every phase's parallel regions keeps one OpenMP team
// on the cores.
//
// Split: a request joins a micro-batch at the first step that lists it (the one holding fewer
// requests, A on a tie; the other when that one's window is full) and stays there while steps
// list it, since its window slot lives in that pipeline. A step runs both halves at once and
// returns when both are done, logits and statuses in the caller's row order. An empty half is
// skipped (it only gives its departed requests' slots back), so a batch of one request runs on
// one pipeline. The cost: every weight is read once per micro-batch, so the dense work at small
// batch (bound by reading the weights) doubles.
//
// Thread-compatible: the scheduler thread calls Step(). The two driver threads are the
// executor's, started at creation and joined by its destructor.
#ifndef FLUXION_DECODE_STEP_PING_PONG_STEP_EXECUTOR_H_
#define FLUXION_DECODE_STEP_PING_PONG_STEP_EXECUTOR_H_

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "decode/step/cpu_lane.h"
#include "decode/step/hybrid_batch_attention.h"
#include "decode/step/hybrid_step_executor.h"
#include "decode/step/resident_window.h"
#include "decode/step/step_executor.h"
#include "model/dense_ops.h"
#include "model/layer.h"

namespace fluxion::decode {

class PingPongStepExecutor : public StepExecutor {
 public:
  // One micro-batch's device half: the window must run on the ops (CUDA: on its stream).
  struct Pipeline {
    std::unique_ptr<model::DenseOps> ops;
    std::unique_ptr<ResidentWindow> window;
  };
  struct Options {
    // Run first on each driver thread, e.g. to make the CUDA device current there (CUDA's
    // current device is per thread; the thread calling Step, which runs the CPU phases and with
    // them the device's zero-copy launches, must have it current too). An error fails every
    // request of that micro-batch, naming it. Null: nothing to run.
    std::function<absl::Status()> thread_init;
  };

  // `model` and `pool` (may be null) must outlive the executor. The weights are uploaded to
  // a.ops once (Model::UploadParams) and b.ops borrows them. InvalidArgument when b.ops cannot
  // read a.ops's weights (DenseOps::CanUseWeightsOf) or a window's shape is not the model's;
  // the backends' errors.
  static absl::StatusOr<std::unique_ptr<PingPongStepExecutor>> Create(
      const model::Model* model, Pipeline a, Pipeline b, const kernels::cpu::CpuPool* pool,
      Options options = {});
  // Over weights already in a.ops's memory (model/random_params.h for shapes with no host copy).
  static absl::StatusOr<std::unique_ptr<PingPongStepExecutor>> Create(
      const model::ModelConfig& config, model::ModelParams params, Pipeline a, Pipeline b,
      const kernels::cpu::CpuPool* pool, Options options = {});
  ~PingPongStepExecutor() override;

  absl::string_view name() const override { return "ping-pong"; }
  // Both windows' slots.
  int64_t max_batch() const override;
  // No Reserve: a request's half is chosen at its first step, so device-selection places are
  // not reserved ahead; a request that finds none on its half selects on the CPU (correct, as
  // slow as a CPU scan). The ping-pong step is not the default (docs/EXECUTOR.md section 8).
  // As StepExecutor::Step; an empty batch is allowed and only gives every slot back. A request
  // neither window can take gets ResourceExhausted; a pipeline's errors are its requests' only.
  void Step(absl::Span<const StepRequest> batch, std::vector<float>* logits,
            std::vector<absl::Status>* statuses) override;
  // As Step, each half sampling its rows where its logits are (HybridStepExecutor's
  // StepAndSample: candidates, not full rows, cross when the samplers allow).
  void StepAndSample(absl::Span<const StepRequest> batch, std::vector<int32_t>* tokens,
                     std::vector<float>* logits, std::vector<absl::Status>* statuses) override;

  // Pipeline 0 (A, which owns the weights) or 1 (B). Use one directly only between steps (no
  // driver runs then), e.g. for the single-pipeline rows of `fluxion bench decode`; give its
  // slots back (Step of an empty batch) before the next ping-pong step.
  HybridStepExecutor& pipeline(int i) { return *pipelines_[i]; }
  // The micro-batch request `id` (SparseAttention::id()) steps in, or -1 when none holds it.
  int MicroBatchOf(uint64_t id) const;

  // Both pipelines' settings (HybridStepExecutor's).
  void set_window_block_scores(bool on);
  void set_device_read_share(double share);

  // Both pipelines' counters summed (lane_wait_s: the time each half waited for the CPU lane,
  // summed over the halves).
  HybridCounters counters() const;
  void ResetCounters();

 private:
  class Driver;
  // What one micro-batch steps this time.
  struct Part {
    std::vector<StepRequest> batch;
    std::vector<size_t> rows;  // the caller's row of each
    std::vector<float> logits;
    std::vector<int32_t> tokens;  // when sampling
    std::vector<absl::Status> statuses;
  };
  // Step (tokens null) or StepAndSample.
  void Run(absl::Span<const StepRequest> batch, std::vector<int32_t>* tokens,
           std::vector<float>* logits, std::vector<absl::Status>* statuses);

  PingPongStepExecutor(int64_t vocab, std::unique_ptr<CpuLane> lane,
                       std::unique_ptr<HybridStepExecutor> a,
                       std::unique_ptr<HybridStepExecutor> b, const Options& options);
  // The micro-batch a new request joins, or -1 when both are full.
  int ChooseHalf() const;
  // Steps parts_[h] on pipeline h (on its driver thread, whose init gave `init`).
  void RunPart(int h, const absl::Status& init);

  const int64_t vocab_;
  // Declared in the order they must be built; destroyed in reverse: the drivers stop first, then
  // B (which borrows A's weights), then A, then the lane both use.
  std::unique_ptr<CpuLane> lane_;
  std::array<std::unique_ptr<HybridStepExecutor>, 2> pipelines_;
  std::array<std::unique_ptr<Driver>, 2> drivers_;
  absl::flat_hash_map<uint64_t, int> half_of_;  // SparseAttention::id() -> micro-batch
  std::array<int64_t, 2> held_ = {0, 0};        // requests each micro-batch holds
  // Scratch of one step.
  absl::flat_hash_set<uint64_t> present_;
  std::array<Part, 2> parts_;
  bool sampling_ = false;  // this step samples (read by the drivers while it runs)
};

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_STEP_PING_PONG_STEP_EXECUTOR_H_

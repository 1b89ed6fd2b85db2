// The hybrid decode step executor (docs/EXECUTOR.md section 7): the dense halves of the batch on
// a DenseOps (CUDA in production; the CPU ones for the host stand-in), per layer the resident
// window (sinks + recent tokens) attended where the DenseOps runs and the rest of every policy's
// plan on the CPU over host pages, merged by log-sum-exp (hybrid_batch_attention.h).
//
// Requests are admitted to the window the first time a step sees them (their prompt's resident
// rows, page bounds and compact keys gathered and uploaded inside that step), and released when
// a step no longer lists them or on Forget. The window's device-selection places are reserved
// before a request joins (Reserve), so a scheduled request that selects on the device always
// finds one. A request
// the window cannot take (every slot busy, or a policy whose sinks or local window are smaller
// than the resident ones, so its plan would not contain the resident rows) gets its own error
// and the step runs without it.
//
// Thread-compatible: the scheduler thread calls Step().
#ifndef FLUXION_DECODE_STEP_HYBRID_STEP_EXECUTOR_H_
#define FLUXION_DECODE_STEP_HYBRID_STEP_EXECUTOR_H_

#include <memory>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "decode/step/hybrid_batch_attention.h"
#include "decode/step/resident_window.h"
#include "decode/step/stall_guard.h"
#include "decode/step/step_executor.h"
#include "model/dense_ops.h"

namespace fluxion::decode {

class HybridStepExecutor : public StepExecutor {
 public:
  // `model` and `pool` (may be null) must outlive the executor; it owns `ops` and `window`.
  // The model's weights are uploaded to `ops` once here (errors: the backend's). InvalidArgument
  // when the window's shape is not the model's.
  static absl::StatusOr<std::unique_ptr<HybridStepExecutor>> Create(
      const model::Model* model, std::unique_ptr<model::DenseOps> ops,
      std::unique_ptr<ResidentWindow> window, const kernels::cpu::CpuPool* pool);
  // Over weights already in `ops`'s memory (model/random_params.h for shapes with no host copy).
  static absl::StatusOr<std::unique_ptr<HybridStepExecutor>> Create(
      const model::ModelConfig& config, std::unique_ptr<model::DenseOps> ops,
      model::ModelParams params, std::unique_ptr<ResidentWindow> window,
      const kernels::cpu::CpuPool* pool);
  ~HybridStepExecutor() override;

  absl::string_view name() const override { return "hybrid"; }
  // The window's slots (a request holds one from its first step to its last).
  int64_t max_batch() const override;
  // As StepExecutor::Step; an empty batch is allowed here and only gives every slot back.
  void Step(absl::Span<const StepRequest> batch, std::vector<float>* logits,
            std::vector<absl::Status>* statuses) override;
  // As StepExecutor::StepAndSample. The logits stay in the DenseOps's memory; when its
  // CandidateOps exist and some row's sampler can draw from candidates, they run over every row
  // and only the candidates cross to the host; a row whose sampler declines them (temperature
  // alone, top-p whose mass the candidates do not reach) and a row without a sampler copy their
  // full logits.
  void StepAndSample(absl::Span<const StepRequest> batch, std::vector<int32_t>* tokens,
                     std::vector<float>* logits, std::vector<absl::Status>* statuses) override;
  // A request whose policy selects from compact keys (sparse::DeviceSelects) and whose context
  // fits the window's compact rows reserves one of the window's compact_slots places; false
  // while every place is reserved. Other requests need none: always true.
  bool Reserve(const SparseAttention& attention) override;
  // Gives the request's window slot and reservation back, if it holds them.
  void Forget(const SparseAttention& attention) override;
  // Device-selection places reserved now (Reserve minus Forget).
  int64_t compact_places_reserved() const { return static_cast<int64_t>(reserved_.size()); }

  // Rows sampled from candidates vs rows whose full logits crossed to the host, since creation.
  struct SamplingCounters {
    int64_t candidate_rows = 0;
    int64_t full_rows = 0;
  };
  const SamplingCounters& sampling_counters() const { return sampling_counters_; }
  // Requests admitted to the window (their resident rows and page bounds gathered and uploaded)
  // and the wall time that took, since creation.
  struct AdmissionCounters {
    int64_t requests = 0;
    double seconds = 0;
  };
  const AdmissionCounters& admission_counters() const { return admission_counters_; }
  // The most candidates a row may ask for (default and ceiling CandidateOps::kMaxCandidates);
  // lower it to make rows fall back to full logits (tests).
  void set_max_candidates(int64_t n) { max_candidates_ = n; }

  // The dense halves (and the weights in the DenseOps's memory), e.g. to run the same model with
  // another attention in the same run (the HBM-resident reference of `fluxion bench decode`).
  model::DecodeStepRunner& runner();
  model::DenseOps& ops();

  // Whether requests admitted from now on have their blocks scored by the window (when their
  // policy ranks page bounds and the window keeps metadata); default true. False: the CPU scans
  // the bounds, e.g. to measure both in one run.
  void set_window_block_scores(bool on) { window_block_scores_ = on; }
  // The share of every (request, KV head)'s host rows the device reads itself from pinned host
  // pages, while the CPU reads the rest (HybridBatchAttention::set_device_read_share); 0 (the
  // default): the CPU reads all.
  void set_device_read_share(double share) { attention_->set_device_read_share(share); }
  // The lane the attention's CPU phase takes (HybridBatchAttention::set_cpu_lane; must outlive
  // this); null (the default): none. The ping-pong executor's two pipelines share one.
  // Admissions inside a step take it too.
  void set_cpu_lane(CpuLane* lane) { attention_->set_cpu_lane(lane); }

  // Rows attended resident vs on the host, and the CPU phases' times, since the last reset.
  const HybridCounters& counters() const { return attention_->counters(); }
  void ResetCounters();

  // Dynamic degradation (decode/step/stall_guard.h): after every step the guard compares the CPU
  // phase with the waits for the device and sets the share of their middle budget the next
  // step's policies spend. Disabled (the default): always 1. REQUIRES: options validated.
  void set_stall_guard(const StallGuardOptions& options);
  const StallGuard& stall_guard() const { return guard_; }

 private:
  struct State;
  explicit HybridStepExecutor(std::unique_ptr<State> state);
  // The request's window slot, admitting it now if it holds none.
  absl::StatusOr<int> SlotOf(const SparseAttention& attention);
  // Whether the request selects from compact keys the window can keep for it.
  bool WantsCompactKeys(const SparseAttention& attention) const;
  // The block size the window scores the request's blocks at (0: none), or FailedPrecondition
  // when its policy attends fewer sinks or local tokens than the window holds.
  absl::StatusOr<int64_t> ScoreBlockOf(const SparseAttention& attention) const;
  // Step (tokens null: every row's logits to the host) or StepAndSample.
  void Run(absl::Span<const StepRequest> batch, std::vector<int32_t>* tokens,
           std::vector<float>* logits, std::vector<absl::Status>* statuses);
  // StepAndSample's end: rows r of the step (batch index rows[r]) from the logits the runner
  // left in the DenseOps's memory. Errors: the DenseOps's.
  absl::Status DrawTokens(absl::Span<const StepRequest> batch, std::vector<int32_t>* tokens,
                          std::vector<float>* logits);

  std::unique_ptr<State> state_;
  HybridBatchAttention* attention_;  // owned by state_
  bool window_block_scores_ = true;
  SamplingCounters sampling_counters_;
  AdmissionCounters admission_counters_;
  absl::flat_hash_set<uint64_t> reserved_;  // requests holding a device-selection place
  int64_t max_candidates_ = model::CandidateOps::kMaxCandidates;
  // The step's phase times feed the guard: the counters when it last looked.
  void ObserveStall();
  StallGuard guard_{StallGuardOptions{}};
  HybridCounters since_guard_;
};

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_STEP_HYBRID_STEP_EXECUTOR_H_

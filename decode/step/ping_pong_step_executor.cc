#include "decode/step/ping_pong_step_executor.h"

#include <algorithm>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"

namespace fluxion::decode {

// A persistent thread that runs its one job (stepping its micro-batch) whenever the scheduler
// thread asks: Start hands the thread the job, Wait returns once it has run. No thread is made
// and nothing is allocated per step.
class PingPongStepExecutor::Driver {
 public:
  // `job` gets the status of `init` (run first on the thread; null: OK).
  Driver(std::function<absl::Status()> init, std::function<void(const absl::Status&)> job)
      : init_(std::move(init)), job_(std::move(job)), thread_([this] { Loop(); }) {}
  ~Driver() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
  }
  Driver(const Driver&) = delete;
  Driver& operator=(const Driver&) = delete;

  // REQUIRES: the last Start has been waited for.
  void Start() {
    absl::MutexLock lock(&mu_);
    pending_ = true;
  }
  void Wait() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &Driver::Idle));
  }

 private:
  void Loop() {
    const absl::Status init = init_ ? init_() : absl::OkStatus();
    for (;;) {
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(this, &Driver::PendingOrStopping));
        if (!pending_) return;  // stopping, and nothing left to run
      }
      job_(init);
      absl::MutexLock lock(&mu_);
      pending_ = false;
    }
  }
  bool Idle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !pending_; }
  bool PendingOrStopping() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return pending_ || stop_;
  }

  const std::function<absl::Status()> init_;
  const std::function<void(const absl::Status&)> job_;
  absl::Mutex mu_;
  bool pending_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: it starts once every other member is built
};

absl::StatusOr<std::unique_ptr<PingPongStepExecutor>> PingPongStepExecutor::Create(
    const model::Model* model, Pipeline a, Pipeline b, const kernels::cpu::CpuPool* pool,
    Options options) {
  if (a.ops == nullptr || b.ops == nullptr || a.window == nullptr || b.window == nullptr) {
    return absl::InvalidArgumentError("a ping-pong pipeline lacks its DenseOps or its window");
  }
  FLUXION_ASSIGN_OR_RETURN(model::ModelParams params, model->UploadParams(*a.ops));
  return Create(model->config(), std::move(params), std::move(a), std::move(b), pool,
                std::move(options));
}

absl::StatusOr<std::unique_ptr<PingPongStepExecutor>> PingPongStepExecutor::Create(
    const model::ModelConfig& config, model::ModelParams params, Pipeline a, Pipeline b,
    const kernels::cpu::CpuPool* pool, Options options) {
  if (a.ops == nullptr || b.ops == nullptr || a.window == nullptr || b.window == nullptr) {
    return absl::InvalidArgumentError("a ping-pong pipeline lacks its DenseOps or its window");
  }
  if (!b.ops->CanUseWeightsOf(*a.ops)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the second micro-batch's DenseOps (", b.ops->name(), ") cannot read the weights of the "
        "first's (", a.ops->name(), "): ping-pong needs two DenseOps of one backend on one "
        "device"));
  }
  // Stacked on A before B borrows them: stacking frees the separate copies (layer.h), and a
  // borrower never writes the weights. FuseParams ends with a Sync, so the uploads are done.
  FLUXION_RETURN_IF_ERROR(model::FuseParams(*a.ops, &params));
  FLUXION_RETURN_IF_ERROR(a.ops->Sync());
  model::ModelParams borrowed = model::BorrowParams(params);
  FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<HybridStepExecutor> first,
                           HybridStepExecutor::Create(config, std::move(a.ops), std::move(params),
                                                      std::move(a.window), pool));
  FLUXION_ASSIGN_OR_RETURN(
      std::unique_ptr<HybridStepExecutor> second,
      HybridStepExecutor::Create(config, std::move(b.ops), std::move(borrowed),
                                 std::move(b.window), pool));
  return std::unique_ptr<PingPongStepExecutor>(
      new PingPongStepExecutor(config.vocab_size, std::make_unique<CpuLane>(),
                               std::move(first), std::move(second), options));
}

PingPongStepExecutor::PingPongStepExecutor(int64_t vocab, std::unique_ptr<CpuLane> lane,
                                           std::unique_ptr<HybridStepExecutor> a,
                                           std::unique_ptr<HybridStepExecutor> b,
                                           const Options& options)
    : vocab_(vocab), lane_(std::move(lane)), pipelines_{std::move(a), std::move(b)} {
  for (int h = 0; h < 2; ++h) {
    pipelines_[h]->set_cpu_lane(lane_.get());
    drivers_[h] = std::make_unique<Driver>(
        options.thread_init, [this, h](const absl::Status& init) { RunPart(h, init); });
  }
}

PingPongStepExecutor::~PingPongStepExecutor() = default;

int64_t PingPongStepExecutor::max_batch() const {
  return pipelines_[0]->max_batch() + pipelines_[1]->max_batch();
}

int PingPongStepExecutor::MicroBatchOf(uint64_t id) const {
  const auto it = half_of_.find(id);
  return it == half_of_.end() ? -1 : it->second;
}

int PingPongStepExecutor::ChooseHalf() const {
  const int h = held_[0] <= held_[1] ? 0 : 1;
  if (held_[h] < pipelines_[h]->max_batch()) return h;
  if (held_[1 - h] < pipelines_[1 - h]->max_batch()) return 1 - h;
  return -1;
}

void PingPongStepExecutor::Step(absl::Span<const StepRequest> batch, std::vector<float>* logits,
                                std::vector<absl::Status>* statuses) {
  Run(batch, /*tokens=*/nullptr, logits, statuses);
}

void PingPongStepExecutor::StepAndSample(absl::Span<const StepRequest> batch,
                                         std::vector<int32_t>* tokens, std::vector<float>* logits,
                                         std::vector<absl::Status>* statuses) {
  Run(batch, tokens, logits, statuses);
}

void PingPongStepExecutor::Run(absl::Span<const StepRequest> batch, std::vector<int32_t>* tokens,
                               std::vector<float>* logits, std::vector<absl::Status>* statuses) {
  sampling_ = tokens != nullptr;
  if (sampling_) tokens->assign(batch.size(), -1);
  statuses->assign(batch.size(), absl::OkStatus());
  logits->resize(batch.size() * vocab_);
  // Requests that left since the last step leave their micro-batch (its pipeline gives their
  // slots back at its next step).
  present_.clear();
  for (const StepRequest& r : batch) present_.insert(r.attention->id());
  for (auto it = half_of_.begin(); it != half_of_.end();) {
    if (!present_.contains(it->first)) {
      --held_[it->second];
      half_of_.erase(it++);
    } else {
      ++it;
    }
  }
  for (Part& p : parts_) {
    p.batch.clear();
    p.rows.clear();
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    auto [it, joined] = half_of_.try_emplace(batch[i].attention->id(), -1);
    if (joined) {
      const int h = ChooseHalf();
      if (h < 0) {
        half_of_.erase(it);
        (*statuses)[i] = absl::ResourceExhaustedError(absl::StrCat(
            "both micro-batches' windows are full (", max_batch(), " requests)"));
        continue;
      }
      it->second = h;
      ++held_[h];
    }
    parts_[it->second].batch.push_back(batch[i]);
    parts_[it->second].rows.push_back(i);
  }
  // An empty half only gives its departed requests' slots back (bookkeeping, no device work),
  // here; the others step on their drivers at once.
  for (int h = 0; h < 2; ++h) {
    Part& p = parts_[h];
    if (p.batch.empty()) pipelines_[h]->Step({}, &p.logits, &p.statuses);
  }
  // The drivers' CPU phases come back to this thread (cpu_lane.h says why), which serves them
  // until both have left.
  int parts = 0;
  for (const Part& p : parts_) parts += p.batch.empty() ? 0 : 1;
  lane_->Open(parts);
  for (int h = 0; h < 2; ++h) {
    if (!parts_[h].batch.empty()) drivers_[h]->Start();
  }
  lane_->Serve();
  for (int h = 0; h < 2; ++h) {
    if (!parts_[h].batch.empty()) drivers_[h]->Wait();
  }
  for (const Part& p : parts_) {
    for (size_t r = 0; r < p.rows.size(); ++r) {
      const size_t i = p.rows[r];
      (*statuses)[i] = p.statuses[r];
      if (!p.statuses[r].ok()) continue;
      if (sampling_) (*tokens)[i] = p.tokens[r];
      // When sampling, only rows without a sampler are promised (StepExecutor::StepAndSample).
      if (!sampling_ || p.batch[r].sampler == nullptr) {
        std::copy(p.logits.begin() + r * vocab_, p.logits.begin() + (r + 1) * vocab_,
                  logits->begin() + i * vocab_);
      }
    }
  }
}

void PingPongStepExecutor::RunPart(int h, const absl::Status& init) {
  absl::Cleanup leave_lane = [this] { lane_->Leave(); };
  Part& p = parts_[h];
  if (!init.ok()) {
    p.statuses.assign(p.batch.size(),
                      absl::Status(init.code(), absl::StrCat("micro-batch ", h,
                                                             "'s driver thread: ",
                                                             init.message())));
    return;
  }
  if (sampling_) {
    // Each half samples where its logits are (its DenseOps): only candidates cross.
    pipelines_[h]->StepAndSample(p.batch, &p.tokens, &p.logits, &p.statuses);
  } else {
    pipelines_[h]->Step(p.batch, &p.logits, &p.statuses);
  }
}

void PingPongStepExecutor::set_window_block_scores(bool on) {
  for (auto& p : pipelines_) p->set_window_block_scores(on);
}

void PingPongStepExecutor::set_device_read_share(double share) {
  for (auto& p : pipelines_) p->set_device_read_share(share);
}

HybridCounters PingPongStepExecutor::counters() const {
  HybridCounters sum;
  for (const auto& p : pipelines_) AddCounters(p->counters(), &sum);
  return sum;
}

void PingPongStepExecutor::ResetCounters() {
  for (auto& p : pipelines_) p->ResetCounters();
}

}  // namespace fluxion::decode

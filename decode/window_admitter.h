// Admits requests into a ResidentWindow on a thread of its own, so that the steps of the requests
// already decoding do not wait while a newcomer's resident rows and page bounds are gathered and
// uploaded. Inside a step that admission froze every other request of the batch: ~0.13 s for a
// 128K-token request at 8B shapes (bench/results/decode-admit-8b-128k-h200-20261202.json).
//
// The hybrid executor starts an admission when the scheduler says a request will join
// (StepExecutor::Prepare) and lets the request into a step once it is done; a request that ends
// first is cancelled (its slot, if it got one, released). Admissions run one at a time, in the
// order started.
//
// The caller keeps the PagedKv of a started admission alive and unchanged until Take or Cancel
// returns for it. Thread-safe; the destructor waits for the admission in progress, drops the
// queued ones and releases every slot not taken.
#ifndef FLUXION_DECODE_WINDOW_ADMITTER_H_
#define FLUXION_DECODE_WINDOW_ADMITTER_H_

#include <cstdint>
#include <deque>
#include <optional>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "decode/paged_kv.h"
#include "decode/resident_window.h"

namespace fluxion::decode {

class WindowAdmitter {
 public:
  // `window` must outlive the admitter. Each admission's host work runs on `threads` plain
  // threads (ResidentWindow::AdmitThreads: never an OpenMP team beside the step's).
  WindowAdmitter(ResidentWindow* window, int threads);
  ~WindowAdmitter();
  WindowAdmitter(const WindowAdmitter&) = delete;
  WindowAdmitter& operator=(const WindowAdmitter&) = delete;

  // Queues the admission of `kv` under `id` (ResidentWindow::Admit's arguments). A no-op for an
  // id already started and not yet taken or cancelled.
  void Start(uint64_t id, const PagedKv* kv, int64_t score_block_tokens);
  // Whether id's admission has finished (true for an id not started: nothing to wait for).
  bool Done(uint64_t id) const;
  // What an admission gave: Admit's slot or error, and the wall time Admit took.
  struct Result {
    absl::StatusOr<int> slot;
    double seconds = 0;
  };
  // Waits for id's admission and hands its result over (the slot is then the caller's);
  // nullopt for an id not started.
  std::optional<Result> Take(uint64_t id);
  // Drops id's admission: removed from the queue, or waited for and its slot released.
  void Cancel(uint64_t id);

 private:
  struct Job {
    const PagedKv* kv = nullptr;
    int64_t score_block_tokens = 0;
    bool done = false;
    Result result;
  };
  void Loop();

  ResidentWindow* const window_;
  const int threads_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Job> jobs_ ABSL_GUARDED_BY(mu_);
  std::deque<uint64_t> queue_ ABSL_GUARDED_BY(mu_);  // started, not yet running
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_WINDOW_ADMITTER_H_

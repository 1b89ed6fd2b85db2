// The load driver of `fluxion replay`: sends a schedule's requests to any server of the
// fluxion.v1 DecodeService (a router or a decode node) on time, or at a fixed concurrency, and
// records what each stream did (cluster/replay_stats.h).
//
// Requests run on gRPC's callback API (one reactor per request, no thread per request), so
// thousands may be in flight; the dispatching thread only sleeps until the next arrival.
//
// Thread-safety: Run() is called from one thread; Interrupt() may be called from any thread or a
// signal handler.
#ifndef FLUXION_CLUSTER_REPLAYER_H_
#define FLUXION_CLUSTER_REPLAYER_H_

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cluster/replay_stats.h"
#include "cluster/trace.h"
#include "common/grpc_transport.h"

namespace fluxion::cluster {

// Limits on ReplayOptions (docs/REPLAY.md, "Limits"); the trace limits are in cluster/trace.h.
inline constexpr uint32_t kMaxReplayVocabSize = uint32_t{1} << 24;  // = model::kMaxVocabSize
inline constexpr int64_t kMaxReplayInflight = 100000;  // one reactor and one prompt each
inline constexpr double kMaxReplayTimeoutS = 7 * 24 * 3600.0;

struct ReplayOptions {
  std::string target;            // "host:port" of the router or decode node
  int64_t concurrency = 0;       // > 0: keep this many in flight, ignoring arrival times
  int64_t max_inflight = 0;      // > 0 (timed mode): delay arrivals while this many are open
  double timeout_s = 600;        // per request: gRPC deadline and GenerateRequest.timeout_ms
  uint32_t vocab_size = 32000;   // prompt token ids are drawn from [1, vocab_size)
  std::optional<float> temperature = 0.0f;
  std::string sparse_policy;     // empty: the server's default
  std::optional<float> sparse_budget;
  std::string request_id_prefix = "replay";
  bool progress = true;          // live progress line on stderr
  double connect_timeout_s = 10; // wait this long for the target to accept connections
  // Cancel this fraction of requests (chosen with cancel_seed) cancel_after_s after sending them,
  // as a client that gives up would (aiperf's request cancellation). Such requests are reported
  // as cancelled on purpose, not as failures.
  double cancel_fraction = 0;
  double cancel_after_s = 0;
  uint64_t cancel_seed = 1;
  // Keep every answer's token ids in its record (RequestRecord::output_ids).
  bool keep_output_ids = false;
  serving::ChannelConfig channel;  // TLS and keepalive of the channel to `target`
};

// INVALID_ARGUMENT naming the flag (--vocab-size, --timeout-s, ...) of a value outside its range.
absl::Status ValidateReplayOptions(const ReplayOptions& options);

class Replayer {
 public:
  explicit Replayer(ReplayOptions options) : options_(std::move(options)) {}

  // Sends every request of `schedule` and waits for all of them. INVALID_ARGUMENT if
  // ValidateReplayOptions fails (before connecting). UNAVAILABLE if the target does
  // not accept a connection within connect_timeout_s. After Interrupt(), stops sending, cancels the
  // requests in flight and returns the records so far (cancelled ones with status CANCELLED).
  absl::StatusOr<std::vector<RequestRecord>> Run(const Schedule& schedule);

  void Interrupt() { interrupted_.store(true); }

 private:
  ReplayOptions options_;
  std::atomic<bool> interrupted_{false};
};

}  // namespace fluxion::cluster

#endif  // FLUXION_CLUSTER_REPLAYER_H_

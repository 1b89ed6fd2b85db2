// Request schedules for `fluxion replay`: Mooncake JSONL traces and synthetic load, the transforms
// that fit them to a machine (time scale, length scale/caps, sub-sampling), and deterministic prompt
// construction from Mooncake `hash_ids`. docs/REPLAY.md describes the semantics.
//
// Thread-compatible: plain values and pure functions.
#ifndef FLUXION_CLUSTER_TRACE_H_
#define FLUXION_CLUSTER_TRACE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace fluxion::cluster {

// Mooncake's block size: one hash id names 512 prompt tokens.
inline constexpr int64_t kMooncakeBlockTokens = 512;

// Input limits (docs/REPLAY.md, "Limits"). Everything read from a trace or the command line is
// checked against them before anything is allocated, so a typo or a hostile trace gives
// INVALID_ARGUMENT naming the flag or the trace line and field, never bad_alloc, a division by
// zero or a run that never ends. Each is far above what a replay on one machine can use: the
// Mooncake traces' longest prompt is ~128k tokens and they hold ~24k requests.
inline constexpr int64_t kMaxReplayTokens = int64_t{1} << 20;  // input or output length
inline constexpr int64_t kMaxReplayRequests = 1000000;          // requests in one schedule
inline constexpr size_t kMaxTraceLineBytes = size_t{1} << 20;   // one JSONL record
inline constexpr double kMaxReplayArrivalS = 1e8;               // ~3 years, after --time-scale
inline constexpr double kMaxReplayScale = 1e6;                  // --time-scale, --length-scale
inline constexpr int kMaxTraceJsonDepth = 8;                    // a record nests 2 deep

// One request of a schedule.
struct TraceRequest {
  double arrival_s = 0;          // seconds from the start of the run
  int64_t input_tokens = 0;      // prompt length
  int64_t output_tokens = 0;     // completion tokens to ask for (max_tokens, EOS ignored)
  std::vector<uint64_t> hash_ids;  // prefix blocks; equal ids mean equal prompt content
  int64_t source_index = 0;      // line (trace) or draw (synthetic) this request came from
};

// A schedule and the block size its hash ids refer to.
struct Schedule {
  std::vector<TraceRequest> requests;  // sorted by arrival_s
  int64_t block_tokens = kMooncakeBlockTokens;
};

// Reads a Mooncake trace: one JSON object per line with `timestamp` (ms), `input_length`,
// `output_length` and optional `hash_ids`. Blank lines are skipped. INVALID_ARGUMENT names the
// line and field of the first malformed record (and of the first value outside the limits
// above); NOT_FOUND if the file cannot be opened.
absl::StatusOr<Schedule> LoadMooncakeTrace(const std::string& path);

// One trace record. `where` ("trace.jsonl:12") prefixes errors. For LoadMooncakeTrace and the
// fuzz target.
absl::StatusOr<TraceRequest> ParseMooncakeRecord(absl::string_view line, absl::string_view where);

// A length distribution, parsed from "fixed:N", "uniform:MIN:MAX", "normal:MEAN:STD" or
// "exponential:MEAN". N, MIN, MAX and MEAN are in [1, kMaxReplayTokens], STD in [0, that];
// samples are rounded and clamped to [1, kMaxReplayTokens].
struct LengthDistribution {
  enum class Kind { kFixed, kUniform, kNormal, kExponential };
  Kind kind = Kind::kFixed;
  double a = 1, b = 0;
  std::string text;  // as given, for reports
};
absl::StatusOr<LengthDistribution> ParseLengthDistribution(const std::string& text);

struct SyntheticOptions {
  int64_t num_requests = 100;
  double rate = 0;  // Poisson arrivals per second; 0: all at time 0 (use with concurrency)
  LengthDistribution input;
  LengthDistribution output;
  uint64_t seed = 1;
  // > 0: every request is one of this many prompts (each with its own drawn lengths), picked
  // uniformly, so answers to the same prompt can be compared (cluster/replay_integrity.h);
  // 0: every request has a prompt of its own.
  int64_t distinct_prompts = 0;
};
// INVALID_ARGUMENT naming the flag (--num-requests, --rate, --distinct-prompts) outside the
// limits above.
absl::Status ValidateSyntheticOptions(const SyntheticOptions& options);
// Poisson arrivals (exponential gaps), lengths drawn independently; prompts share no prefix.
// With distinct_prompts = N > 0, the N prompts' lengths are drawn first and each request takes
// one of them; its source_index is then the prompt's number in [0, N), which is what BuildPrompt
// derives the tokens from, so requests with equal source_index send equal prompts.
// REQUIRES: ValidateSyntheticOptions(options) is OK.
Schedule MakeSyntheticSchedule(const SyntheticOptions& options);

// Changes that fit a schedule to the machine. Each is reported (TransformReport) with the run.
struct TraceTransform {
  double time_scale = 1.0;      // multiplies arrival times: 10 replays 10x slower
  double length_scale = 1.0;    // multiplies input/output lengths and the block size
  int64_t max_input_tokens = 0;   // 0: no cap; longer prompts are truncated (prefix kept)
  int64_t max_output_tokens = 0;  // 0: no cap
  double sample_fraction = 1.0;   // keep each request with this probability (seeded)
  int64_t max_requests = 0;       // 0: all; else the first N kept requests
  double start_s = 0;             // drop requests before this trace time; times re-based to it
  double duration_s = 0;          // 0: all; else drop requests after start_s + duration_s
  uint64_t seed = 1;
};

struct TransformReport {
  int64_t requests_in = 0;
  int64_t requests_out = 0;
  int64_t inputs_capped = 0;
  int64_t outputs_capped = 0;
  double span_in_s = 0;   // last arrival - first arrival, before
  double span_out_s = 0;  // after
};

// INVALID_ARGUMENT naming the flag for a value outside its range: scales in (0, kMaxReplayScale],
// a fraction outside (0, 1], negative or non-finite times, caps and counts outside the limits.
absl::Status ValidateTraceTransform(const TraceTransform& transform);

// Applies `transform` in this order: window (start/duration), sub-sample, max_requests, length
// scale, caps, time scale. INVALID_ARGUMENT if ValidateTraceTransform fails, or naming the
// request (trace line or synthetic draw) whose scaled length exceeds kMaxReplayTokens after the
// caps or whose scaled arrival exceeds kMaxReplayArrivalS: nothing is silently clamped.
absl::StatusOr<Schedule> ApplyTransform(const Schedule& schedule, const TraceTransform& transform,
                                        TransformReport* report);

// The prompt of `request`: block j (< hash_ids.size()) is `block_tokens` tokens derived only from
// hash_ids[j], so requests sharing ids share those prefix tokens; tokens past the named blocks are
// unique to the request. Truncated to input_tokens. Ids are in [1, vocab_size).
// REQUIRES: vocab_size >= 2, block_tokens >= 1.
std::vector<uint32_t> BuildPrompt(const TraceRequest& request, int64_t block_tokens,
                                  uint32_t vocab_size);

}  // namespace fluxion::cluster

#endif  // FLUXION_CLUSTER_TRACE_H_

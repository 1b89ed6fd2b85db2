// libFuzzer target: one Mooncake trace line -> ParseMooncakeRecord, and an accepted record through
// ApplyTransform and BuildPrompt (bounded by kMaxReplayTokens). docs/FUZZING.md.
#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"
#include "cluster/trace.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fluxion::cluster;
  const absl::string_view line(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<TraceRequest> record = ParseMooncakeRecord(line, "fuzz:1");
  if (!record.ok()) return 0;
  Schedule schedule;
  schedule.requests.push_back(*record);
  TraceTransform transform;
  transform.length_scale = 0.5;
  transform.max_input_tokens = 4096;  // keeps each run fast; the limits are tested in trace_test
  absl::StatusOr<Schedule> fitted = ApplyTransform(schedule, transform, nullptr);
  if (!fitted.ok()) return 0;
  for (const TraceRequest& r : fitted->requests) {
    if (r.input_tokens < 1 || r.input_tokens > kMaxReplayTokens) __builtin_trap();
    if (BuildPrompt(r, fitted->block_tokens, 256).size() != static_cast<size_t>(r.input_tokens)) {
      __builtin_trap();
    }
  }
  return 0;
}

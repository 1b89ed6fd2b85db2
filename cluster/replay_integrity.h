// The answer check of `fluxion replay --distinct-prompts N`: with greedy sampling, every answer to
// the same prompt and max_tokens must be the same tokens, however the requests were batched,
// routed or interleaved with failures. A difference means one request's output was touched by
// something that was not its own computation: KV pages reused while a peer still wrote them, a
// sparse state or a sampler slot of another request, a stream that mixed two requests -- the
// corruption users of other disaggregated stacks report after long uptimes (docs/REPLAY.md,
// "Answer check"). The soak (tools/soak.sh) fails on any difference.
//
// Why it can be exact: the decode step computes each request's rows on their own (the batched
// step is bit-identical to a batch of one; docs/EXECUTOR.md), and the cluster fault suite already
// relies on the same property with the `full` policy.
//
// Thread-compatible: pure functions.
#ifndef FLUXION_CLUSTER_REPLAY_INTEGRITY_H_
#define FLUXION_CLUSTER_REPLAY_INTEGRITY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "cluster/replay_stats.h"
#include "cluster/trace.h"
#include "nlohmann/json.hpp"

namespace fluxion::cluster {

struct AnswerCheck {
  int64_t prompts = 0;           // (prompt, max_tokens) pairs answered in full at least twice
  int64_t answers_compared = 0;  // answers compared with their pair's first complete answer
  int64_t mismatched = 0;        // of those, answers that differed
  // Up to kMaxAnswerCheckExamples, e.g. "replay-40 differs from replay-3 (same prompt) at
  // token 5 of 12: 17 vs 99".
  std::vector<std::string> examples;
};
inline constexpr int kMaxAnswerCheckExamples = 5;

// Compares the answers of the successful requests of `records` (whose `index` is their position
// in `schedule`; records without output ids, failed or cancelled ones are skipped) that share
// their prompt (BuildPrompt with `vocab_size`) and requested length. The first successful answer
// of each pair in schedule order is the reference.
AnswerCheck CheckRepeatedAnswers(const Schedule& schedule, const std::vector<RequestRecord>& records,
                                 uint32_t vocab_size);

nlohmann::json AnswerCheckToJson(const AnswerCheck& check);
// "answers: 812 compared over 64 prompts, 0 differed" and the examples, one per line.
std::string FormatAnswerCheck(const AnswerCheck& check);

}  // namespace fluxion::cluster

#endif  // FLUXION_CLUSTER_REPLAY_INTEGRITY_H_

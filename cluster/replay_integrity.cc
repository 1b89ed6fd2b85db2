#include "cluster/replay_integrity.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"

namespace fluxion::cluster {
namespace {

// A request's identity for the check: its prompt's tokens and the tokens it asked for.
using AnswerKey = std::pair<std::vector<uint32_t>, int64_t>;

struct Reference {
  const RequestRecord* record = nullptr;
  int64_t answers = 0;  // complete answers seen, the reference included
};

std::string DescribeDifference(const RequestRecord& answer, const RequestRecord& reference) {
  const std::vector<uint32_t>& a = answer.output_ids;
  const std::vector<uint32_t>& b = reference.output_ids;
  const size_t common = std::min(a.size(), b.size());
  size_t at = 0;
  while (at < common && a[at] == b[at]) ++at;
  std::string what = at < common ? absl::StrCat(a[at], " vs ", b[at])
                                 : absl::StrCat(a.size(), " tokens vs ", b.size());
  return absl::StrCat(answer.request_id, " differs from ", reference.request_id,
                      " (same prompt) at token ", at, " of ", b.size(), ": ", what);
}

}  // namespace

AnswerCheck CheckRepeatedAnswers(const Schedule& schedule, const std::vector<RequestRecord>& records,
                                 uint32_t vocab_size) {
  std::vector<const RequestRecord*> ordered;
  for (const RequestRecord& r : records) {
    const bool in_schedule =
        r.index >= 0 && r.index < static_cast<int64_t>(schedule.requests.size());
    if (in_schedule && r.ok() && !r.cancelled_by_client && !r.output_ids.empty()) {
      ordered.push_back(&r);
    }
  }
  std::sort(ordered.begin(), ordered.end(),
            [](const RequestRecord* a, const RequestRecord* b) { return a->index < b->index; });
  AnswerCheck check;
  std::map<AnswerKey, Reference> references;
  for (const RequestRecord* r : ordered) {
    const TraceRequest& request = schedule.requests[r->index];
    AnswerKey key{BuildPrompt(request, schedule.block_tokens, vocab_size), request.output_tokens};
    Reference& ref = references[std::move(key)];
    if (++ref.answers == 1) {
      ref.record = r;
      continue;
    }
    if (ref.answers == 2) ++check.prompts;
    ++check.answers_compared;
    if (r->output_ids != ref.record->output_ids) {
      ++check.mismatched;
      if (static_cast<int>(check.examples.size()) < kMaxAnswerCheckExamples) {
        check.examples.push_back(DescribeDifference(*r, *ref.record));
      }
    }
  }
  return check;
}

nlohmann::json AnswerCheckToJson(const AnswerCheck& check) {
  return {{"prompts", check.prompts},
          {"answers_compared", check.answers_compared},
          {"mismatched", check.mismatched},
          {"examples", check.examples}};
}

std::string FormatAnswerCheck(const AnswerCheck& check) {
  std::string out = absl::StrCat("answers: ", check.answers_compared, " compared over ",
                                 check.prompts, " prompts, ", check.mismatched, " differed\n");
  for (const std::string& e : check.examples) absl::StrAppend(&out, "  ", e, "\n");
  return out;
}

}  // namespace fluxion::cluster

#include "model/stream_detokenizer.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace fluxion::model {

absl::StatusOr<StreamDetokenizer> StreamDetokenizer::Create(const Tokenizer* tokenizer,
                                                            StreamDetokenizerOptions options) {
  if (options.stop.size() > kMaxStopStrings) {
    return absl::InvalidArgumentError(
        absl::StrCat(options.stop.size(), " stop strings, above the limit of ", kMaxStopStrings));
  }
  for (size_t i = 0; i < options.stop.size(); ++i) {
    const std::string& stop = options.stop[i];
    if (stop.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("stop[", i, "] is empty"));
    }
    if (stop.size() > kMaxStopStringBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stop[", i, "] has ", stop.size(), " bytes, above the limit of ", kMaxStopStringBytes));
    }
    if (!IsValidUtf8(stop)) {
      return absl::InvalidArgumentError(absl::StrCat("stop[", i, "] is not valid UTF-8"));
    }
  }
  return StreamDetokenizer(tokenizer, std::move(options));
}

std::string StreamDetokenizer::Add(int32_t id) {
  if (stopped()) return "";
  tokenizer_->AppendTokenBytes(id, options_.skip_special, &bytes_);
  const size_t used = AppendUtf8Lossy(bytes_, /*final=*/false, &pending_);
  bytes_.erase(0, used);
  return Release(/*final=*/false);
}

std::string StreamDetokenizer::Finish() {
  if (stopped()) return "";
  AppendUtf8Lossy(bytes_, /*final=*/true, &pending_);
  bytes_.clear();
  return Release(/*final=*/true);
}

std::string StreamDetokenizer::Release(bool final) {
  // The stop string that ends first in the text; of those ending at the same byte, the longest
  // (it starts earliest). Ending first, not starting first, is what makes the result independent
  // of how the text was split into tokens: a stop string that starts earlier but ends later may
  // not have arrived yet when the first one completes.
  size_t best_end = std::string::npos;
  size_t best = std::string::npos;
  const std::string* best_stop = nullptr;
  for (const std::string& stop : options_.stop) {
    const size_t at = pending_.find(stop);
    if (at == std::string::npos) continue;
    const size_t end = at + stop.size();
    if (end < best_end || (end == best_end && at < best)) {
      best_end = end;
      best = at;
      best_stop = &stop;
    }
  }
  std::string out;
  if (best_stop != nullptr) {
    matched_stop_ = *best_stop;
    out = pending_.substr(0, best);
    pending_.clear();
    bytes_.clear();
    return out;
  }
  // Hold back the longest suffix that is a proper prefix of some stop string: a stop string
  // starting earlier would already have been found above, so everything before it is final.
  size_t hold = 0;
  if (!final) {
    for (const std::string& stop : options_.stop) {
      const size_t longest = std::min(stop.size() - 1, pending_.size());
      for (size_t n = longest; n > hold; --n) {
        if (absl::string_view(pending_).substr(pending_.size() - n) ==
            absl::string_view(stop).substr(0, n)) {
          hold = n;
          break;
        }
      }
    }
  }
  out = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return out;
}

}  // namespace fluxion::model

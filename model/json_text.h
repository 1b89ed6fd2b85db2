// Parsing untrusted JSON text (config.json, safetensors headers and indexes, tokenizer.json) into
// nlohmann::json without exceptions. nlohmann reports syntax errors only through exceptions or a
// SAX handler and silently keeps the last of duplicate keys, so a SAX pre-scan runs over the text
// before the DOM parse: it recovers the reason for a syntax error, optionally catches a
// top-level key given twice, and stops past `max_depth` levels, because nlohmann's dump() and
// comparisons recurse once per level and a value nested 100,000 deep would overflow the stack.
//
// Thread-safe: a pure function.
#ifndef FLUXION_MODEL_JSON_TEXT_H_
#define FLUXION_MODEL_JSON_TEXT_H_

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace fluxion::model {

struct JsonTextOptions {
  int max_depth = 64;
  bool reject_duplicate_top_level_keys = false;
};

// The parsed document. InvalidArgument, naming `what`: "<what> is not valid JSON: <reason>"
// (syntax, or nested deeper than max_depth), "<what> names '<key>' twice" (with
// reject_duplicate_top_level_keys).
absl::StatusOr<nlohmann::json> ParseJsonText(absl::string_view text, absl::string_view what,
                                             const JsonTextOptions& options);

// The whole file at `path` (the JSON files above, read before parsing): NotFound when it does not
// exist, InvalidArgument past `limit` bytes (checked while reading, not from fstat, so a growing
// file or a pipe is bounded too), the errno's status for other failures; messages name the path.
absl::StatusOr<std::string> ReadFileBounded(const std::string& path, size_t limit);

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_JSON_TEXT_H_

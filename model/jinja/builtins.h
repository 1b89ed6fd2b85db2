// Jinja's filters, tests and operators and the Python methods templates call on strings, lists
// and dicts, over value.h's values (used by render.cc). Errors are InvalidArgument saying what.
#ifndef FLUXION_MODEL_JINJA_BUILTINS_H_
#define FLUXION_MODEL_JINJA_BUILTINS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/jinja/value.h"

namespace fluxion::model::jinja {

absl::StatusOr<Value> ApplyFilter(const std::string& name, const Value& subject,
                                  const Arguments& args);
absl::StatusOr<bool> ApplyTest(const std::string& name, const Value& subject,
                               const Arguments& args);
// `object.name(args)` for a string, list or dict.
absl::StatusOr<Value> CallMethod(const Value& object, const std::string& name,
                                 const Arguments& args);
// + - * / // % ** ~ == != < > <= >= in, "not in".
absl::StatusOr<Value> BinaryOp(const std::string& op, const Value& l, const Value& r);
// object[start:stop:step] of a list or string (by characters), Python's rules.
absl::StatusOr<Value> Slice(const Value& object, std::optional<int64_t> start,
                            std::optional<int64_t> stop, std::optional<int64_t> step, int line);
// The UTF-8 characters of `s` (a byte that starts none stands alone).
std::vector<std::string> Utf8Characters(const std::string& s);

}  // namespace fluxion::model::jinja

#endif  // FLUXION_MODEL_JINJA_BUILTINS_H_

// A Jinja2 interpreter for Hugging Face chat templates (docs/CHAT.md): the subset real templates
// use, with the environment transformers renders them in (trim_blocks, lstrip_blocks, loop
// controls, `raise_exception`, `strftime_now`, a `tojson` that writes Python's json.dumps).
//
// Python semantics where templates rely on them: truth values, `==` across int and float, string
// and list slicing, `in`, str() of None / True / lists, string and dict methods (strip, split,
// startswith, items, get, ...). Undefined names print as "" and are false; an attribute of an
// undefined value is an error, as in Jinja. Rendering is bounded (steps, output size, macro
// depth), so a hostile template fails instead of hanging.
//
// Thread-safe: a parsed Template is immutable; Render may run concurrently.
#ifndef FLUXION_MODEL_JINJA_JINJA_H_
#define FLUXION_MODEL_JINJA_JINJA_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace fluxion::model::jinja {

struct Node;
using Body = std::vector<std::unique_ptr<Node>>;

inline constexpr size_t kMaxRenderedBytes = size_t{64} << 20;
// Steps (a node, an expression, a loop iteration counting kLoopIterationSteps): ample for real
// templates (a few dozen per message) and a bounded time for a hostile one.
inline constexpr int64_t kMaxRenderSteps = int64_t{1} << 18;
inline constexpr int64_t kLoopIterationSteps = 8;

class Template {
 public:
  // InvalidArgument naming the line for text this interpreter does not read.
  static absl::StatusOr<Template> Parse(absl::string_view source);

  // The text for `context`'s variables (a JSON object: messages, tools, add_generation_prompt,
  // bos_token, ...). InvalidArgument carrying the template's own message for raise_exception,
  // or saying what failed (an undefined value's attribute, a wrong type, a bound exceeded).
  // `now` (seconds since the epoch, local time) is what strftime_now formats.
  absl::StatusOr<std::string> Render(const nlohmann::ordered_json& context, int64_t now) const;

 private:
  std::shared_ptr<const Body> body_;
};

}  // namespace fluxion::model::jinja

#endif  // FLUXION_MODEL_JINJA_JINJA_H_

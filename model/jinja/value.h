// The values a Jinja template computes with (model/jinja/jinja.h): JSON data (what the chat
// messages, tools and keyword arguments are), Jinja's `undefined`, a `namespace()` object (mutable,
// shared by reference, so a loop body can change it), and a callable (a macro or a bound method).
//
// JSON values are held by reference into an immutable root, so reading `messages[i].content`
// copies nothing; computed values get a root of their own.
#ifndef FLUXION_MODEL_JINJA_VALUE_H_
#define FLUXION_MODEL_JINJA_VALUE_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace fluxion::model::jinja {

class Value;

// Positional and keyword arguments of a call.
struct Arguments {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keywords;
};

using Callable = std::function<absl::StatusOr<Value>(const Arguments&)>;

class Value {
 public:
  Value() = default;  // undefined
  explicit Value(nlohmann::ordered_json json);
  static Value Undefined(std::string name = "");
  static Value Reference(std::shared_ptr<const nlohmann::ordered_json> root, const nlohmann::ordered_json* node);
  static Value Namespace(std::shared_ptr<nlohmann::ordered_json> attributes);
  static Value Function(Callable fn);

  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_namespace() const { return kind_ == Kind::kNamespace; }
  bool is_callable() const { return kind_ == Kind::kCallable; }
  bool is_json() const { return kind_ == Kind::kJson; }
  // The JSON of a data value, or of a namespace's attributes; null for undefined / callables.
  const nlohmann::ordered_json& json() const;
  nlohmann::ordered_json& namespace_attributes() const { return *ns_; }
  const Callable& callable() const { return fn_; }
  // The name an undefined value was looked up by, for error messages.
  const std::string& undefined_name() const { return name_; }

  // `value.name` / `value[key]` on data: the member, or undefined. Strings and lists index by
  // integer (negative from the end); dicts by key.
  Value Member(const std::string& name) const;
  Value Item(const Value& key) const;

  // Python's truth value: undefined, none, false, 0, "", [] and {} are false.
  bool Truthy() const;
  // str(value) as Jinja prints it: "" for undefined, "None", "True", Python's repr of lists
  // and dicts (strings inside quoted), numbers as Python writes them.
  std::string ToString() const;

 private:
  enum class Kind { kUndefined, kJson, kNamespace, kCallable };
  Kind kind_ = Kind::kUndefined;
  std::shared_ptr<const nlohmann::ordered_json> root_;
  const nlohmann::ordered_json* node_ = nullptr;
  std::shared_ptr<nlohmann::ordered_json> ns_;
  Callable fn_;
  std::string name_;
};

// Python's repr() of a JSON value (strings quoted as Python quotes them).
std::string PythonRepr(const nlohmann::ordered_json& j);
// Python's json.dumps(j, ensure_ascii=False, indent=indent, sort_keys=sort_keys) with its default
// separators (", " and ": " without an indent, "," and ": " with one): what transformers' tojson
// filter writes. indent < 0: no indent.
std::string PythonJsonDumps(const nlohmann::ordered_json& j, int indent, bool sort_keys);
// Python's == between two values (1 == 1.0; undefined equals only undefined).
bool Equal(const Value& a, const Value& b);

}  // namespace fluxion::model::jinja

#endif  // FLUXION_MODEL_JINJA_VALUE_H_

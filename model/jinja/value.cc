#include "model/jinja/value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace fluxion::model::jinja {
namespace {

const nlohmann::ordered_json& Null() {
  static const nlohmann::ordered_json* null = new nlohmann::ordered_json();
  return *null;
}

// Python's repr of a float: the shortest digits that read back, positional for exponents in
// [-4, 16), else d.ddde+XX.
std::string PythonFloat(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof(buf), x, std::chars_format::scientific);
  std::string sci(buf, r.ptr);  // "-d.ddde+XX"
  const bool negative = sci[0] == '-';
  if (negative) sci.erase(0, 1);
  const size_t e = sci.find('e');
  std::string digits = sci.substr(0, e);
  const int exponent = std::stoi(sci.substr(e + 1));
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  std::string out;
  if (exponent >= -4 && exponent < 16) {
    if (exponent < 0) {
      out = "0." + std::string(-exponent - 1, '0') + digits;
    } else if (static_cast<int>(digits.size()) <= exponent + 1) {
      out = digits + std::string(exponent + 1 - digits.size(), '0') + ".0";
    } else {
      out = digits.substr(0, exponent + 1) + "." + digits.substr(exponent + 1);
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char exp[8];
    std::snprintf(exp, sizeof(exp), "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    out += exp;
  }
  return negative ? "-" + out : out;
}

std::string PythonStringRepr(const std::string& s) {
  const bool use_double = s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
  const char quote = use_double ? '"' : '\'';
  std::string out(1, quote);
  for (unsigned char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == quote) {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      char esc[8];
      std::snprintf(esc, sizeof(esc), "\\x%02x", c);
      out += esc;
    } else {
      out += static_cast<char>(c);
    }
  }
  out += quote;
  return out;
}

void JsonString(const std::string& s, std::string* out) {
  *out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': *out += "\\\""; break;
      case '\\': *out += "\\\\"; break;
      case '\n': *out += "\\n"; break;
      case '\r': *out += "\\r"; break;
      case '\t': *out += "\\t"; break;
      case '\b': *out += "\\b"; break;
      case '\f': *out += "\\f"; break;
      default:
        if (c < 0x20 || c == 0x7f) {
          char esc[8];
          std::snprintf(esc, sizeof(esc), "\\u%04x", c);
          *out += esc;
        } else {
          *out += static_cast<char>(c);
        }
    }
  }
  *out += '"';
}

void Dump(const nlohmann::ordered_json& j, int indent, bool sort_keys, int depth, std::string* out) {
  const std::string item_sep = indent >= 0 ? "," : ", ";
  auto newline = [&](int d) {
    if (indent >= 0) *out += "\n" + std::string(static_cast<size_t>(indent * d), ' ');
  };
  if (j.is_object()) {
    if (j.empty()) {
      *out += "{}";
      return;
    }
    std::vector<std::string> keys;
    for (auto it = j.begin(); it != j.end(); ++it) keys.push_back(it.key());
    if (sort_keys) std::sort(keys.begin(), keys.end());
    *out += '{';
    for (size_t i = 0; i < keys.size(); ++i) {
      if (i > 0) *out += item_sep;
      newline(depth + 1);
      JsonString(keys[i], out);
      *out += ": ";
      Dump(j.at(keys[i]), indent, sort_keys, depth + 1, out);
    }
    newline(depth);
    *out += '}';
  } else if (j.is_array()) {
    if (j.empty()) {
      *out += "[]";
      return;
    }
    *out += '[';
    for (size_t i = 0; i < j.size(); ++i) {
      if (i > 0) *out += item_sep;
      newline(depth + 1);
      Dump(j[i], indent, sort_keys, depth + 1, out);
    }
    newline(depth);
    *out += ']';
  } else if (j.is_string()) {
    JsonString(j.get_ref<const std::string&>(), out);
  } else if (j.is_number_float()) {
    const double x = j.get<double>();
    *out += std::isnan(x) ? "NaN" : std::isinf(x) ? (x > 0 ? "Infinity" : "-Infinity")
                                                  : PythonFloat(x);
  } else {
    *out += j.dump();  // null, true, false, integers
  }
}

}  // namespace

Value::Value(nlohmann::ordered_json json)
    : kind_(Kind::kJson), root_(std::make_shared<const nlohmann::ordered_json>(std::move(json))) {
  node_ = root_.get();
}

Value Value::Undefined(std::string name) {
  Value v;
  v.name_ = std::move(name);
  return v;
}

Value Value::Reference(std::shared_ptr<const nlohmann::ordered_json> root, const nlohmann::ordered_json* node) {
  Value v;
  v.kind_ = Kind::kJson;
  v.root_ = std::move(root);
  v.node_ = node;
  return v;
}

Value Value::Namespace(std::shared_ptr<nlohmann::ordered_json> attributes) {
  Value v;
  v.kind_ = Kind::kNamespace;
  v.ns_ = std::move(attributes);
  return v;
}

Value Value::Function(Callable fn) {
  Value v;
  v.kind_ = Kind::kCallable;
  v.fn_ = std::move(fn);
  return v;
}

const nlohmann::ordered_json& Value::json() const {
  if (kind_ == Kind::kJson) return *node_;
  if (kind_ == Kind::kNamespace) return *ns_;
  return Null();
}

Value Value::Member(const std::string& name) const {
  if (kind_ == Kind::kNamespace) {
    auto it = ns_->find(name);
    if (it == ns_->end()) return Undefined(name);
    return Value(*it);
  }
  if (kind_ != Kind::kJson || !node_->is_object()) return Undefined(name);
  auto it = node_->find(name);
  if (it == node_->end()) return Undefined(name);
  return Reference(root_, &*it);
}

Value Value::Item(const Value& key) const {
  if (kind_ == Kind::kNamespace || (kind_ == Kind::kJson && node_->is_object())) {
    if (!key.json().is_string()) return Undefined();
    return Member(key.json().get<std::string>());
  }
  if (kind_ != Kind::kJson || !key.json().is_number_integer()) return Undefined();
  int64_t i = key.json().get<int64_t>();
  if (node_->is_array()) {
    const int64_t n = static_cast<int64_t>(node_->size());
    if (i < 0) i += n;
    if (i < 0 || i >= n) return Undefined();
    return Reference(root_, &(*node_)[static_cast<size_t>(i)]);
  }
  if (node_->is_string()) {  // one byte: templates index ASCII ("content[0]")
    const std::string& s = node_->get_ref<const std::string&>();
    const int64_t n = static_cast<int64_t>(s.size());
    if (i < 0) i += n;
    if (i < 0 || i >= n) return Undefined();
    return Value(nlohmann::ordered_json(std::string(1, s[static_cast<size_t>(i)])));
  }
  return Undefined();
}

bool Value::Truthy() const {
  if (kind_ == Kind::kUndefined) return false;
  if (kind_ == Kind::kCallable || kind_ == Kind::kNamespace) return true;
  const nlohmann::ordered_json& j = *node_;
  if (j.is_null()) return false;
  if (j.is_boolean()) return j.get<bool>();
  if (j.is_number_integer()) return j.get<int64_t>() != 0;
  if (j.is_number()) return j.get<double>() != 0.0;
  // (json::empty() is false for every string: a string is one value to it.)
  if (j.is_string()) return !j.get_ref<const std::string&>().empty();
  if (j.is_array() || j.is_object()) return !j.empty();
  return true;
}

std::string Value::ToString() const {
  if (kind_ == Kind::kUndefined) return "";
  if (kind_ == Kind::kCallable) return "<function>";
  if (kind_ == Kind::kNamespace) return "<Namespace " + PythonRepr(*ns_) + ">";
  if (node_->is_string()) return node_->get<std::string>();
  return PythonRepr(*node_);
}

std::string PythonRepr(const nlohmann::ordered_json& j) {
  if (j.is_null()) return "None";
  if (j.is_boolean()) return j.get<bool>() ? "True" : "False";
  if (j.is_number_float()) return PythonFloat(j.get<double>());
  if (j.is_number()) return j.dump();
  if (j.is_string()) return PythonStringRepr(j.get<std::string>());
  std::string out;
  if (j.is_array()) {
    out = "[";
    for (size_t i = 0; i < j.size(); ++i) absl::StrAppend(&out, i ? ", " : "", PythonRepr(j[i]));
    return out + "]";
  }
  out = "{";
  bool first = true;
  for (auto it = j.begin(); it != j.end(); ++it) {
    absl::StrAppend(&out, first ? "" : ", ", PythonStringRepr(it.key()), ": ",
                    PythonRepr(it.value()));
    first = false;
  }
  return out + "}";
}

std::string PythonJsonDumps(const nlohmann::ordered_json& j, int indent, bool sort_keys) {
  std::string out;
  Dump(j, indent, sort_keys, 0, &out);
  return out;
}

bool Equal(const Value& a, const Value& b) {
  if (a.is_undefined() || b.is_undefined()) return a.is_undefined() && b.is_undefined();
  const nlohmann::ordered_json& x = a.json();
  const nlohmann::ordered_json& y = b.json();
  if (x.is_number() && y.is_number()) {
    if (x.is_number_float() || y.is_number_float()) return x.get<double>() == y.get<double>();
    return x.get<int64_t>() == y.get<int64_t>();
  }
  if (x.is_boolean() && y.is_number()) return (x.get<bool>() ? 1 : 0) == y.get<double>();
  if (y.is_boolean() && x.is_number()) return (y.get<bool>() ? 1 : 0) == x.get<double>();
  return x == y;
}

}  // namespace fluxion::model::jinja

#include "model/jinja/builtins.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "common/status_macros.h"
#include "model/jinja/jinja.h"

namespace fluxion::model::jinja {
namespace {

using Json = nlohmann::ordered_json;

absl::Status Bad(const std::string& what) { return absl::InvalidArgumentError(what); }

// A computed string or list may not outgrow what a render may write (jinja.h): a template that
// doubles a value in a loop is stopped before it exhausts memory.
absl::Status CheckSize(size_t size) {
  if (size > kMaxRenderedBytes) return Bad("a value beyond the output bound");
  return absl::OkStatus();
}

// Positional argument `i`, else keyword `name`, else undefined.
Value Arg(const Arguments& a, size_t i, const char* name) {
  for (const auto& [k, v] : a.keywords) {
    if (k == name) return v;
  }
  return i < a.positional.size() ? a.positional[i] : Value::Undefined(name);
}

bool IsWhitespace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

// Python's str.isspace() for one character.
bool IsPythonSpace(const std::string& c) {
  static const char* const kSpaces[] = {
      " ", "\t", "\n", "\v", "\f", "\r", "\x1c", "\x1d", "\x1e", "\x1f", "\xC2\x85", "\xC2\xA0",
      "\xE1\x9A\x80", "\xE2\x80\x80", "\xE2\x80\x81", "\xE2\x80\x82", "\xE2\x80\x83",
      "\xE2\x80\x84", "\xE2\x80\x85", "\xE2\x80\x86", "\xE2\x80\x87", "\xE2\x80\x88",
      "\xE2\x80\x89", "\xE2\x80\x8A", "\xE2\x80\xA8", "\xE2\x80\xA9", "\xE2\x80\xAF",
      "\xE2\x81\x9F", "\xE3\x80\x80"};
  for (const char* space : kSpaces) {
    if (c == space) return true;
  }
  return false;
}

// Python's strip / lstrip / rstrip: of `chars`' characters, or of Unicode whitespace.
std::string Strip(const std::string& s, const Value& chars, bool left, bool right) {
  const std::vector<std::string> cs = Utf8Characters(s);
  std::vector<std::string> set;
  if (chars.json().is_string()) set = Utf8Characters(chars.json().get<std::string>());
  auto strip = [&](const std::string& c) {
    return chars.json().is_string() ? std::find(set.begin(), set.end(), c) != set.end()
                                    : IsPythonSpace(c);
  };
  size_t b = 0, e = cs.size();
  while (left && b < e && strip(cs[b])) ++b;
  while (right && e > b && strip(cs[e - 1])) --e;
  std::string out;
  for (size_t i = b; i < e; ++i) out += cs[i];
  return out;
}

std::string Title(const std::string& s) {
  std::string out = s;
  bool start = true;
  for (char& c : out) {
    if (absl::ascii_isalpha(static_cast<unsigned char>(c))) {
      c = start ? absl::ascii_toupper(c) : absl::ascii_tolower(c);
      start = false;
    } else {
      start = true;
    }
  }
  return out;
}

std::string Capitalize(const std::string& s) {
  std::string out = absl::AsciiStrToLower(s);
  if (!out.empty()) out[0] = absl::ascii_toupper(out[0]);
  return out;
}

// Python's < for two values of one kind (numbers, strings, lists).
absl::StatusOr<bool> Less(const Json& x, const Json& y) {
  if (x.is_number() && y.is_number()) return x.get<double>() < y.get<double>();
  if (x.is_string() && y.is_string()) return x.get<std::string>() < y.get<std::string>();
  if (x.is_boolean() && y.is_boolean()) return !x.get<bool>() && y.get<bool>();
  return Bad(absl::StrCat("cannot compare ", x.type_name(), " with ", y.type_name()));
}

bool Contains(const Value& container, const Value& item) {
  const Json& c = container.json();
  if (c.is_string()) return item.json().is_string() && absl::StrContains(c.get<std::string>(), item.json().get<std::string>());
  if (c.is_array()) {
    for (const Json& x : c) {
      if (Equal(Value(x), item)) return true;
    }
    return false;
  }
  if (c.is_object()) return item.json().is_string() && c.contains(item.json().get<std::string>());
  return false;
}

int64_t Length(const Value& v) {
  const Json& j = v.json();
  if (v.is_undefined()) return 0;
  if (j.is_string()) return static_cast<int64_t>(Utf8Characters(j.get<std::string>()).size());
  if (j.is_array() || j.is_object()) return static_cast<int64_t>(j.size());
  return 0;
}

// The items of a list, or a dict's keys.
std::vector<Value> Items(const Value& v) {
  std::vector<Value> out;
  const Json& j = v.json();
  if (j.is_array()) {
    for (size_t i = 0; i < j.size(); ++i) out.push_back(v.Item(Value(Json(i))));
  } else if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) out.push_back(Value(Json(it.key())));
  } else if (j.is_string()) {
    for (const std::string& c : Utf8Characters(j.get<std::string>())) out.push_back(Value(Json(c)));
  }
  return out;
}

Json ItemPairs(const Json& j) {
  Json out = Json::array();
  for (auto it = j.begin(); it != j.end(); ++it) out.push_back(Json::array({it.key(), it.value()}));
  return out;
}

// An attribute path "a.b" of an item (selectattr / map / sort / join attribute=).
Value Attribute(const Value& item, const std::string& path) {
  Value v = item;
  size_t start = 0;
  while (start <= path.size()) {
    const size_t dot = path.find('.', start);
    v = v.Member(path.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return v;
}

absl::StatusOr<Value> SelectAttr(const Value& subject, const Arguments& a, bool keep) {
  if (a.positional.empty()) return Bad("selectattr needs an attribute name");
  const std::string attribute = a.positional[0].ToString();
  Arguments test_args;
  test_args.positional.assign(a.positional.begin() + std::min<size_t>(2, a.positional.size()),
                              a.positional.end());
  Json out = Json::array();
  for (const Value& item : Items(subject)) {
    const Value field = Attribute(item, attribute);
    bool pass = field.Truthy();
    if (a.positional.size() >= 2) {
      FLUXION_ASSIGN_OR_RETURN(pass, ApplyTest(a.positional[1].ToString(), field, test_args));
    }
    if (pass == keep) out.push_back(item.json());
  }
  return Value(std::move(out));
}

absl::StatusOr<Value> Select(const Value& subject, const Arguments& a, bool keep) {
  Arguments test_args;
  test_args.positional.assign(a.positional.begin() + std::min<size_t>(1, a.positional.size()),
                              a.positional.end());
  Json out = Json::array();
  for (const Value& item : Items(subject)) {
    bool pass = item.Truthy();
    if (!a.positional.empty()) {
      FLUXION_ASSIGN_OR_RETURN(pass, ApplyTest(a.positional[0].ToString(), item, test_args));
    }
    if (pass == keep) out.push_back(item.json());
  }
  return Value(std::move(out));
}

// str.replace(old, new), the result bounded like any computed string.
absl::StatusOr<Value> Replace(const std::string& s, const Arguments& a) {
  const std::string from = Arg(a, 0, "old").ToString(), to = Arg(a, 1, "new").ToString();
  if (from.empty()) return Value(Json(s));
  size_t count = 0;
  for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + from.size())) {
    ++count;
  }
  if (to.size() > from.size() && count > 0) {
    FLUXION_RETURN_IF_ERROR(CheckSize(s.size() + count * (to.size() - from.size())));
  }
  return Value(Json(absl::StrReplaceAll(s, {{from, to}})));
}

absl::StatusOr<std::string> Indent(const std::string& s, const Arguments& a) {
  const Value width = Arg(a, 0, "width");
  const int64_t spaces = width.json().is_number_integer() ? width.json().get<int64_t>() : 4;
  if (spaces < 0 || spaces > 256) return Bad("'indent' width outside [0, 256]");
  const std::string pad = width.json().is_string() ? width.json().get<std::string>()
                                                   : std::string(static_cast<size_t>(spaces), ' ');
  FLUXION_RETURN_IF_ERROR(CheckSize(s.size() + pad.size() * (1 + std::count(s.begin(), s.end(), '\n'))));
  const bool first = Arg(a, 1, "first").Truthy(), blank = Arg(a, 2, "blank").Truthy();
  std::string out;
  size_t start = 0;
  for (int line = 0; start <= s.size(); ++line) {
    const size_t nl = s.find('\n', start);
    const std::string text = s.substr(start, nl == std::string::npos ? std::string::npos : nl - start);
    if ((line > 0 || first) && (blank || !text.empty())) out += pad;
    out += text;
    if (nl == std::string::npos) break;
    out += '\n';
    start = nl + 1;
  }
  return out;
}

}  // namespace

std::vector<std::string> Utf8Characters(const std::string& s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    size_t n = 1;
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0xF0) n = 4; else if (c >= 0xE0) n = 3; else if (c >= 0xC0) n = 2;
    n = std::min(n, s.size() - i);
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

absl::StatusOr<Value> Slice(const Value& object, std::optional<int64_t> start,
                            std::optional<int64_t> stop, std::optional<int64_t> step, int line) {
  const Json& j = object.json();
  int64_t by = step.value_or(1);
  if (by == 0) return Bad(absl::StrCat("line ", line, ": slice step is zero"));
  std::vector<Json> items;
  if (j.is_array()) {
    items.assign(j.begin(), j.end());
  } else if (j.is_string()) {
    for (const std::string& c : Utf8Characters(j.get<std::string>())) items.push_back(Json(c));
  } else {
    return Bad(absl::StrCat("line ", line, ": only lists and strings slice"));
  }
  const int64_t n = static_cast<int64_t>(items.size());
  by = std::clamp<int64_t>(by, -(n + 1), n + 1);  // the same slice, and no index overflows
  auto clamp = [&](std::optional<int64_t> v, int64_t fallback) {
    if (!v.has_value()) return fallback;
    const int64_t x = *v < 0 ? *v + n : *v;
    return by > 0 ? std::clamp<int64_t>(x, 0, n) : std::clamp<int64_t>(x, -1, n - 1);
  };
  const int64_t b = clamp(start, by > 0 ? 0 : n - 1);
  const int64_t e = clamp(stop, by > 0 ? n : -1);
  Json out = Json::array();
  std::string text;
  for (int64_t i = b; by > 0 ? i < e : i > e; i += by) {
    if (j.is_array()) {
      out.push_back(items[static_cast<size_t>(i)]);
    } else {
      text += items[static_cast<size_t>(i)].get<std::string>();
    }
  }
  return j.is_array() ? Value(std::move(out)) : Value(Json(text));
}

absl::StatusOr<Value> BinaryOp(const std::string& op, const Value& l, const Value& r) {
  const Json& x = l.json();
  const Json& y = r.json();
  if (op == "==") return Value(Json(Equal(l, r)));
  if (op == "!=") return Value(Json(!Equal(l, r)));
  if (op == "in") return Value(Json(Contains(r, l)));
  if (op == "not in") return Value(Json(!Contains(r, l)));
  if (op == "~") {
    std::string a = l.ToString(), b = r.ToString();
    FLUXION_RETURN_IF_ERROR(CheckSize(a.size() + b.size()));
    return Value(Json(a + b));
  }
  if (op == "<" || op == ">" || op == "<=" || op == ">=") {
    FLUXION_ASSIGN_OR_RETURN(bool lt, Less(x, y));
    FLUXION_ASSIGN_OR_RETURN(bool gt, Less(y, x));
    if (op == "<") return Value(Json(lt));
    if (op == ">") return Value(Json(gt));
    if (op == "<=") return Value(Json(!gt));
    return Value(Json(!lt));
  }
  if (op == "+") {
    if (x.is_string() && y.is_string()) {
      FLUXION_RETURN_IF_ERROR(CheckSize(x.get_ref<const std::string&>().size() +
                                        y.get_ref<const std::string&>().size()));
      return Value(Json(x.get<std::string>() + y.get<std::string>()));
    }
    if (x.is_array() && y.is_array()) {
      FLUXION_RETURN_IF_ERROR(CheckSize(x.size() + y.size()));
      Json out = x;
      out.insert(out.end(), y.begin(), y.end());
      return Value(std::move(out));
    }
  }
  if (op == "*" && x.is_string() && y.is_number_integer()) {
    const std::string& unit = x.get_ref<const std::string&>();
    const int64_t times = std::max<int64_t>(0, y.get<int64_t>());
    if (!unit.empty() && times > static_cast<int64_t>(kMaxRenderedBytes / unit.size())) {
      return Bad("a repeated string beyond the output bound");
    }
    std::string out;
    for (int64_t i = 0; i < times; ++i) out += unit;
    return Value(Json(out));
  }
  if (!(x.is_number() || x.is_boolean()) || !(y.is_number() || y.is_boolean())) {
    return Bad(absl::StrCat("unsupported operands for ", op, ": ", l.is_undefined() ? "undefined" : x.type_name(),
                            " and ", r.is_undefined() ? "undefined" : y.type_name()));
  }
  const bool integers = (x.is_number_integer() || x.is_boolean()) && (y.is_number_integer() || y.is_boolean());
  auto as_int = [](const Json& j) { return j.is_boolean() ? int64_t{j.get<bool>()} : j.get<int64_t>(); };
  auto as_double = [](const Json& j) { return j.is_boolean() ? double{j.get<bool>() ? 1.0 : 0.0} : j.get<double>(); };
  if (integers && op != "/" && !(op == "**" && as_int(y) < 0)) {
    // Python's integers do not overflow; ours are 64 bits, and a result beyond them is refused
    // (no chat template computes one).
    const int64_t a = as_int(x), b = as_int(y);
    int64_t r = 0;
    bool overflow = false;
    if (op == "+") {
      overflow = __builtin_add_overflow(a, b, &r);
    } else if (op == "-") {
      overflow = __builtin_sub_overflow(a, b, &r);
    } else if (op == "*") {
      overflow = __builtin_mul_overflow(a, b, &r);
    } else if (op == "**") {
      r = 1;
      for (int64_t i = 0; i < b && !overflow; ++i) {
        overflow = __builtin_mul_overflow(r, a, &r);
        if (r == 0 || r == 1) break;  // 0 and 1 stay; -1 alternates below
      }
      if (!overflow && a == -1) r = (b % 2 == 0) ? 1 : -1;
    } else {
      if (b == 0) return Bad("division by zero");
      if (a == std::numeric_limits<int64_t>::min() && b == -1) return Bad("integer overflow");
      const int64_t q = a / b - ((a % b != 0) && ((a < 0) != (b < 0)) ? 1 : 0);  // Python floors
      r = op == "//" ? q : a - q * b;
    }
    if (overflow) return Bad(absl::StrCat("integer overflow in ", op));
    return Value(Json(r));
  }
  const double a = as_double(x), b = as_double(y);
  if (op == "+") return Value(Json(a + b));
  if (op == "-") return Value(Json(a - b));
  if (op == "*") return Value(Json(a * b));
  if (op == "**") return Value(Json(std::pow(a, b)));
  if (b == 0) return Bad("division by zero");
  if (op == "/") return Value(Json(a / b));
  if (op == "//") return Value(Json(std::floor(a / b)));
  if (op == "%") return Value(Json(a - std::floor(a / b) * b));
  return Bad(absl::StrCat("unknown operator ", op));
}

absl::StatusOr<bool> ApplyTest(const std::string& name, const Value& v, const Arguments& a) {
  const Json& j = v.json();
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_json() && j.is_null();
  if (name == "string") return v.is_json() && j.is_string();
  if (name == "number") return v.is_json() && j.is_number();
  if (name == "integer") return v.is_json() && j.is_number_integer();
  if (name == "float") return v.is_json() && j.is_number_float();
  if (name == "boolean") return v.is_json() && j.is_boolean();
  if (name == "true") return v.is_json() && j.is_boolean() && j.get<bool>();
  if (name == "false") return v.is_json() && j.is_boolean() && !j.get<bool>();
  if (name == "mapping") return (v.is_json() && j.is_object()) || v.is_namespace();
  if (name == "sequence") return v.is_json() && (j.is_array() || j.is_string() || j.is_object());
  if (name == "iterable") return v.is_json() && (j.is_array() || j.is_string() || j.is_object());
  if (name == "callable") return v.is_callable();
  if (name == "lower") return j.is_string() && absl::AsciiStrToLower(j.get<std::string>()) == j.get<std::string>();
  if (name == "upper") return j.is_string() && absl::AsciiStrToUpper(j.get<std::string>()) == j.get<std::string>();
  if (name == "odd" || name == "even") {
    if (!j.is_number_integer()) return Bad(absl::StrCat("'", name, "' needs an integer"));
    return (j.get<int64_t>() % 2 != 0) == (name == "odd");
  }
  const Value other = Arg(a, 0, "value");
  if (name == "equalto" || name == "eq" || name == "==" || name == "sameas") return Equal(v, other);
  if (name == "ne" || name == "!=") return !Equal(v, other);
  if (name == "in") return Contains(other, v);
  if (name == "divisibleby") {
    if (!j.is_number_integer() || !other.json().is_number_integer() || other.json().get<int64_t>() == 0) {
      return Bad("'divisibleby' needs integers");
    }
    return j.get<int64_t>() % other.json().get<int64_t>() == 0;
  }
  static const absl::flat_hash_map<std::string, std::string>* kCompare =
      new absl::flat_hash_map<std::string, std::string>{{"lt", "<"}, {"lessthan", "<"}, {"<", "<"},
                                                        {"le", "<="}, {"<=", "<="}, {"gt", ">"},
                                                        {"greaterthan", ">"}, {">", ">"},
                                                        {"ge", ">="}, {">=", ">="}};
  if (auto it = kCompare->find(name); it != kCompare->end()) {
    FLUXION_ASSIGN_OR_RETURN(Value r, BinaryOp(it->second, v, other));
    return r.json().get<bool>();
  }
  return Bad(absl::StrCat("unknown test '", name, "'"));
}

absl::StatusOr<Value> ApplyFilter(const std::string& name, const Value& v, const Arguments& a) {
  const Json& j = v.json();
  const std::string s = v.ToString();
  if (name == "trim" || name == "strip") return Value(Json(Strip(s, Arg(a, 0, "chars"), true, true)));
  if (name == "upper") return Value(Json(absl::AsciiStrToUpper(s)));
  if (name == "lower") return Value(Json(absl::AsciiStrToLower(s)));
  if (name == "capitalize") return Value(Json(Capitalize(s)));
  if (name == "title") return Value(Json(Title(s)));
  if (name == "string" || name == "safe" || name == "e" || name == "escape") {
    if (name == "e" || name == "escape") {
      return Value(Json(absl::StrReplaceAll(s, {{"&", "&amp;"}, {"<", "&lt;"}, {">", "&gt;"},
                                                {"\"", "&#34;"}, {"'", "&#39;"}})));
    }
    return v.is_json() && j.is_string() ? v : Value(Json(s));
  }
  if (name == "length" || name == "count") return Value(Json(Length(v)));
  if (name == "default" || name == "d") {
    const bool boolean = Arg(a, 1, "boolean").Truthy();
    if (v.is_undefined() || (boolean && !v.Truthy())) return Arg(a, 0, "default_value").is_undefined() ? Value(Json("")) : Arg(a, 0, "default_value");
    return v;
  }
  if (name == "first" || name == "last") {
    std::vector<Value> items = Items(v);
    if (items.empty()) return Value::Undefined();
    return name == "first" ? items.front() : items.back();
  }
  if (name == "list") {
    Json out = Json::array();
    for (const Value& item : Items(v)) out.push_back(item.json());
    return Value(std::move(out));
  }
  if (name == "items") {
    if (!j.is_object()) return Bad("'items' needs a mapping");
    return Value(ItemPairs(j));
  }
  if (name == "join") {
    const Value attribute = Arg(a, 1, "attribute");
    std::vector<std::string> parts;
    for (const Value& item : Items(v)) {
      parts.push_back(attribute.is_undefined() ? item.ToString()
                                               : Attribute(item, attribute.ToString()).ToString());
    }
    const Value sep = Arg(a, 0, "d");
    return Value(Json(absl::StrJoin(parts, sep.is_undefined() ? "" : sep.ToString())));
  }
  if (name == "tojson") {
    const Value indent = Arg(a, 0, "indent");
    if (indent.json().is_number_integer() &&
        (indent.json().get<int64_t>() < 0 || indent.json().get<int64_t>() > 64)) {
      return Bad("'tojson' indent outside [0, 64]");
    }
    return Value(Json(PythonJsonDumps(j, indent.json().is_number_integer() ? indent.json().get<int>() : -1,
                                      Arg(a, 1, "sort_keys").Truthy())));
  }
  if (name == "int") {
    if (j.is_number_integer()) return v;
    if (j.is_number()) {
      const double d = j.get<double>();
      if (!(std::fabs(d) < 9.2e18)) return Bad("'int' of a number beyond 64 bits");
      return Value(Json(static_cast<int64_t>(d)));
    }
    if (j.is_boolean()) return Value(Json(int64_t{j.get<bool>()}));
    try {
      return Value(Json(std::stoll(s)));
    } catch (...) {
      return Value(Json(0));
    }
  }
  if (name == "float") {
    if (j.is_number()) return Value(Json(j.get<double>()));
    try {
      return Value(Json(std::stod(s)));
    } catch (...) {
      return Value(Json(0.0));
    }
  }
  if (name == "abs") {
    if (j.is_number_integer()) {
      const int64_t x = j.get<int64_t>();
      if (x == std::numeric_limits<int64_t>::min()) return Bad("integer overflow in abs");
      return Value(Json(x < 0 ? -x : x));
    }
    if (j.is_number()) return Value(Json(std::fabs(j.get<double>())));
    return Bad("'abs' needs a number");
  }
  if (name == "round") {
    if (!j.is_number()) return Bad("'round' needs a number");
    const Value precision = Arg(a, 0, "precision");
    const double scale = std::pow(10.0, precision.json().is_number_integer() ? precision.json().get<int>() : 0);
    return Value(Json(std::nearbyint(j.get<double>() * scale) / scale));
  }
  if (name == "replace") return Replace(s, a);
  if (name == "indent") {
    FLUXION_ASSIGN_OR_RETURN(std::string indented, Indent(s, a));
    return Value(Json(std::move(indented)));
  }
  if (name == "map") {
    const Value attribute = Arg(a, 99, "attribute");
    Json out = Json::array();
    for (const Value& item : Items(v)) {
      if (!attribute.is_undefined()) {
        out.push_back(Attribute(item, attribute.ToString()).json());
      } else if (!a.positional.empty()) {
        Arguments rest;
        rest.positional.assign(a.positional.begin() + 1, a.positional.end());
        FLUXION_ASSIGN_OR_RETURN(Value mapped, ApplyFilter(a.positional[0].ToString(), item, rest));
        out.push_back(mapped.json());
      } else {
        out.push_back(item.json());
      }
    }
    return Value(std::move(out));
  }
  if (name == "selectattr") return SelectAttr(v, a, true);
  if (name == "rejectattr") return SelectAttr(v, a, false);
  if (name == "select") return Select(v, a, true);
  if (name == "reject") return Select(v, a, false);
  if (name == "reverse") {
    if (j.is_string()) {
      std::vector<std::string> chars = Utf8Characters(j.get<std::string>());
      std::reverse(chars.begin(), chars.end());
      return Value(Json(absl::StrJoin(chars, "")));
    }
    Json out = Json::array();
    for (const Value& item : Items(v)) out.insert(out.begin(), item.json());
    return Value(std::move(out));
  }
  if (name == "unique") {
    Json out = Json::array();
    for (const Value& item : Items(v)) {
      if (!Contains(Value(out), item)) out.push_back(item.json());
    }
    return Value(std::move(out));
  }
  if (name == "sort" || name == "dictsort") {
    Json out = Json::array();
    if (name == "dictsort") {
      out = ItemPairs(j);
    } else {
      for (const Value& item : Items(v)) out.push_back(item.json());
    }
    const Value attribute = Arg(a, 99, "attribute");
    const bool reverse = Arg(a, name == "sort" ? 0 : 2, "reverse").Truthy();
    std::vector<Json> items(out.begin(), out.end());
    absl::Status status;
    std::stable_sort(items.begin(), items.end(), [&](const Json& p, const Json& q) {
      const Json& kp = name == "dictsort" ? p[0] : attribute.is_undefined() ? p : Attribute(Value(p), attribute.ToString()).json();
      const Json& kq = name == "dictsort" ? q[0] : attribute.is_undefined() ? q : Attribute(Value(q), attribute.ToString()).json();
      absl::StatusOr<bool> lt = Less(kp, kq);
      if (!lt.ok()) status = lt.status();
      return lt.ok() && *lt;
    });
    FLUXION_RETURN_IF_ERROR(status);
    if (reverse) std::reverse(items.begin(), items.end());
    return Value(Json(items));
  }
  if (name == "sum") {
    Value total(Json(0));
    for (const Value& item : Items(v)) {
      FLUXION_ASSIGN_OR_RETURN(total, BinaryOp("+", total, item));
    }
    return total;
  }
  if (name == "min" || name == "max") {
    std::vector<Value> items = Items(v);
    if (items.empty()) return Value::Undefined();
    Value best = items[0];
    for (const Value& item : items) {
      FLUXION_ASSIGN_OR_RETURN(bool lt, Less(item.json(), best.json()));
      FLUXION_ASSIGN_OR_RETURN(bool gt, Less(best.json(), item.json()));
      if (name == "min" ? lt : gt) best = item;
    }
    return best;
  }
  return Bad(absl::StrCat("unknown filter '", name, "'"));
}

absl::StatusOr<Value> CallMethod(const Value& object, const std::string& name, const Arguments& a) {
  const Json& j = object.json();
  if (j.is_string()) {
    const std::string s = j.get<std::string>();
    if (name == "strip") return Value(Json(Strip(s, Arg(a, 0, "chars"), true, true)));
    if (name == "lstrip") return Value(Json(Strip(s, Arg(a, 0, "chars"), true, false)));
    if (name == "rstrip") return Value(Json(Strip(s, Arg(a, 0, "chars"), false, true)));
    if (name == "upper") return Value(Json(absl::AsciiStrToUpper(s)));
    if (name == "lower") return Value(Json(absl::AsciiStrToLower(s)));
    if (name == "title") return Value(Json(Title(s)));
    if (name == "capitalize") return Value(Json(Capitalize(s)));
    if (name == "startswith" || name == "endswith") {
      const Value prefix = Arg(a, 0, "prefix");
      std::vector<std::string> options;
      if (prefix.json().is_array()) {
        for (const Json& p : prefix.json()) options.push_back(Value(p).ToString());
      } else {
        options.push_back(prefix.ToString());
      }
      for (const std::string& p : options) {
        if (name == "startswith" ? absl::StartsWith(s, p) : absl::EndsWith(s, p)) return Value(Json(true));
      }
      return Value(Json(false));
    }
    if (name == "replace") return Replace(s, a);
    if (name == "split") {
      const Value sep = Arg(a, 0, "sep");
      const Value max = Arg(a, 1, "maxsplit");
      int64_t limit = max.json().is_number_integer() ? max.json().get<int64_t>() : -1;
      Json out = Json::array();
      if (sep.is_undefined() || sep.json().is_null()) {  // runs of whitespace, none empty
        size_t i = 0;
        while (i < s.size()) {
          while (i < s.size() && IsWhitespace(s[i])) ++i;
          if (i >= s.size()) break;
          if (limit == 0) {
            out.push_back(Strip(s.substr(i), Value::Undefined(), false, true));
            break;
          }
          size_t e = i;
          while (e < s.size() && !IsWhitespace(s[e])) ++e;
          out.push_back(s.substr(i, e - i));
          --limit;
          i = e;
        }
        return Value(std::move(out));
      }
      const std::string d = sep.ToString();
      if (d.empty()) return Bad("split() separator is empty");
      size_t start = 0;
      for (size_t at = s.find(d); at != std::string::npos && limit != 0; at = s.find(d, start), --limit) {
        out.push_back(s.substr(start, at - start));
        start = at + d.size();
      }
      out.push_back(s.substr(start));
      return Value(std::move(out));
    }
    if (name == "find") {
      const size_t at = s.find(Arg(a, 0, "sub").ToString());
      return Value(Json(at == std::string::npos ? int64_t{-1} : static_cast<int64_t>(at)));
    }
    if (name == "count") {
      const std::string sub = Arg(a, 0, "sub").ToString();
      int64_t n = 0;
      for (size_t at = sub.empty() ? std::string::npos : s.find(sub); at != std::string::npos; at = s.find(sub, at + sub.size())) ++n;
      return Value(Json(n));
    }
    if (name == "join") {
      std::vector<std::string> parts;
      for (const Value& item : Items(Arg(a, 0, "iterable"))) parts.push_back(item.ToString());
      return Value(Json(absl::StrJoin(parts, s)));
    }
    if (name == "isdigit") {
      return Value(Json(!s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; })));
    }
  }
  if (j.is_object()) {
    if (name == "items") return Value(ItemPairs(j));
    if (name == "keys") {
      Json out = Json::array();
      for (auto it = j.begin(); it != j.end(); ++it) out.push_back(it.key());
      return Value(std::move(out));
    }
    if (name == "values") {
      Json out = Json::array();
      for (auto it = j.begin(); it != j.end(); ++it) out.push_back(it.value());
      return Value(std::move(out));
    }
    if (name == "get") {
      const Value found = object.Member(Arg(a, 0, "key").ToString());
      if (!found.is_undefined()) return found;
      const Value fallback = Arg(a, 1, "default");
      return fallback.is_undefined() ? Value(Json(nullptr)) : fallback;
    }
  }
  if (j.is_array() && (name == "index" || name == "count")) {
    int64_t n = 0;
    for (size_t i = 0; i < j.size(); ++i) {
      if (!Equal(Value(j[i]), Arg(a, 0, "value"))) continue;
      if (name == "index") return Value(Json(static_cast<int64_t>(i)));
      ++n;
    }
    if (name == "index") return Bad("list.index(x): x not in list");
    return Value(Json(n));
  }
  return Bad(absl::StrCat("'", name, "' is not a method of ", j.type_name(),
                          " (the template environment is immutable, as transformers' is)"));
}

}  // namespace fluxion::model::jinja

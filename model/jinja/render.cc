// Template::Parse and Template::Render: the interpreter over ast.h (filters, tests and methods in
// builtins.cc).
#include <ctime>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/jinja/ast.h"
#include "model/jinja/builtins.h"
#include "model/jinja/jinja.h"
#include "model/jinja/parser.h"
#include "model/jinja/value.h"

namespace fluxion::model::jinja {
namespace {

constexpr int kMaxCallDepth = 32;  // macro calls in flight (recursive macros, e.g. JSON schemas)

// Pops the innermost scope when it goes out of scope.
struct ScopeExit {
  std::vector<absl::flat_hash_map<std::string, Value>>* scopes;
  ~ScopeExit() { scopes->pop_back(); }
};

absl::Status Error(int line, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("chat template line ", line, ": ", what));
}

class Renderer {
 public:
  Renderer(const nlohmann::ordered_json& context, int64_t now) : now_(now) {
    scopes_.emplace_back();
    auto root = std::make_shared<const nlohmann::ordered_json>(context);
    if (root->is_object()) {
      for (auto it = root->begin(); it != root->end(); ++it) {
        scopes_.back()[it.key()] = Value::Reference(root, &*it);
      }
    }
    AddGlobals();
  }

  absl::Status Run(const Body& body, std::string* out) {
    FLUXION_ASSIGN_OR_RETURN(Flow flow, Exec(body, out));
    (void)flow;
    return absl::OkStatus();
  }

 private:
  enum class Flow { kNormal, kBreak, kContinue };

  void AddGlobals() {
    auto& g = scopes_.front();
    g["range"] = Value::Function([](const Arguments& a) -> absl::StatusOr<Value> {
      int64_t start = 0, stop = 0, step = 1;
      auto number = [&](size_t i) { return a.positional[i].json().get<int64_t>(); };
      for (const Value& v : a.positional) {
        if (!v.json().is_number_integer()) return absl::InvalidArgumentError("range() needs integers");
      }
      if (a.positional.size() == 1) {
        stop = number(0);
      } else if (a.positional.size() >= 2) {
        start = number(0);
        stop = number(1);
        if (a.positional.size() == 3) step = number(2);
      }
      if (step == 0 || (stop - start) / step > 1000000) {
        return absl::InvalidArgumentError("range() is empty-stepped or too long");
      }
      nlohmann::ordered_json out = nlohmann::ordered_json::array();
      for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) out.push_back(i);
      return Value(std::move(out));
    });
    g["namespace"] = Value::Function([](const Arguments& a) -> absl::StatusOr<Value> {
      auto attributes = std::make_shared<nlohmann::ordered_json>(nlohmann::ordered_json::object());
      for (const Value& v : a.positional) {
        if (v.json().is_object()) attributes->update(v.json());
      }
      for (const auto& [k, v] : a.keywords) (*attributes)[k] = v.json();
      return Value::Namespace(std::move(attributes));
    });
    g["dict"] = Value::Function([](const Arguments& a) -> absl::StatusOr<Value> {
      nlohmann::ordered_json out = nlohmann::ordered_json::object();
      for (const auto& [k, v] : a.keywords) out[k] = v.json();
      return Value(std::move(out));
    });
    g["raise_exception"] = Value::Function([](const Arguments& a) -> absl::StatusOr<Value> {
      return absl::InvalidArgumentError(a.positional.empty() ? "the chat template raised an error"
                                                             : a.positional[0].ToString());
    });
    g["strftime_now"] = Value::Function([this](const Arguments& a) -> absl::StatusOr<Value> {
      if (a.positional.empty() || !a.positional[0].json().is_string()) {
        return absl::InvalidArgumentError("strftime_now() needs a format string");
      }
      const std::time_t t = static_cast<std::time_t>(now_);
      std::tm tm{};
      localtime_r(&t, &tm);
      char buf[256];
      const size_t n = std::strftime(buf, sizeof(buf), a.positional[0].json().get<std::string>().c_str(), &tm);
      return Value(nlohmann::ordered_json(std::string(buf, n)));
    });
  }

  absl::Status Step(int line) {
    if (++steps_ > kMaxRenderSteps) return Error(line, "the template runs too long");
    return absl::OkStatus();
  }

  Value Lookup(const std::string& name) const {
    for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
      auto found = it->find(name);
      if (found != it->end()) return found->second;
    }
    return Value::Undefined(name);
  }

  absl::StatusOr<Flow> Exec(const Body& body, std::string* out) {
    for (const std::unique_ptr<Node>& node : body) {
      FLUXION_RETURN_IF_ERROR(Step(node->line));
      if (out->size() > kMaxRenderedBytes) return Error(node->line, "the output is too large");
      switch (node->kind) {
        case Node::Kind::kText:
          out->append(node->text);
          break;
        case Node::Kind::kOutput: {
          FLUXION_ASSIGN_OR_RETURN(Value v, Eval(*node->expr));
          out->append(v.ToString());
          break;
        }
        case Node::Kind::kIf: {
          size_t i = 0;
          for (; i < node->conditions.size(); ++i) {
            FLUXION_ASSIGN_OR_RETURN(Value c, Eval(*node->conditions[i]));
            if (c.Truthy()) break;
          }
          if (i < node->bodies.size()) {
            FLUXION_ASSIGN_OR_RETURN(Flow flow, Exec(node->bodies[i], out));
            if (flow != Flow::kNormal) return flow;
          }
          break;
        }
        case Node::Kind::kFor:
          FLUXION_RETURN_IF_ERROR(ExecFor(*node, out));
          break;
        case Node::Kind::kSet:
          FLUXION_RETURN_IF_ERROR(ExecSet(*node));
          break;
        case Node::Kind::kMacro:
          scopes_.back()[node->targets[0]] = MakeMacro(*node);
          break;
        case Node::Kind::kBreak:
          return Flow::kBreak;
        case Node::Kind::kContinue:
          return Flow::kContinue;
      }
    }
    return Flow::kNormal;
  }

  absl::Status ExecSet(const Node& node) {
    Value v;
    if (node.expr != nullptr) {
      FLUXION_ASSIGN_OR_RETURN(v, Eval(*node.expr));
    } else {
      std::string captured;
      FLUXION_ASSIGN_OR_RETURN(Flow flow, Exec(node.bodies[0], &captured));
      (void)flow;
      v = Value(nlohmann::ordered_json(std::move(captured)));
    }
    if (!node.attribute.empty()) {
      Value target = Lookup(node.targets[0]);
      if (!target.is_namespace()) {
        return Error(node.line, absl::StrCat("cannot set an attribute of '", node.targets[0],
                                             "', which is not a namespace()"));
      }
      target.namespace_attributes()[node.attribute] = v.json();
      return absl::OkStatus();
    }
    if (node.targets.size() == 1) {
      scopes_.back()[node.targets[0]] = std::move(v);
      return absl::OkStatus();
    }
    if (!v.json().is_array() || v.json().size() != node.targets.size()) {
      return Error(node.line, "cannot unpack the value into the names set");
    }
    for (size_t i = 0; i < node.targets.size(); ++i) {
      scopes_.back()[node.targets[i]] = Value(v.json()[i]);
    }
    return absl::OkStatus();
  }

  // The elements a for loop walks: a list's items, a dict's keys, a string's characters.
  static std::vector<Value> Elements(const Value& v) {
    std::vector<Value> out;
    const nlohmann::ordered_json& j = v.json();
    if (v.is_undefined()) return out;
    if (j.is_array()) {
      for (size_t i = 0; i < j.size(); ++i) out.push_back(v.Item(Value(nlohmann::ordered_json(i))));
    } else if (j.is_object()) {
      for (auto it = j.begin(); it != j.end(); ++it) out.push_back(Value(nlohmann::ordered_json(it.key())));
    } else if (j.is_string()) {
      for (const std::string& c : Utf8Characters(j.get<std::string>())) {
        out.push_back(Value(nlohmann::ordered_json(c)));
      }
    }
    return out;
  }

  absl::Status Bind(const Node& node, const Value& item) {
    if (node.targets.size() == 1) {
      scopes_.back()[node.targets[0]] = item;
      return absl::OkStatus();
    }
    if (!item.json().is_array() || item.json().size() != node.targets.size()) {
      return Error(node.line, "cannot unpack a loop item into the loop's names");
    }
    for (size_t i = 0; i < node.targets.size(); ++i) {
      scopes_.back()[node.targets[i]] = item.Item(Value(nlohmann::ordered_json(i)));
    }
    return absl::OkStatus();
  }

  absl::Status ExecFor(const Node& node, std::string* out) {
    FLUXION_ASSIGN_OR_RETURN(Value iterable, Eval(*node.expr));
    if (iterable.is_json() && !iterable.json().is_array() && !iterable.json().is_object() &&
        !iterable.json().is_string() && !iterable.json().is_null()) {
      return Error(node.line, "the for loop's value cannot be iterated");
    }
    std::vector<Value> items = Elements(iterable);
    if (!node.conditions.empty()) {  // `for x in xs if cond`: filtered before counting
      std::vector<Value> kept;
      absl::Status status;
      for (const Value& item : items) {
        scopes_.emplace_back();
        status = Bind(node, item);
        absl::StatusOr<Value> keep = status.ok() ? Eval(*node.conditions[0]) : status;
        scopes_.pop_back();
        if (!keep.ok()) return keep.status();
        if (keep->Truthy()) kept.push_back(item);
      }
      items = std::move(kept);
    }
    const size_t n = items.size();
    absl::Status status;
    // Each iteration has a scope of its own, as in Jinja: a `set` in the body lasts until the
    // iteration ends (a namespace() is how a template carries a value across iterations).
    for (size_t i = 0; i < n && status.ok(); ++i) {
      // An iteration costs a scope and the loop object besides its body.
      steps_ += kLoopIterationSteps;
      status = Step(node.line);
      if (!status.ok()) break;
      scopes_.emplace_back();
      ScopeExit pop{&scopes_};
      status = Bind(node, items[i]);
      if (!status.ok()) break;
      nlohmann::ordered_json loop = {{"index", i + 1},        {"index0", i},
                             {"revindex", n - i},     {"revindex0", n - i - 1},
                             {"first", i == 0},       {"last", i + 1 == n},
                             {"length", n}};
      if (i > 0) loop["previtem"] = items[i - 1].json();
      if (i + 1 < n) loop["nextitem"] = items[i + 1].json();
      scopes_.back()["loop"] = Value(std::move(loop));
      absl::StatusOr<Flow> flow = Exec(node.bodies[0], out);
      if (!flow.ok()) {
        status = flow.status();
      } else if (*flow == Flow::kBreak) {
        break;
      }
    }
    if (status.ok() && n == 0 && node.bodies.size() > 1) {
      status = Exec(node.bodies[1], out).status();
    }
    return status;
  }

  Value MakeMacro(const Node& node) {
    const Node* macro = &node;
    return Value::Function([this, macro](const Arguments& a) -> absl::StatusOr<Value> {
      if (++call_depth_ > kMaxCallDepth) {
        --call_depth_;
        return Error(macro->line, "macros nested too deep");
      }
      scopes_.emplace_back();
      absl::Status status;
      for (size_t i = 0; i < macro->params.size() && status.ok(); ++i) {
        const std::string& name = macro->params[i];
        Value v = i < a.positional.size() ? a.positional[i] : Value::Undefined(name);
        for (const auto& [k, kv] : a.keywords) {
          if (k == name) v = kv;
        }
        if (v.is_undefined() && macro->defaults[i] != nullptr) {
          absl::StatusOr<Value> d = Eval(*macro->defaults[i]);
          if (d.ok()) v = *d; else status = d.status();
        }
        scopes_.back()[name] = v;
      }
      std::string out;
      if (status.ok()) status = Exec(macro->bodies[0], &out).status();
      scopes_.pop_back();
      --call_depth_;
      if (!status.ok()) return status;
      return Value(nlohmann::ordered_json(std::move(out)));
    });
  }

  absl::StatusOr<Arguments> EvalArguments(const Expr& e, size_t first) {
    Arguments a;
    for (size_t i = first; i < e.items.size(); ++i) {
      FLUXION_ASSIGN_OR_RETURN(Value v, Eval(*e.items[i]));
      a.positional.push_back(std::move(v));
    }
    for (const auto& [k, x] : e.keywords) {
      FLUXION_ASSIGN_OR_RETURN(Value v, Eval(*x));
      a.keywords.emplace_back(k, std::move(v));
    }
    return a;
  }

  absl::StatusOr<Value> Eval(const Expr& e) {
    FLUXION_RETURN_IF_ERROR(Step(e.line));
    switch (e.kind) {
      case Expr::Kind::kLiteral:
        return Value(e.literal);
      case Expr::Kind::kName:
        return Lookup(e.name);
      case Expr::Kind::kList: {
        nlohmann::ordered_json out = nlohmann::ordered_json::array();
        for (const ExprPtr& item : e.items) {
          FLUXION_ASSIGN_OR_RETURN(Value v, Eval(*item));
          out.push_back(v.json());
        }
        return Value(std::move(out));
      }
      case Expr::Kind::kDict: {
        nlohmann::ordered_json out = nlohmann::ordered_json::object();
        for (size_t i = 0; i + 1 < e.items.size(); i += 2) {
          FLUXION_ASSIGN_OR_RETURN(Value k, Eval(*e.items[i]));
          FLUXION_ASSIGN_OR_RETURN(Value v, Eval(*e.items[i + 1]));
          out[k.ToString()] = v.json();
        }
        return Value(std::move(out));
      }
      case Expr::Kind::kAttr: {
        FLUXION_ASSIGN_OR_RETURN(Value object, Eval(*e.items[0]));
        if (object.is_undefined()) {
          return Error(e.line, absl::StrCat("'", object.undefined_name(), "' is undefined (reading .",
                                            e.name, ")"));
        }
        return object.Member(e.name);
      }
      case Expr::Kind::kItem: {
        FLUXION_ASSIGN_OR_RETURN(Value object, Eval(*e.items[0]));
        FLUXION_ASSIGN_OR_RETURN(Value key, Eval(*e.items[1]));
        if (object.is_undefined()) {
          return Error(e.line, absl::StrCat("'", object.undefined_name(), "' is undefined (reading [",
                                            key.ToString(), "])"));
        }
        return object.Item(key);
      }
      case Expr::Kind::kSlice: {
        FLUXION_ASSIGN_OR_RETURN(Value object, Eval(*e.items[0]));
        std::optional<int64_t> bounds[3];
        for (int i = 0; i < 3; ++i) {
          if (e.items[i + 1] == nullptr) continue;
          FLUXION_ASSIGN_OR_RETURN(Value b, Eval(*e.items[i + 1]));
          if (b.json().is_null() || b.is_undefined()) continue;
          if (!b.json().is_number_integer()) return Error(e.line, "a slice bound is not an integer");
          bounds[i] = b.json().get<int64_t>();
        }
        return Slice(object, bounds[0], bounds[1], bounds[2], e.line);
      }
      case Expr::Kind::kCall:
        return EvalCall(e);
      case Expr::Kind::kFilter: {
        FLUXION_ASSIGN_OR_RETURN(Value subject, Eval(*e.items[0]));
        FLUXION_ASSIGN_OR_RETURN(Arguments a, EvalArguments(e, 1));
        absl::StatusOr<Value> v = ApplyFilter(e.name, subject, a);
        if (!v.ok()) return Error(e.line, std::string(v.status().message()));
        return v;
      }
      case Expr::Kind::kTest: {
        FLUXION_ASSIGN_OR_RETURN(Value subject, Eval(*e.items[0]));
        FLUXION_ASSIGN_OR_RETURN(Arguments a, EvalArguments(e, 1));
        absl::StatusOr<bool> r = ApplyTest(e.name, subject, a);
        if (!r.ok()) return Error(e.line, std::string(r.status().message()));
        return Value(nlohmann::ordered_json(*r != e.negated));
      }
      case Expr::Kind::kNot: {
        FLUXION_ASSIGN_OR_RETURN(Value v, Eval(*e.items[0]));
        return Value(nlohmann::ordered_json(!v.Truthy()));
      }
      case Expr::Kind::kNegate: {
        FLUXION_ASSIGN_OR_RETURN(Value v, Eval(*e.items[0]));
        absl::StatusOr<Value> r = BinaryOp("-", Value(nlohmann::ordered_json(0)), v);
        if (!r.ok()) return Error(e.line, std::string(r.status().message()));
        return r;
      }
      case Expr::Kind::kAnd: {
        FLUXION_ASSIGN_OR_RETURN(Value l, Eval(*e.items[0]));
        if (!l.Truthy()) return l;
        return Eval(*e.items[1]);
      }
      case Expr::Kind::kOr: {
        FLUXION_ASSIGN_OR_RETURN(Value l, Eval(*e.items[0]));
        if (l.Truthy()) return l;
        return Eval(*e.items[1]);
      }
      case Expr::Kind::kTernary: {
        FLUXION_ASSIGN_OR_RETURN(Value c, Eval(*e.items[1]));
        if (c.Truthy()) return Eval(*e.items[0]);
        if (e.items[2] == nullptr) return Value::Undefined();
        return Eval(*e.items[2]);
      }
      case Expr::Kind::kBinary: {
        FLUXION_ASSIGN_OR_RETURN(Value l, Eval(*e.items[0]));
        FLUXION_ASSIGN_OR_RETURN(Value r, Eval(*e.items[1]));
        absl::StatusOr<Value> v = BinaryOp(e.name, l, r);
        if (!v.ok()) return Error(e.line, std::string(v.status().message()));
        return v;
      }
    }
    return Error(e.line, "unknown expression");
  }

  absl::StatusOr<Value> EvalCall(const Expr& e) {
    FLUXION_ASSIGN_OR_RETURN(Arguments a, EvalArguments(e, 1));
    const Expr& callee = *e.items[0];
    if (callee.kind == Expr::Kind::kAttr) {  // a method of a value: "text".strip()
      FLUXION_ASSIGN_OR_RETURN(Value object, Eval(*callee.items[0]));
      if (object.is_json()) {
        absl::StatusOr<Value> r = CallMethod(object, callee.name, a);
        if (!r.ok()) return Error(e.line, std::string(r.status().message()));
        return r;
      }
      Value member = object.Member(callee.name);
      if (!member.is_callable()) {
        return Error(e.line, absl::StrCat("'", callee.name, "' cannot be called"));
      }
      return member.callable()(a);
    }
    FLUXION_ASSIGN_OR_RETURN(Value fn, Eval(callee));
    if (!fn.is_callable()) {
      return Error(e.line, absl::StrCat("'", callee.kind == Expr::Kind::kName ? callee.name : "value",
                                        "' is not a function"));
    }
    absl::StatusOr<Value> r = fn.callable()(a);
    if (!r.ok() && r.status().message().find("chat template line") == absl::string_view::npos &&
        callee.name != "raise_exception") {
      return Error(e.line, std::string(r.status().message()));
    }
    return r;
  }

  std::vector<absl::flat_hash_map<std::string, Value>> scopes_;
  int64_t now_;
  int64_t steps_ = 0;
  int call_depth_ = 0;
};

}  // namespace

absl::StatusOr<Template> Template::Parse(absl::string_view source) {
  FLUXION_ASSIGN_OR_RETURN(Body body, ParseTemplate(source));
  Template t;
  t.body_ = std::make_shared<const Body>(std::move(body));
  return t;
}

absl::StatusOr<std::string> Template::Render(const nlohmann::ordered_json& context, int64_t now) const {
  Renderer renderer(context, now);
  std::string out;
  FLUXION_RETURN_IF_ERROR(renderer.Run(*body_, &out));
  return out;
}

}  // namespace fluxion::model::jinja

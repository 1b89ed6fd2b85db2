// The parsed form of a Jinja template (model/jinja/parser.cc builds it, render.cc walks it).
#ifndef FLUXION_MODEL_JINJA_AST_H_
#define FLUXION_MODEL_JINJA_AST_H_

#include <memory>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"

namespace fluxion::model::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    kLiteral,   // json
    kName,      // name
    kList,      // items
    kDict,      // items: key, value, key, value, ...
    kAttr,      // items[0].name
    kItem,      // items[0][items[1]]
    kSlice,     // items[0][items[1]:items[2]:items[3]] (null entries: omitted)
    kCall,      // items[0](items[1..], keywords)
    kFilter,    // items[0] | name(items[1..], keywords)
    kTest,      // items[0] is [not] name(items[1..])
    kNot,       // not items[0]
    kNegate,    // -items[0]
    kBinary,    // items[0] op items[1]
    kAnd,
    kOr,
    kTernary,   // items[0] if items[1] else items[2] (items[2] null: undefined)
  };
  Kind kind;
  nlohmann::ordered_json literal;
  std::string name;  // a name, attribute, filter, test or operator
  bool negated = false;
  std::vector<ExprPtr> items;
  std::vector<std::pair<std::string, ExprPtr>> keywords;
  int line = 0;
};

struct Node;
using Body = std::vector<std::unique_ptr<Node>>;

struct Node {
  enum class Kind {
    kText,      // text
    kOutput,    // {{ expr }}
    kIf,        // conditions[i] -> bodies[i]; bodies.back() is the else when one longer
    kFor,       // for targets in expr [if condition]: bodies[0], else bodies[1]
    kSet,       // set targets[0][.attribute] = expr; or with no expr, set targets[0] = bodies[0]
    kMacro,     // macro targets[0](params; defaults) bodies[0]
    kBreak,
    kContinue,
  };
  Kind kind;
  std::string text;
  ExprPtr expr;
  std::vector<ExprPtr> conditions;
  std::vector<Body> bodies;
  std::vector<std::string> targets;
  std::string attribute;
  std::vector<std::string> params;
  std::vector<ExprPtr> defaults;  // per param; null when it has none
  int line = 0;
};

}  // namespace fluxion::model::jinja

#endif  // FLUXION_MODEL_JINJA_AST_H_

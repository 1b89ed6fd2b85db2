#include "model/jinja/parser.h"

#include <algorithm>
#include <cctype>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace fluxion::model::jinja {
namespace {

// How deep blocks and expressions may nest: the parser and the renderer walk them recursively,
// and real chat templates nest a few levels (a template comes from a model directory or a flag,
// and a file that nests deeper is refused rather than allowed to exhaust the stack).
constexpr int kMaxDepth = 100;

struct Token {
  enum Type { kText, kVarBegin, kVarEnd, kBlockBegin, kBlockEnd, kName, kString, kNumber, kOp };
  Type type;
  std::string text;
  int line;
};

absl::Status Error(int line, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("chat template line ", line, ": ", what));
}

bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

class Lexer {
 public:
  explicit Lexer(absl::string_view s) : s_(s) {}

  absl::StatusOr<std::vector<Token>> Run() {
    size_t pos = 0;
    bool strip_next = false;  // a `-` closed the previous tag
    while (pos < s_.size()) {
      size_t open = FindOpen(pos);
      std::string text(s_.substr(pos, open - pos));
      if (strip_next) text.erase(0, text.find_first_not_of(" \t\n\r") == std::string::npos
                                        ? text.size()
                                        : text.find_first_not_of(" \t\n\r"));
      strip_next = false;
      if (open == s_.size()) {
        Emit(Token::kText, std::move(text), pos);
        break;
      }
      const char kind = s_[open + 1];
      const char mark = open + 2 < s_.size() ? s_[open + 2] : '\0';
      if (mark == '-') {
        while (!text.empty() && IsSpace(text.back())) text.pop_back();
      } else if (mark != '+' && kind != '{') {
        LstripBlock(open, &text);
      }
      Emit(Token::kText, std::move(text), pos);
      const size_t inner = open + 2 + ((mark == '-' || mark == '+') ? 1 : 0);
      absl::StatusOr<size_t> next = kind == '#'   ? Comment(inner, &strip_next)
                                    : kind == '{' ? Tag(inner, false, &strip_next)
                                                  : Tag(inner, true, &strip_next);
      if (!next.ok()) return next.status();
      pos = *next;
    }
    return std::move(tokens_);
  }

 private:
  size_t FindOpen(size_t from) const {
    for (size_t i = from; i + 1 < s_.size(); ++i) {
      if (s_[i] == '{' && (s_[i + 1] == '{' || s_[i + 1] == '%' || s_[i + 1] == '#')) return i;
    }
    return s_.size();
  }

  // Positions are asked in (nearly) increasing order: count on from the last one.
  int LineAt(size_t pos) {
    pos = std::min(pos, s_.size());
    if (pos < line_pos_) {
      line_pos_ = 0;
      line_ = 1;
    }
    for (; line_pos_ < pos; ++line_pos_) line_ += s_[line_pos_] == '\n';
    return line_;
  }

  void Emit(Token::Type type, std::string text, size_t at) {
    if (type == Token::kText && text.empty()) return;
    tokens_.push_back({type, std::move(text), LineAt(at)});
  }

  // lstrip_blocks: spaces and tabs between the start of the line and a block tag go.
  void LstripBlock(size_t open, std::string* text) const {
    size_t i = open;
    while (i > 0 && (s_[i - 1] == ' ' || s_[i - 1] == '\t')) --i;
    if (i != 0 && s_[i - 1] != '\n') return;
    const size_t spaces = open - i;
    if (spaces <= text->size()) text->erase(text->size() - spaces);
  }

  // After a block tag or comment: `-` strips all following whitespace, else trim_blocks drops
  // one newline.
  size_t AfterBlock(size_t pos, bool dash, bool* strip_next) const {
    if (dash) {
      *strip_next = true;
      return pos;
    }
    if (pos < s_.size() && s_[pos] == '\n') return pos + 1;
    if (pos + 1 < s_.size() && s_[pos] == '\r' && s_[pos + 1] == '\n') return pos + 2;
    return pos;
  }

  absl::StatusOr<size_t> Comment(size_t pos, bool* strip_next) {
    const size_t end = s_.find("#}", pos);
    if (end == absl::string_view::npos) return Error(LineAt(pos), "unclosed comment");
    const bool dash = end > pos && s_[end - 1] == '-';
    return AfterBlock(end + 2, dash, strip_next);
  }

  // The tokens of one {{ }} or {% %} tag; returns the position after it.
  absl::StatusOr<size_t> Tag(size_t pos, bool block, bool* strip_next) {
    const char close = block ? '%' : '}';
    const size_t begin = tokens_.size();
    Emit(block ? Token::kBlockBegin : Token::kVarBegin, block ? "{%" : "{{", pos);
    while (true) {
      while (pos < s_.size() && IsSpace(s_[pos])) ++pos;
      if (pos >= s_.size()) return Error(LineAt(pos), "unclosed tag");
      const bool dash = s_[pos] == '-' && pos + 2 < s_.size() + 0 && s_.substr(pos + 1, 2) ==
                                                                        std::string{close, '}'};
      if (dash || s_.substr(pos, 2) == std::string{close, '}'}) {
        pos += dash ? 3 : 2;
        Emit(block ? Token::kBlockEnd : Token::kVarEnd, "", pos);
        if (block && tokens_.size() > begin + 2 && tokens_[begin + 1].text == "raw") {
          return Raw(pos, dash, strip_next, begin);
        }
        if (!block) {
          *strip_next = dash;
          return pos;
        }
        return AfterBlock(pos, dash, strip_next);
      }
      FLUXION_ASSIGN_OR_RETURN(pos, Inner(pos));
    }
  }

  // {% raw %} ... {% endraw %}: the text between, verbatim.
  absl::StatusOr<size_t> Raw(size_t pos, bool dash, bool* strip_next, size_t begin) {
    tokens_.resize(begin);
    size_t start = AfterBlock(pos, dash, strip_next);
    for (size_t at = s_.find("{%", start); at != absl::string_view::npos;
         at = s_.find("{%", at + 2)) {
      size_t i = at + 2;
      if (i < s_.size() && (s_[i] == '-' || s_[i] == '+')) ++i;
      while (i < s_.size() && IsSpace(s_[i])) ++i;
      if (s_.substr(i, 6) != "endraw") continue;
      std::string text(s_.substr(start, at - start));
      if (*strip_next) text.erase(0, text.find_first_not_of(" \t\n\r"));
      *strip_next = false;
      Emit(Token::kText, std::move(text), start);
      const size_t end = s_.find("%}", i);
      if (end == absl::string_view::npos) return Error(LineAt(at), "unclosed endraw");
      return AfterBlock(end + 2, s_[end - 1] == '-', strip_next);
    }
    return Error(LineAt(pos), "raw without endraw");
  }

  absl::StatusOr<size_t> Inner(size_t pos) {
    const char c = s_[pos];
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t end = pos;
      while (end < s_.size() && (std::isalnum(static_cast<unsigned char>(s_[end])) || s_[end] == '_')) {
        ++end;
      }
      Emit(Token::kName, std::string(s_.substr(pos, end - pos)), pos);
      return end;
    }
    if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t end = pos;
      while (end < s_.size() && (std::isdigit(static_cast<unsigned char>(s_[end])) ||
                                 (s_[end] == '.' && end + 1 < s_.size() &&
                                  std::isdigit(static_cast<unsigned char>(s_[end + 1]))))) {
        ++end;
      }
      // An exponent: 1e20, 2.5E-3.
      if (end < s_.size() && (s_[end] == 'e' || s_[end] == 'E')) {
        size_t e = end + 1;
        if (e < s_.size() && (s_[e] == '+' || s_[e] == '-')) ++e;
        if (e < s_.size() && std::isdigit(static_cast<unsigned char>(s_[e]))) {
          while (e < s_.size() && std::isdigit(static_cast<unsigned char>(s_[e]))) ++e;
          end = e;
        }
      }
      Emit(Token::kNumber, std::string(s_.substr(pos, end - pos)), pos);
      return end;
    }
    if (c == '\'' || c == '"') return String(pos);
    static constexpr const char* kTwo[] = {"**", "//", "==", "!=", "<=", ">="};
    for (const char* op : kTwo) {
      if (s_.substr(pos, 2) == op) {
        Emit(Token::kOp, op, pos);
        return pos + 2;
      }
    }
    if (std::string("+-*/%~<>()[]{}.,:|=!").find(c) != std::string::npos) {
      Emit(Token::kOp, std::string(1, c), pos);
      return pos + 1;
    }
    return Error(LineAt(pos), absl::StrCat("unexpected character '", std::string(1, c), "'"));
  }

  absl::StatusOr<size_t> String(size_t pos) {
    const char quote = s_[pos];
    std::string out;
    for (size_t i = pos + 1; i < s_.size(); ++i) {
      const char c = s_[i];
      if (c == quote) {
        Emit(Token::kString, std::move(out), pos);
        return i + 1;
      }
      if (c != '\\' || i + 1 >= s_.size()) {
        out += c;
        continue;
      }
      const char e = s_[++i];
      switch (e) {
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case '\\': out += '\\'; break;
        case '\'': out += '\''; break;
        case '"': out += '"'; break;
        default: out += '\\'; out += e;
      }
    }
    return Error(LineAt(pos), "unclosed string");
  }

  absl::string_view s_;
  std::vector<Token> tokens_;
  size_t line_pos_ = 0;
  int line_ = 1;
};

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : t_(std::move(tokens)) {}

  absl::StatusOr<Body> Run() {
    std::string end;
    FLUXION_ASSIGN_OR_RETURN(Body body, ParseBody({}, &end));
    return body;
  }

 private:
  const Token* Peek(size_t ahead = 0) const {
    return pos_ + ahead < t_.size() ? &t_[pos_ + ahead] : nullptr;
  }
  int Line() const { return pos_ < t_.size() ? t_[pos_].line : (t_.empty() ? 1 : t_.back().line); }
  bool IsOp(const char* op, size_t ahead = 0) const {
    const Token* t = Peek(ahead);
    return t != nullptr && t->type == Token::kOp && t->text == op;
  }
  bool IsName(const char* name, size_t ahead = 0) const {
    const Token* t = Peek(ahead);
    return t != nullptr && t->type == Token::kName && t->text == name;
  }
  absl::Status Expect(Token::Type type, const char* text) {
    const Token* t = Peek();
    if (t == nullptr || t->type != type || (text != nullptr && t->text != text)) {
      return Error(Line(), absl::StrCat("expected ", text != nullptr ? text : "a tag end", ", got '",
                                        t != nullptr ? t->text : "end of template", "'"));
    }
    ++pos_;
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> ExpectName() {
    const Token* t = Peek();
    if (t == nullptr || t->type != Token::kName) return Error(Line(), "expected a name");
    ++pos_;
    return t->text;
  }

  // Statements until a block tag whose first word is in `ends` (left unconsumed after `{%`:
  // *end names it); at top level (ends empty) until the end of the template.
  absl::StatusOr<Body> ParseBody(const std::vector<std::string>& ends, std::string* end) {
    if (++depth_ > kMaxDepth) return Error(Line(), "blocks nested too deep");
    Body body;
    while (pos_ < t_.size()) {
      const Token& t = t_[pos_];
      if (t.type == Token::kText) {
        auto node = std::make_unique<Node>();
        node->kind = Node::Kind::kText;
        node->text = t.text;
        body.push_back(std::move(node));
        ++pos_;
      } else if (t.type == Token::kVarBegin) {
        ++pos_;
        auto node = std::make_unique<Node>();
        node->kind = Node::Kind::kOutput;
        node->line = t.line;
        FLUXION_ASSIGN_OR_RETURN(node->expr, ParseChecked(&Parser::ParseExpr));
        FLUXION_RETURN_IF_ERROR(Expect(Token::kVarEnd, nullptr));
        body.push_back(std::move(node));
      } else {
        const Token* word = Peek(1);
        if (word == nullptr || word->type != Token::kName) return Error(t.line, "empty tag");
        for (const std::string& e : ends) {
          if (word->text == e) {
            pos_ += 2;  // `{%` and the word
            *end = e;
            --depth_;
            return body;
          }
        }
        pos_ += 2;
        FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<Node> node, ParseStatement(word->text, t.line));
        if (node != nullptr) body.push_back(std::move(node));
      }
    }
    if (!ends.empty()) return Error(Line(), absl::StrCat("missing {% ", ends.back(), " %}"));
    --depth_;
    return body;
  }

  absl::StatusOr<std::unique_ptr<Node>> ParseStatement(const std::string& word, int line) {
    auto node = std::make_unique<Node>();
    node->line = line;
    std::string end;
    if (word == "if") {
      node->kind = Node::Kind::kIf;
      while (true) {
        FLUXION_ASSIGN_OR_RETURN(ExprPtr cond, ParseChecked(&Parser::ParseExpr));
        node->conditions.push_back(std::move(cond));
        FLUXION_RETURN_IF_ERROR(Expect(Token::kBlockEnd, nullptr));
        FLUXION_ASSIGN_OR_RETURN(Body body, ParseBody({"elif", "else", "endif"}, &end));
        node->bodies.push_back(std::move(body));
        if (end == "elif") continue;
        FLUXION_RETURN_IF_ERROR(Expect(Token::kBlockEnd, nullptr));
        if (end == "else") {
          FLUXION_ASSIGN_OR_RETURN(Body otherwise, ParseBody({"endif"}, &end));
          node->bodies.push_back(std::move(otherwise));
          FLUXION_RETURN_IF_ERROR(Expect(Token::kBlockEnd, nullptr));
        }
        return node;
      }
    }
    if (word == "for") {
      node->kind = Node::Kind::kFor;
      do {
        FLUXION_ASSIGN_OR_RETURN(std::string target, ExpectName());
        node->targets.push_back(std::move(target));
      } while (IsOp(",") && (++pos_, true));
      FLUXION_RETURN_IF_ERROR(Expect(Token::kName, "in"));
      // No ternary: `if` filters the loop.
      FLUXION_ASSIGN_OR_RETURN(node->expr, ParseChecked(&Parser::ParseOr));
      if (IsName("if")) {
        ++pos_;
        FLUXION_ASSIGN_OR_RETURN(ExprPtr cond, ParseChecked(&Parser::ParseOr));
        node->conditions.push_back(std::move(cond));
      }
      FLUXION_RETURN_IF_ERROR(Expect(Token::kBlockEnd, nullptr));
      FLUXION_ASSIGN_OR_RETURN(Body body, ParseBody({"else", "endfor"}, &end));
      node->bodies.push_back(std::move(body));
      FLUXION_RETURN_IF_ERROR(Expect(Token::kBlockEnd, nullptr));
      if (end == "else") {
        FLUXION_ASSIGN_OR_RETURN(Body otherwise, ParseBody({"endfor"}, &end));
        node->bodies.push_back(std::move(otherwise));
        FLUXION_RETURN_IF_ERROR(Expect(Token::kBlockEnd, nullptr));
      }
      return node;
    }
    if (word == "set") {
      node->kind = Node::Kind::kSet;
      FLUXION_ASSIGN_OR_RETURN(std::string target, ExpectName());
      node->targets.push_back(std::move(target));
      if (IsOp(".")) {
        ++pos_;
        FLUXION_ASSIGN_OR_RETURN(node->attribute, ExpectName());
      }
      while (IsOp(",")) {
        ++pos_;
        FLUXION_ASSIGN_OR_RETURN(std::string more, ExpectName());
        node->targets.push_back(std::move(more));
      }
      if (IsOp("=")) {
        ++pos_;
        FLUXION_ASSIGN_OR_RETURN(node->expr, ParseChecked(&Parser::ParseExpr));
        FLUXION_RETURN_IF_ERROR(Expect(Token::kBlockEnd, nullptr));
        return node;
      }
      FLUXION_RETURN_IF_ERROR(Expect(Token::kBlockEnd, nullptr));
      FLUXION_ASSIGN_OR_RETURN(Body body, ParseBody({"endset"}, &end));
      node->bodies.push_back(std::move(body));
      FLUXION_RETURN_IF_ERROR(Expect(Token::kBlockEnd, nullptr));
      return node;
    }
    if (word == "macro") {
      node->kind = Node::Kind::kMacro;
      FLUXION_ASSIGN_OR_RETURN(std::string name, ExpectName());
      node->targets.push_back(std::move(name));
      FLUXION_RETURN_IF_ERROR(Expect(Token::kOp, "("));
      while (!IsOp(")")) {
        FLUXION_ASSIGN_OR_RETURN(std::string param, ExpectName());
        node->params.push_back(std::move(param));
        ExprPtr fallback;
        if (IsOp("=")) {
          ++pos_;
          FLUXION_ASSIGN_OR_RETURN(fallback, ParseChecked(&Parser::ParseExpr));
        }
        node->defaults.push_back(std::move(fallback));
        if (!IsOp(")")) FLUXION_RETURN_IF_ERROR(Expect(Token::kOp, ","));
      }
      ++pos_;
      FLUXION_RETURN_IF_ERROR(Expect(Token::kBlockEnd, nullptr));
      FLUXION_ASSIGN_OR_RETURN(Body body, ParseBody({"endmacro"}, &end));
      node->bodies.push_back(std::move(body));
      FLUXION_RETURN_IF_ERROR(Expect(Token::kBlockEnd, nullptr));
      return node;
    }
    if (word == "break" || word == "continue") {
      node->kind = word == "break" ? Node::Kind::kBreak : Node::Kind::kContinue;
      FLUXION_RETURN_IF_ERROR(Expect(Token::kBlockEnd, nullptr));
      return node;
    }
    if (word == "generation") {  // transformers' assistant-mask marker: renders its body
      FLUXION_RETURN_IF_ERROR(Expect(Token::kBlockEnd, nullptr));
      FLUXION_ASSIGN_OR_RETURN(Body body, ParseBody({"endgeneration"}, &end));
      FLUXION_RETURN_IF_ERROR(Expect(Token::kBlockEnd, nullptr));
      node->kind = Node::Kind::kIf;
      ExprPtr yes = std::make_unique<Expr>();
      yes->kind = Expr::Kind::kLiteral;
      yes->literal = true;
      node->conditions.push_back(std::move(yes));
      node->bodies.push_back(std::move(body));
      return node;
    }
    return Error(line, absl::StrCat("unsupported tag '", word, "'"));
  }

  // A statement's expression, its tree no deeper than kMaxDepth: rendering walks it recursively,
  // and a left-nested chain (`a ~ b ~ c ~ ...`) is parsed by a loop, so depth is checked here,
  // without recursion.
  absl::StatusOr<ExprPtr> ParseChecked(absl::StatusOr<ExprPtr> (Parser::*parse)()) {
    FLUXION_ASSIGN_OR_RETURN(ExprPtr e, (this->*parse)());
    std::vector<std::pair<const Expr*, int>> stack = {{e.get(), 1}};
    while (!stack.empty()) {
      const auto [x, depth] = stack.back();
      stack.pop_back();
      if (depth > kMaxDepth) return Error(x->line, "expression nested too deep");
      for (const ExprPtr& child : x->items) {
        if (child != nullptr) stack.push_back({child.get(), depth + 1});
      }
      for (const auto& [name, child] : x->keywords) stack.push_back({child.get(), depth + 1});
    }
    return e;
  }

  // --- Expressions, Jinja's precedence from loosest to tightest ---

  static ExprPtr Make(Expr::Kind kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }

  absl::StatusOr<ExprPtr> ParseExpr() {
    if (++depth_ > kMaxDepth) return Error(Line(), "expression nested too deep");
    FLUXION_ASSIGN_OR_RETURN(ExprPtr value, ParseOr());
    if (IsName("if")) {
      ++pos_;
      auto e = Make(Expr::Kind::kTernary, Line());
      FLUXION_ASSIGN_OR_RETURN(ExprPtr cond, ParseOr());
      ExprPtr otherwise;
      if (IsName("else")) {
        ++pos_;
        FLUXION_ASSIGN_OR_RETURN(otherwise, ParseExpr());
      }
      e->items.push_back(std::move(value));
      e->items.push_back(std::move(cond));
      e->items.push_back(std::move(otherwise));
      value = std::move(e);
    }
    --depth_;
    return value;
  }

  absl::StatusOr<ExprPtr> ParseOr() {
    FLUXION_ASSIGN_OR_RETURN(ExprPtr left, ParseAnd());
    while (IsName("or")) {
      ++pos_;
      auto e = Make(Expr::Kind::kOr, Line());
      FLUXION_ASSIGN_OR_RETURN(ExprPtr right, ParseAnd());
      e->items.push_back(std::move(left));
      e->items.push_back(std::move(right));
      left = std::move(e);
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseAnd() {
    FLUXION_ASSIGN_OR_RETURN(ExprPtr left, ParseNot());
    while (IsName("and")) {
      ++pos_;
      auto e = Make(Expr::Kind::kAnd, Line());
      FLUXION_ASSIGN_OR_RETURN(ExprPtr right, ParseNot());
      e->items.push_back(std::move(left));
      e->items.push_back(std::move(right));
      left = std::move(e);
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseNot() {
    if (IsName("not")) {
      if (++depth_ > kMaxDepth) return Error(Line(), "expression nested too deep");
      ++pos_;
      auto e = Make(Expr::Kind::kNot, Line());
      FLUXION_ASSIGN_OR_RETURN(ExprPtr inner, ParseNot());
      e->items.push_back(std::move(inner));
      --depth_;
      return e;
    }
    return ParseCompare();
  }

  absl::StatusOr<ExprPtr> ParseCompare() {
    FLUXION_ASSIGN_OR_RETURN(ExprPtr left, ParseMath1());
    while (true) {
      std::string op;
      if (IsOp("==") || IsOp("!=") || IsOp("<") || IsOp(">") || IsOp("<=") || IsOp(">=")) {
        op = Peek()->text;
        ++pos_;
      } else if (IsName("in")) {
        op = "in";
        ++pos_;
      } else if (IsName("not") && IsName("in", 1)) {
        op = "not in";
        pos_ += 2;
      } else {
        return left;
      }
      auto e = Make(Expr::Kind::kBinary, Line());
      e->name = op;
      FLUXION_ASSIGN_OR_RETURN(ExprPtr right, ParseMath1());
      e->items.push_back(std::move(left));
      e->items.push_back(std::move(right));
      left = std::move(e);
    }
  }

  absl::StatusOr<ExprPtr> Binary(ExprPtr left, std::string op,
                                 absl::StatusOr<ExprPtr> (Parser::*next)()) {
    auto e = Make(Expr::Kind::kBinary, Line());
    e->name = std::move(op);
    FLUXION_ASSIGN_OR_RETURN(ExprPtr right, (this->*next)());
    e->items.push_back(std::move(left));
    e->items.push_back(std::move(right));
    return e;
  }

  absl::StatusOr<ExprPtr> ParseMath1() {  // + -
    FLUXION_ASSIGN_OR_RETURN(ExprPtr left, ParseConcat());
    while (IsOp("+") || IsOp("-")) {
      std::string op = Peek()->text;
      ++pos_;
      FLUXION_ASSIGN_OR_RETURN(left, Binary(std::move(left), op, &Parser::ParseConcat));
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseConcat() {  // ~
    FLUXION_ASSIGN_OR_RETURN(ExprPtr left, ParseMath2());
    while (IsOp("~")) {
      ++pos_;
      FLUXION_ASSIGN_OR_RETURN(left, Binary(std::move(left), "~", &Parser::ParseMath2));
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseMath2() {  // * / // %
    FLUXION_ASSIGN_OR_RETURN(ExprPtr left, ParsePow());
    while (IsOp("*") || IsOp("/") || IsOp("//") || IsOp("%")) {
      std::string op = Peek()->text;
      ++pos_;
      FLUXION_ASSIGN_OR_RETURN(left, Binary(std::move(left), op, &Parser::ParsePow));
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParsePow() {
    FLUXION_ASSIGN_OR_RETURN(ExprPtr left, ParseUnary());
    while (IsOp("**")) {
      ++pos_;
      FLUXION_ASSIGN_OR_RETURN(left, Binary(std::move(left), "**", &Parser::ParseUnary));
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseUnary() {
    if (IsOp("-") || IsOp("+")) {
      if (++depth_ > kMaxDepth) return Error(Line(), "expression nested too deep");
      const bool minus = IsOp("-");
      ++pos_;
      FLUXION_ASSIGN_OR_RETURN(ExprPtr inner, ParseUnary());
      --depth_;
      if (!minus) return inner;
      auto e = Make(Expr::Kind::kNegate, Line());
      e->items.push_back(std::move(inner));
      return e;
    }
    FLUXION_ASSIGN_OR_RETURN(ExprPtr value, ParsePrimary());
    FLUXION_ASSIGN_OR_RETURN(value, ParsePostfix(std::move(value)));
    while (IsOp("|")) {
      ++pos_;
      auto e = Make(Expr::Kind::kFilter, Line());
      FLUXION_ASSIGN_OR_RETURN(e->name, ExpectName());
      e->items.push_back(std::move(value));
      if (IsOp("(")) FLUXION_RETURN_IF_ERROR(ParseArguments(e.get()));
      value = std::move(e);
      FLUXION_ASSIGN_OR_RETURN(value, ParsePostfix(std::move(value)));
    }
    while (IsName("is")) {
      ++pos_;
      auto e = Make(Expr::Kind::kTest, Line());
      if (IsName("not")) {
        ++pos_;
        e->negated = true;
      }
      // `none`, `true`, `false` are test names here, not literals.
      const Token* t = Peek();
      if (t == nullptr || t->type != Token::kName) return Error(Line(), "expected a test name");
      e->name = t->text;
      ++pos_;
      e->items.push_back(std::move(value));
      if (IsOp("(")) {
        FLUXION_RETURN_IF_ERROR(ParseArguments(e.get()));
      } else if (const Token* arg = Peek(); arg != nullptr &&
                 (arg->type == Token::kString || arg->type == Token::kNumber ||
                  (arg->type == Token::kName && arg->text != "and" && arg->text != "or" &&
                   arg->text != "if" && arg->text != "else" && arg->text != "is"))) {
        FLUXION_ASSIGN_OR_RETURN(ExprPtr one, ParsePrimary());  // `is divisibleby 3`
        e->items.push_back(std::move(one));
      }
      value = std::move(e);
    }
    return value;
  }

  absl::Status ParseArguments(Expr* e) {
    FLUXION_RETURN_IF_ERROR(Expect(Token::kOp, "("));
    while (!IsOp(")")) {
      if (Peek() != nullptr && Peek()->type == Token::kName && IsOp("=", 1)) {
        std::string key = Peek()->text;
        pos_ += 2;
        FLUXION_ASSIGN_OR_RETURN(ExprPtr value, ParseExpr());
        e->keywords.emplace_back(std::move(key), std::move(value));
      } else {
        FLUXION_ASSIGN_OR_RETURN(ExprPtr value, ParseExpr());
        e->items.push_back(std::move(value));
      }
      if (!IsOp(")")) FLUXION_RETURN_IF_ERROR(Expect(Token::kOp, ","));
    }
    ++pos_;
    return absl::OkStatus();
  }

  absl::StatusOr<ExprPtr> ParsePostfix(ExprPtr value) {
    while (true) {
      if (IsOp(".")) {
        ++pos_;
        auto e = Make(Expr::Kind::kAttr, Line());
        const Token* t = Peek();
        if (t == nullptr || (t->type != Token::kName && t->type != Token::kNumber)) {
          return Error(Line(), "expected an attribute name");
        }
        e->name = t->text;
        ++pos_;
        e->items.push_back(std::move(value));
        value = std::move(e);
      } else if (IsOp("[")) {
        ++pos_;
        ExprPtr parts[3];
        bool slice = false;
        for (int i = 0; i < 3; ++i) {
          if (!IsOp(":") && !IsOp("]")) {
            FLUXION_ASSIGN_OR_RETURN(parts[i], ParseExpr());
          }
          if (i < 2 && IsOp(":")) {
            ++pos_;
            slice = true;
            continue;
          }
          break;
        }
        FLUXION_RETURN_IF_ERROR(Expect(Token::kOp, "]"));
        if (!slice && parts[0] == nullptr) return Error(Line(), "empty subscript []");
        auto e = Make(slice ? Expr::Kind::kSlice : Expr::Kind::kItem, Line());
        e->items.push_back(std::move(value));
        for (int i = 0; i < (slice ? 3 : 1); ++i) e->items.push_back(std::move(parts[i]));
        value = std::move(e);
      } else if (IsOp("(")) {
        auto e = Make(Expr::Kind::kCall, Line());
        e->items.push_back(std::move(value));
        FLUXION_RETURN_IF_ERROR(ParseArguments(e.get()));
        value = std::move(e);
      } else {
        return value;
      }
    }
  }

  absl::StatusOr<ExprPtr> ParsePrimary() {
    const Token* t = Peek();
    if (t == nullptr) return Error(Line(), "expected an expression");
    const int line = t->line;
    if (t->type == Token::kString) {
      auto e = Make(Expr::Kind::kLiteral, line);
      std::string s = t->text;
      ++pos_;
      while (Peek() != nullptr && Peek()->type == Token::kString) s += t_[pos_++].text;
      e->literal = s;
      return e;
    }
    if (t->type == Token::kNumber) {
      auto e = Make(Expr::Kind::kLiteral, line);
      if (t->text.find_first_of(".eE") != std::string::npos) {
        double x = 0;
        if (!absl::SimpleAtod(t->text, &x)) return Error(line, "a number out of range");
        e->literal = x;
      } else {
        int64_t x = 0;
        if (!absl::SimpleAtoi(t->text, &x)) return Error(line, "an integer out of range");
        e->literal = x;
      }
      ++pos_;
      return e;
    }
    if (t->type == Token::kName) {
      const std::string& n = t->text;
      auto e = Make(Expr::Kind::kLiteral, line);
      ++pos_;
      if (n == "true" || n == "True") {
        e->literal = true;
      } else if (n == "false" || n == "False") {
        e->literal = false;
      } else if (n == "none" || n == "None") {
        e->literal = nullptr;
      } else {
        e->kind = Expr::Kind::kName;
        e->name = n;
      }
      return e;
    }
    if (IsOp("(")) {
      ++pos_;
      FLUXION_ASSIGN_OR_RETURN(ExprPtr inner, ParseExpr());
      if (IsOp(",")) {  // a tuple: a list here
        auto list = Make(Expr::Kind::kList, line);
        list->items.push_back(std::move(inner));
        while (IsOp(",")) {
          ++pos_;
          if (IsOp(")")) break;
          FLUXION_ASSIGN_OR_RETURN(ExprPtr more, ParseExpr());
          list->items.push_back(std::move(more));
        }
        inner = std::move(list);
      }
      FLUXION_RETURN_IF_ERROR(Expect(Token::kOp, ")"));
      return inner;
    }
    if (IsOp("[")) {
      ++pos_;
      auto e = Make(Expr::Kind::kList, line);
      while (!IsOp("]")) {
        FLUXION_ASSIGN_OR_RETURN(ExprPtr item, ParseExpr());
        e->items.push_back(std::move(item));
        if (!IsOp("]")) FLUXION_RETURN_IF_ERROR(Expect(Token::kOp, ","));
      }
      ++pos_;
      return e;
    }
    if (IsOp("{")) {
      ++pos_;
      auto e = Make(Expr::Kind::kDict, line);
      while (!IsOp("}")) {
        FLUXION_ASSIGN_OR_RETURN(ExprPtr key, ParseExpr());
        FLUXION_RETURN_IF_ERROR(Expect(Token::kOp, ":"));
        FLUXION_ASSIGN_OR_RETURN(ExprPtr value, ParseExpr());
        e->items.push_back(std::move(key));
        e->items.push_back(std::move(value));
        if (!IsOp("}")) FLUXION_RETURN_IF_ERROR(Expect(Token::kOp, ","));
      }
      ++pos_;
      return e;
    }
    return Error(line, absl::StrCat("unexpected '", t->text, "'"));
  }

  std::vector<Token> t_;
  size_t pos_ = 0;
  int depth_ = 0;
};

}  // namespace

absl::StatusOr<Body> ParseTemplate(absl::string_view source) {
  FLUXION_ASSIGN_OR_RETURN(std::vector<Token> tokens, Lexer(source).Run());
  return Parser(std::move(tokens)).Run();
}

}  // namespace fluxion::model::jinja

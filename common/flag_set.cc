#include "common/flag_set.h"

#include <iostream>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/match.h"
#include "absl/strings/strip.h"

namespace fluxion {
namespace {

absl::Status BadValue(const std::string& name, absl::string_view value, absl::string_view want) {
  return absl::InvalidArgumentError(
      absl::StrCat("--", name, ": cannot parse '", value, "' as ", want));
}

template <typename T, typename ParseOne>
std::function<absl::Status(absl::string_view)> ListAssigner(const std::string& name,
                                                            std::vector<T>* out, ParseOne parse,
                                                            const char* want) {
  return [name, out, parse, want](absl::string_view text) -> absl::Status {
    std::vector<T> values;
    for (absl::string_view piece : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
      T v;
      if (!parse(absl::StripAsciiWhitespace(piece), &v)) return BadValue(name, piece, want);
      values.push_back(std::move(v));
    }
    if (values.empty()) return BadValue(name, text, want);
    *out = std::move(values);
    return absl::OkStatus();
  };
}

}  // namespace

FlagSet::FlagSet(std::string command, std::string summary)
    : command_(std::move(command)), summary_(std::move(summary)) {}

void FlagSet::Add(const std::string& name, Flag flag) {
  order_.push_back(name);
  flags_[name] = std::move(flag);
}

void FlagSet::String(const std::string& name, std::string* out, const std::string& help) {
  Add(name, Flag{help, *out, false, false, false, [out](absl::string_view v) {
                   *out = std::string(v);
                   return absl::OkStatus();
                 }});
}

void FlagSet::Int(const std::string& name, int64_t* out, const std::string& help) {
  Add(name, Flag{help, absl::StrCat(*out), false, false, false,
                 [name, out](absl::string_view v) {
                   return absl::SimpleAtoi(v, out) ? absl::OkStatus()
                                                   : BadValue(name, v, "an integer");
                 }});
}

void FlagSet::Double(const std::string& name, double* out, const std::string& help) {
  Add(name, Flag{help, absl::StrCat(*out), false, false, false,
                 [name, out](absl::string_view v) {
                   return absl::SimpleAtod(v, out) ? absl::OkStatus()
                                                   : BadValue(name, v, "a number");
                 }});
}

void FlagSet::Bool(const std::string& name, bool* out, const std::string& help) {
  Add(name, Flag{help, *out ? "true" : "false", true, false, false,
                 [name, out](absl::string_view v) {
                   return absl::SimpleAtob(v, out) ? absl::OkStatus()
                                                   : BadValue(name, v, "true/false");
                 }});
}

void FlagSet::IntList(const std::string& name, std::vector<int64_t>* out,
                      const std::string& help) {
  auto parse = [](absl::string_view s, int64_t* v) { return absl::SimpleAtoi(s, v); };
  Add(name, Flag{help, absl::StrJoin(*out, ","), false, false, false,
                 ListAssigner<int64_t>(name, out, parse, "a comma list of integers")});
}

void FlagSet::DoubleList(const std::string& name, std::vector<double>* out,
                         const std::string& help) {
  auto parse = [](absl::string_view s, double* v) { return absl::SimpleAtod(s, v); };
  Add(name, Flag{help, absl::StrJoin(*out, ","), false, false, false,
                 ListAssigner<double>(name, out, parse, "a comma list of numbers")});
}

void FlagSet::StringList(const std::string& name, std::vector<std::string>* out,
                         const std::string& help) {
  auto parse = [](absl::string_view s, std::string* v) {
    *v = std::string(s);
    return !s.empty();
  };
  Add(name, Flag{help, absl::StrJoin(*out, ","), false, false, false,
                 ListAssigner<std::string>(name, out, parse, "a comma list of names")});
}

void FlagSet::Require(const std::string& name) {
  auto it = flags_.find(name);
  if (it != flags_.end()) it->second.required = true;
}

bool FlagSet::WasSet(const std::string& name) const {
  auto it = flags_.find(name);
  return it != flags_.end() && it->second.set;
}

absl::Status FlagSet::Parse(const std::vector<std::string>& args) {
  for (size_t i = 0; i < args.size(); ++i) {
    absl::string_view arg = args[i];
    if (arg == "--help" || arg == "-h") {
      help_requested_ = true;
      continue;
    }
    if (!absl::ConsumePrefix(&arg, "--")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unexpected argument '", arg, "' (flags start with --; see ", command_, " --help)"));
    }
    std::string name;
    std::string value;
    bool has_value = false;
    if (size_t eq = arg.find('='); eq != absl::string_view::npos) {
      name = std::string(arg.substr(0, eq));
      value = std::string(arg.substr(eq + 1));
      has_value = true;
    } else {
      name = std::string(arg);
    }
    auto it = flags_.find(name);
    if (it == flags_.end() && !has_value && absl::StartsWith(name, "no")) {
      auto neg = flags_.find(name.substr(2));
      if (neg != flags_.end() && neg->second.is_bool) {
        neg->second.set = true;
        auto status = neg->second.assign("false");
        if (!status.ok()) return status;
        continue;
      }
    }
    if (it == flags_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag --", name, " (see ", command_, " --help)"));
    }
    Flag& flag = it->second;
    if (!has_value) {
      if (flag.is_bool) {
        value = "true";
      } else if (i + 1 < args.size()) {
        value = args[++i];
      } else {
        return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
      }
    }
    flag.set = true;
    if (absl::Status s = flag.assign(value); !s.ok()) return s;
  }
  if (help_requested_) return absl::OkStatus();
  for (const auto& name : order_) {
    const Flag& flag = flags_.at(name);
    if (flag.required && !flag.set) {
      return absl::InvalidArgumentError(
          absl::StrCat("missing required flag --", name, " (see ", command_, " --help)"));
    }
  }
  return absl::OkStatus();
}

std::string FlagSet::Usage() const {
  std::string out = absl::StrCat("usage: ", command_, " [flags]\n", summary_, "\n\nflags:\n");
  for (const auto& name : order_) {
    const Flag& flag = flags_.at(name);
    absl::StrAppend(&out, "  --", name, flag.is_bool ? "" : " VALUE", "\n      ", flag.help);
    if (flag.required) {
      absl::StrAppend(&out, " (required)");
    } else if (!flag.default_text.empty()) {
      absl::StrAppend(&out, " (default: ", flag.default_text, ")");
    }
    absl::StrAppend(&out, "\n");
  }
  return out;
}

int ParseFlagsOrExit(FlagSet& flags, const std::vector<std::string>& args) {
  absl::Status status = flags.Parse(args);
  if (!status.ok()) {
    std::cerr << "error: " << status.message() << "\n";
    return 2;
  }
  if (flags.help_requested()) {
    std::cout << flags.Usage();
    return 0;
  }
  return -1;
}

}  // namespace fluxion

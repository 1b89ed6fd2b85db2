// Per-subcommand command-line flags for the one `fluxion` binary.
//
// Why not absl flags: they are process-global, so every subcommand would accept (and --help would
// list) every other subcommand's flags. A FlagSet belongs to one subcommand, rejects unknown flags
// with a message naming them, and prints only its own usage.
//
// Syntax: `--name value`, `--name=value`; bools also as bare `--name` and `--noname`; lists are
// comma-separated (`--contexts 4096,131072`). `--help` sets help_requested().
//
// Thread-compatible: configure and parse from one thread.
#ifndef FLUXION_COMMON_FLAG_SET_H_
#define FLUXION_COMMON_FLAG_SET_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace fluxion {

class FlagSet {
 public:
  // `command` is the usage line ("fluxion generate"); `summary` one sentence on what it does.
  FlagSet(std::string command, std::string summary);

  // Registers a flag writing into `*out`, which must outlive Parse(). The value already in `*out`
  // is the default shown in Usage().
  void String(const std::string& name, std::string* out, const std::string& help);
  void Int(const std::string& name, int64_t* out, const std::string& help);
  void Double(const std::string& name, double* out, const std::string& help);
  void Bool(const std::string& name, bool* out, const std::string& help);
  void IntList(const std::string& name, std::vector<int64_t>* out, const std::string& help);
  void DoubleList(const std::string& name, std::vector<double>* out, const std::string& help);
  void StringList(const std::string& name, std::vector<std::string>* out, const std::string& help);

  // Marks a registered flag as required: Parse() fails if it is absent (unless --help).
  void Require(const std::string& name);

  // Parses `args` (flags only; the subcommand name already removed). Returns InvalidArgument naming
  // the flag for unknown flags, missing values, unparsable values and missing required flags.
  absl::Status Parse(const std::vector<std::string>& args);

  // True when was(name) was given on the command line.
  bool WasSet(const std::string& name) const;
  bool help_requested() const { return help_requested_; }
  std::string Usage() const;

 private:
  struct Flag {
    std::string help;
    std::string default_text;
    bool is_bool = false;
    bool required = false;
    bool set = false;
    std::function<absl::Status(absl::string_view)> assign;
  };
  void Add(const std::string& name, Flag flag);

  std::string command_;
  std::string summary_;
  std::map<std::string, Flag> flags_;
  std::vector<std::string> order_;
  bool help_requested_ = false;
};

// The subcommand prologue: parses `args` into `flags`. Returns -1 to go on, else the exit code to
// return: 0 after printing Usage() for --help, 2 after printing a usage error to stderr.
int ParseFlagsOrExit(FlagSet& flags, const std::vector<std::string>& args);

}  // namespace fluxion

#endif  // FLUXION_COMMON_FLAG_SET_H_

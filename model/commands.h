// `fluxion make-model`, and the flag handling every subcommand shares. (`fluxion generate` lives in
// decode/, because it can decode with the paged sparse policies.)
#ifndef FLUXION_MODEL_COMMANDS_H_
#define FLUXION_MODEL_COMMANDS_H_

#include <string>
#include <vector>

#include "common/flag_set.h"

namespace fluxion::model {

// Each takes the arguments after the subcommand name and returns the process exit code
// (0 ok, 1 runtime error, 2 usage error), printing errors to stderr.
int RunMakeModelCommand(const std::vector<std::string>& args);

// Parses `args` into `flags`. Returns -1 to go on, else the exit code: 0 after printing --help,
// 2 after printing a usage error.
int ParseOrExit(FlagSet& flags, const std::vector<std::string>& args);

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_COMMANDS_H_

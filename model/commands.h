// `fluxion make-model`. (`fluxion generate` lives in decode/, because it can decode with the paged
// sparse policies.)
#ifndef FLUXION_MODEL_COMMANDS_H_
#define FLUXION_MODEL_COMMANDS_H_

#include <string>
#include <vector>


namespace fluxion::model {

// Each takes the arguments after the subcommand name and returns the process exit code
// (0 ok, 1 runtime error, 2 usage error), printing errors to stderr.
int RunMakeModelCommand(const std::vector<std::string>& args);

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_COMMANDS_H_

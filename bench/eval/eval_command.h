// `fluxion eval <what>`: quality evaluations of the engine. `tasks` runs the long-context tasks of
// docs/TASKS.md (task_eval.h) and prints accuracy per task, context and attention policy;
// `compare` pairs two `tasks --json` runs sample by sample (eval_compare.h).
#ifndef FLUXION_BENCH_EVAL_EVAL_COMMAND_H_
#define FLUXION_BENCH_EVAL_EVAL_COMMAND_H_

#include <string>
#include <vector>

namespace fluxion::eval {

// `args` excludes "eval". Returns the process exit code: 0 success, 1 a failure while running
// (model load, engine, files), 2 a usage error.
int RunEvalCommand(const std::vector<std::string>& args);

// `fluxion eval tasks [flags]`.
int RunEvalTasksCommand(const std::vector<std::string>& args);

}  // namespace fluxion::eval

#endif  // FLUXION_BENCH_EVAL_EVAL_COMMAND_H_

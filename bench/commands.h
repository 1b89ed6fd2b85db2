// `fluxion bench ...`: measuring commands. Each prints a table and, with --json FILE, writes the
// result file described in docs/BENCHMARKS.md (command, machine, date, git, limits, results).
#ifndef FLUXION_BENCH_COMMANDS_H_
#define FLUXION_BENCH_COMMANDS_H_

#include <string>
#include <vector>

namespace fluxion::bench {

// Dispatches `fluxion bench <what>`; returns the exit code.
int RunBenchCommand(const std::vector<std::string>& args);

}  // namespace fluxion::bench

#endif  // FLUXION_BENCH_COMMANDS_H_

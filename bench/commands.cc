#include "bench/commands.h"

#include <iostream>

#include "bench/model_bench.h"

namespace fluxion::bench {

int RunBenchCommand(const std::vector<std::string>& args) {
  const char* usage =
      "usage: fluxion bench <what> [flags]   (fluxion bench <what> --help)\n"
      "  model    CPU prefill/decode tokens/s of the model runtime vs bandwidth and sgemm limits\n";
  if (args.empty() || args[0] == "--help") {
    std::cout << usage;
    return args.empty() ? 2 : 0;
  }
  std::vector<std::string> rest(args.begin() + 1, args.end());
  if (args[0] == "model") return RunModelBench(rest);
  std::cerr << "fluxion bench: unknown benchmark '" << args[0] << "'\n" << usage;
  return 2;
}

}  // namespace fluxion::bench

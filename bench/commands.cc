#include "bench/commands.h"

#include <iostream>

#include "bench/attention_bench.h"
#include "bench/model_bench.h"
#include "bench/topk_bench.h"

namespace fluxion::bench {

int RunBenchCommand(const std::vector<std::string>& args) {
  const char* usage =
      "usage: fluxion bench <what> [flags]   (fluxion bench <what> --help)\n"
      "  model      CPU prefill/decode tokens/s of the model runtime vs bandwidth and sgemm limits\n"
      "  attention  one decode step over host KV pages, dense and at read budgets, vs bandwidth\n"
      "  topk       radix-select top-k against std::nth_element\n";
  if (args.empty() || args[0] == "--help") {
    std::cout << usage;
    return args.empty() ? 2 : 0;
  }
  std::vector<std::string> rest(args.begin() + 1, args.end());
  if (args[0] == "model") return RunModelBench(rest);
  if (args[0] == "attention") return RunAttentionBench(rest);
  if (args[0] == "topk") return RunTopKBench(rest);
  std::cerr << "fluxion bench: unknown benchmark '" << args[0] << "'\n" << usage;
  return 2;
}

}  // namespace fluxion::bench

#include "model/commands.h"

#include <cstdio>
#include <iostream>

#include "absl/strings/str_join.h"
#include "common/flag_set.h"
#include "model/random_model.h"

namespace fluxion::model {

int RunMakeModelCommand(const std::vector<std::string>& args) {
  std::string preset = "tiny", out;
  int64_t seed = 0;
  FlagSet flags("fluxion make-model",
                "Writes a random-weight model in Hugging Face layout (config.json + "
                "model.safetensors, bf16) for tests, benchmarks and the demo.");
  flags.String("preset", &preset, "model shape: " + absl::StrJoin(PresetNames(), ", "));
  flags.String("out", &out, "output directory (created)");
  flags.Int("seed", &seed, "random seed for the weights");
  flags.Require("out");
  if (int rc = ParseFlagsOrExit(flags, args); rc >= 0) return rc;
  auto config = PresetConfig(preset);
  if (!config.ok()) {
    std::cerr << "error: " << config.status().message() << "\n";
    return 2;
  }
  if (absl::Status s = WriteRandomModel(*config, static_cast<uint64_t>(seed), out); !s.ok()) {
    std::cerr << "error: " << s << "\n";
    return 1;
  }
  std::cout << "wrote " << preset << " model to " << out << "\n";
  return 0;
}

}  // namespace fluxion::model

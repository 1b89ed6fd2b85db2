// The one `fluxion` binary: dispatches to the subcommand, whose code lives in its part.
#include <cstring>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "bench/commands.h"
#include "decode/serving/commands.h"
#include "bench/eval/calibrate_command.h"
#include "bench/eval/eval_command.h"
#include "cluster/local_command.h"
#include "cluster/replay_command.h"
#include "cluster/router_command.h"
#include "cluster/serve_command.h"
#include "common/build_version.h"
#include "kernels/cpu/process_cpu.h"
#include "model/commands.h"
#ifdef FLUXION_HAVE_SERVICES
#include "decode/serving/serve_command.h"
#include "prefill/commands.h"
#endif

namespace {

struct Subcommand {
  const char* name;
  const char* summary;
  std::function<int(const std::vector<std::string>&)> run;
};

const std::vector<Subcommand>& Subcommands() {
  static const auto* commands = new std::vector<Subcommand>{
      {"generate", "generate tokens from prompt ids with the CPU model runtime",
       fluxion::decode::RunGenerateCommand},
      {"make-model", "write a random-weight model in Hugging Face layout",
       fluxion::model::RunMakeModelCommand},
      {"bench", "measurements: `fluxion bench model|attention|decode|topk|gpu|tokenizer`",
       fluxion::bench::RunBenchCommand},
      {"eval", "quality: `fluxion eval tasks|attention`", fluxion::eval::RunEvalCommand},
      {"calibrate", "fit the fluxion policy's head-property predictor for a model's directory",
       fluxion::eval::RunCalibrateCommand},
      {"replay", "load-test a router or decode node from a Mooncake trace or synthetic load",
       fluxion::cluster::RunReplayCommand},
      {"router", "serve DecodeService in front of prefill/decode nodes: pick pairs, retry, shed",
       fluxion::cluster::RunRouterCommand},
      {"serve", "serve a model's OpenAI API: router + prefill + decode here, until stopped",
       fluxion::cluster::RunServeCommand},
      {"local", "run router + prefill + decode on this machine and replay a short trace",
       fluxion::cluster::RunLocalCommand},
#ifdef FLUXION_HAVE_SERVICES
      {"prefill", "serve PrefillService: compute prompts, write KV into decode nodes over UCX",
       fluxion::prefill::RunPrefillCommand},
      {"decode", "serve DecodeService: admit, batch and decode requests over host KV",
       fluxion::decode::RunDecodeCommand},
#endif
  };
  return *commands;
}

void PrintUsage(std::ostream& out) {
  out << "usage: fluxion <command> [flags]   (fluxion <command> --help for its flags; "
         "fluxion --version)\n\n"
         "commands:\n";
  for (const Subcommand& c : Subcommands()) {
    out << "  " << c.name << std::string(12 - std::strlen(c.name), ' ') << c.summary << "\n";
  }
}

}  // namespace

int main(int argc, char** argv) {
  // A computing command sets its CPU pool up first thing and may restart the process to do so
  // (kernels/cpu/process_cpu.h): it needs the arguments as given.
  fluxion::kernels::cpu::SetProcessArgv(argv);
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "help") == 0) {
    PrintUsage(argc < 2 ? std::cerr : std::cout);
    return argc < 2 ? 2 : 0;
  }
  if (std::strcmp(argv[1], "--version") == 0) {
    std::cout << "fluxion " << fluxion::BuildVersion() << "\n";
    return 0;
  }
  std::vector<std::string> args(argv + 2, argv + argc);
  for (const Subcommand& c : Subcommands()) {
    if (c.name == std::string(argv[1])) return c.run(args);
  }
  std::cerr << "fluxion: unknown command '" << argv[1] << "'\n\n";
  PrintUsage(std::cerr);
  return 2;
}

#include "bench/commands.h"

#include <iostream>

#include "bench/attention_bench.h"
#include "bench/decode_bench.h"
#ifdef FLUXION_HAVE_CUDA
#include "bench/gpu_bench.h"
#include "bench/selection_bench.h"
#endif
#include "bench/model_bench.h"
#ifdef FLUXION_HAVE_UCX
#include "bench/landing_bench.h"
#include "bench/prefill_bench.h"
#include "bench/reservation_bench.h"
#include "bench/serving_ttft_bench.h"
#include "bench/transfer_bench.h"
#endif
#include "bench/tokenizer_bench.h"
#include "bench/topk_bench.h"

namespace fluxion::bench {

int RunBenchCommand(const std::vector<std::string>& args) {
  const char* usage =
      "usage: fluxion bench <what> [flags]   (fluxion bench <what> --help)\n"
      "  model      CPU prefill/decode tokens/s of the model runtime vs bandwidth and sgemm limits\n"
      "  attention  one decode step over host KV pages, dense and at read budgets, vs bandwidth\n"
      "  decode     a batch's decode step: batched CPU executor vs the per-request loop;\n"
      "             with --device cpu|cuda the hybrid step at real shapes (random weights)\n"
      "  topk       radix-select top-k against std::nth_element\n"
      "  prefill    time to first token over UCX (CPU or GPU prefill, a forked decode side)\n"
      "  transfer   KV-shaped pages written over UCX into a forked process (GB/s)\n"
      "  landing    the decode node's verify-and-adopt of a landed prompt at 8B KV shapes\n"
      "  reservation-keys  what per-reservation remote keys add to one request (UCX)\n"
      "  serving-ttft      the TTFT split of a running prefill + decode pair\n"
      "  gpu        the decode step's GPU kernels at Llama-3.1-8B shapes vs HBM/PCIe probes\n"
      "  selection  device selection's kernels (compact-key scan, top-k) vs the HBM probe\n"
      "  tokenizer  encode / decode / streaming detokenization cost per token\n";
  if (args.empty() || args[0] == "--help") {
    std::cout << usage;
    return args.empty() ? 2 : 0;
  }
  std::vector<std::string> rest(args.begin() + 1, args.end());
  if (args[0] == "model") return RunModelBench(rest);
  if (args[0] == "attention") return RunAttentionBench(rest);
  if (args[0] == "decode") return RunDecodeBench(rest);  // sets its process up itself
  if (args[0] == "topk") return RunTopKBench(rest);
  if (args[0] == "prefill" || args[0] == "transfer" || args[0] == "landing" ||
      args[0] == "reservation-keys" || args[0] == "serving-ttft") {
#ifdef FLUXION_HAVE_UCX
    if (args[0] == "prefill") return RunPrefillBench(rest);
    if (args[0] == "transfer") return RunTransferBench(rest);
    if (args[0] == "landing") return RunLandingBench(rest);
    if (args[0] == "reservation-keys") return RunReservationBench(rest);
    return RunServingTtftBench(rest);
#else
    std::cerr << "fluxion bench " << args[0] << ": this binary was built without UCX\n";
    return 1;
#endif
  }
  if (args[0] == "tokenizer") return RunTokenizerBench(rest);
  if (args[0] == "gpu") {
#ifdef FLUXION_HAVE_CUDA
    return RunGpuBench(rest);
#else
    std::cerr << "fluxion bench gpu: this binary was built without CUDA\n";
    return 1;
#endif
  }
  if (args[0] == "selection") {
#ifdef FLUXION_HAVE_CUDA
    return RunSelectionBench(rest);
#else
    std::cerr << "fluxion bench selection: this binary was built without CUDA\n";
    return 1;
#endif
  }
  std::cerr << "fluxion bench: unknown benchmark '" << args[0] << "'\n" << usage;
  return 2;
}

}  // namespace fluxion::bench

// `fluxion bench prefill`: time to first token of the disaggregated path (issue 15), split into
// its parts, at prompt lengths given as a list. A forked child is the decode side: a real
// decode::KvArena registered with UCX, pages reserved through KvAdmission, the PrefillRequest built
// by the decode node's own BuildPrefillRequest and the landing done by its LandPrompt (checksums,
// sparse state, page adoption, policy set-up). This process is the prefill node's PrefillEngine
// (the CPU model, or the GPU prefill with a model's or random weights at a preset's shapes) writing
// into the child's pages over UCX. What it leaves out of a served request: the gRPC hops and the
// decode executor's GPU window admission at join.
#ifndef FLUXION_BENCH_PREFILL_BENCH_H_
#define FLUXION_BENCH_PREFILL_BENCH_H_

#include <string>
#include <vector>

namespace fluxion::bench {

int RunPrefillBench(const std::vector<std::string>& args);

}  // namespace fluxion::bench

#endif  // FLUXION_BENCH_PREFILL_BENCH_H_

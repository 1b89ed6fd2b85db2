// Run-time choice of the instruction set the CPU kernels use. The AVX2 kernels are the baseline
// every machine we run on has; AVX-512 variants are compiled in when FLUXION_ENABLE_AVX512 is ON
// and used only when the running CPU (and OS) reports the extensions they were compiled for.
//
// The choice is made once per process (ActiveCpuIsa) from the CPU's features and the environment
// variable FLUXION_CPU_ISA, which forces a path for tests and benchmarks:
//   avx2        the AVX2 + FMA kernels
//   avx512      AVX-512 (F/BW/VL/DQ) kernels, fp32 scores: same accuracy as AVX2
//   avx512bf16  as avx512, but attention scores by vdpbf16ps on a bf16-rounded query
// A forced ISA the CPU cannot run falls back to the best one below it that it can: forcing never
// makes the process execute an instruction the CPU lacks. Without the variable the default is
// avx512 where available, else avx2; avx512bf16 is never chosen by default (see
// docs/KV_LAYOUT.md: it changes results by ~1e-3 relative, and its speed is not measured yet).
//
// Thread-safe: every function may be called from any thread.
#ifndef FLUXION_KERNELS_CPU_CPU_FEATURES_H_
#define FLUXION_KERNELS_CPU_CPU_FEATURES_H_

#include <string>

namespace fluxion::kernels::cpu {

// Ordered: each ISA's kernels need everything the one before needs.
enum class CpuIsa { kAvx2, kAvx512, kAvx512Bf16 };

// The extensions the kernels care about, as usable by user code (CPU support and OS-enabled
// register state: GCC's __builtin_cpu_supports checks XCR0 for the AVX-512 state).
struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512dq = false;
  bool avx512bf16 = false;
};

// The running CPU's features.
CpuFeatures DetectCpuFeatures();

// True when a CPU with `features` can run the kernels of `isa`.
bool CpuCanRun(CpuIsa isa, const CpuFeatures& features);

// "avx2", "avx512" or "avx512bf16": the FLUXION_CPU_ISA spelling.
const char* CpuIsaName(CpuIsa isa);

// The ISA to use on a CPU with `features`, given whether the AVX-512 kernels were compiled in and
// the requested name (FLUXION_CPU_ISA; nullptr or "" for the default). When the request cannot be
// honoured as asked (unknown name, CPU or build lacks it), *note (if non-null) says why and what
// was chosen instead; otherwise it is cleared. Pure: no I/O, no caching.
CpuIsa ChooseCpuIsa(const CpuFeatures& features, bool avx512_compiled, const char* requested,
                    std::string* note);

// True when this build contains the AVX-512 kernels (FLUXION_ENABLE_AVX512 and a compiler that
// accepts the flags).
bool Avx512KernelsCompiled();

// ChooseCpuIsa(DetectCpuFeatures(), Avx512KernelsCompiled(), getenv("FLUXION_CPU_ISA")), computed
// on the first call and cached for the life of the process; a note is printed to stderr once.
CpuIsa ActiveCpuIsa();

}  // namespace fluxion::kernels::cpu

#endif  // FLUXION_KERNELS_CPU_CPU_FEATURES_H_

#include "kernels/cpu/cpu_features.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace fluxion::kernels::cpu {

CpuFeatures DetectCpuFeatures() {
  // libgcc fills the table on its own start-up; calling it again is cheap and makes the answer
  // correct even if we run from another library's static initialiser before that happened.
  __builtin_cpu_init();
  CpuFeatures f;
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512vl = __builtin_cpu_supports("avx512vl");
  f.avx512dq = __builtin_cpu_supports("avx512dq");
  // GCC >= 12 and clang know this name (CPUID leaf 7 subleaf 1, EAX bit 5).
  f.avx512bf16 = __builtin_cpu_supports("avx512bf16");
  return f;
}

bool CpuCanRun(CpuIsa isa, const CpuFeatures& f) {
  // These are exactly the -m flags the kernels of each ISA are compiled with.
  const bool avx2 = f.avx2 && f.fma;
  const bool avx512 = avx2 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq;
  switch (isa) {
    case CpuIsa::kAvx2:
      return avx2;
    case CpuIsa::kAvx512:
      return avx512;
    case CpuIsa::kAvx512Bf16:
      return avx512 && f.avx512bf16;
  }
  return false;
}

const char* CpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kAvx512:
      return "avx512";
    case CpuIsa::kAvx512Bf16:
      return "avx512bf16";
  }
  return "unknown";
}

CpuIsa ChooseCpuIsa(const CpuFeatures& features, bool avx512_compiled, const char* requested,
                    std::string* note) {
  if (note != nullptr) note->clear();
  const auto usable = [&](CpuIsa isa) {
    return isa == CpuIsa::kAvx2 || (avx512_compiled && CpuCanRun(isa, features));
  };
  // The default stops at kAvx512: the bf16 variant is opt-in (see the header).
  CpuIsa want = CpuIsa::kAvx512;
  const bool asked = requested != nullptr && requested[0] != '\0';
  if (asked) {
    bool known = false;
    for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16}) {
      if (std::strcmp(requested, CpuIsaName(isa)) == 0) {
        want = isa;
        known = true;
      }
    }
    if (!known && note != nullptr) {
      *note = std::string("FLUXION_CPU_ISA=") + requested +
              " is not one of avx2, avx512, avx512bf16; using the default";
    }
  }
  CpuIsa chosen = want;
  while (!usable(chosen)) chosen = static_cast<CpuIsa>(static_cast<int>(chosen) - 1);
  if (asked && chosen != want && note != nullptr && note->empty()) {
    *note = std::string("FLUXION_CPU_ISA=") + requested + " is not available (" +
            (avx512_compiled ? "this CPU lacks it" : "built without FLUXION_ENABLE_AVX512") +
            "); using " + CpuIsaName(chosen);
  }
  return chosen;
}

bool Avx512KernelsCompiled() {
#ifdef FLUXION_HAVE_AVX512_KERNELS
  return true;
#else
  return false;
#endif
}

CpuIsa ActiveCpuIsa() {
  static const CpuIsa isa = [] {
    std::string note;
    const CpuIsa chosen = ChooseCpuIsa(DetectCpuFeatures(), Avx512KernelsCompiled(),
                                       std::getenv("FLUXION_CPU_ISA"), &note);
    // kernels/ links no logging library; a misspelt override must still be visible.
    if (!note.empty()) std::fprintf(stderr, "fluxion kernels/cpu: %s\n", note.c_str());
    return chosen;
  }();
  return isa;
}

}  // namespace fluxion::kernels::cpu

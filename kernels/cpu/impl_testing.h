// Test-only: the implementations a CPU-kernel conformance body runs against, shared by the
// attention and selection suites. kDispatched is what callers get; the others call one ISA's
// kernels directly, whatever the dispatcher would pick.
#ifndef FLUXION_KERNELS_CPU_IMPL_TESTING_H_
#define FLUXION_KERNELS_CPU_IMPL_TESTING_H_

#include <ostream>
#include <string>

namespace fluxion::kernels::cpu::impl_testing {

enum class Impl { kDispatched, kAvx2, kAvx512, kAvx512Bf16 };

inline std::string ImplName(Impl impl) {
  switch (impl) {
    case Impl::kDispatched:
      return "Dispatched";
    case Impl::kAvx2:
      return "Avx2";
    case Impl::kAvx512:
      return "Avx512";
    case Impl::kAvx512Bf16:
      return "Avx512Bf16";
  }
  return "Unknown";
}

// Readable parameters in gtest's failure messages.
inline void PrintTo(Impl impl, std::ostream* os) { *os << ImplName(impl); }

}  // namespace fluxion::kernels::cpu::impl_testing

#endif  // FLUXION_KERNELS_CPU_IMPL_TESTING_H_

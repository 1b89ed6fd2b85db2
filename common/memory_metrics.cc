#include "common/memory_metrics.h"

#include <malloc.h>
#include <unistd.h>

#include <cstdio>

namespace fluxion::metrics {

MallocUsage ReadMallocUsage() {
  MallocUsage u;
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
  const struct mallinfo2 m = mallinfo2();
  u.in_use_bytes = m.uordblks + m.hblkhd;  // small and large (mmapped) allocations
  u.free_held_bytes = m.fordblks;
#endif
  return u;
}

uint64_t ReadResidentBytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  unsigned long long size = 0, resident = 0;
  const int read = std::fscanf(f, "%llu %llu", &size, &resident);
  std::fclose(f);
  if (read != 2) return 0;
  return static_cast<uint64_t>(resident) * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
}

void AddMemoryMetrics(Registry* registry) {
  registry->AddGaugeCallback("fluxion_process_resident_bytes",
                             "Resident memory of this process (VmRSS)", {},
                             [] { return static_cast<double>(ReadResidentBytes()); });
  registry->AddGaugeCallback(
      "fluxion_malloc_in_use_bytes",
      "Bytes allocated with malloc and not freed (glibc mallinfo2: uordblks + hblkhd)", {},
      [] { return static_cast<double>(ReadMallocUsage().in_use_bytes); });
  registry->AddGaugeCallback(
      "fluxion_malloc_free_held_bytes",
      "Bytes freed but kept by malloc's arenas, not returned to the system (mallinfo2: fordblks)",
      {}, [] { return static_cast<double>(ReadMallocUsage().free_held_bytes); });
}

}  // namespace fluxion::metrics

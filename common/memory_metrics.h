// The process's memory as /metrics gauges, on every `fluxion` server: resident memory, and what
// glibc's malloc says of its heap, so that an operator (and the soak, tools/soak.sh) can tell a
// leak (bytes in use climbing) from the allocator keeping freed memory (bytes held free climbing
// while bytes in use stay flat), which RSS alone cannot (docs/FAULTS.md, "Soak").
//
//   fluxion_process_resident_bytes     VmRSS (/proc/self/statm)
//   fluxion_malloc_in_use_bytes        allocated and not freed: mallinfo2's uordblks + hblkhd
//   fluxion_malloc_free_held_bytes     freed but kept by malloc's arenas: mallinfo2's fordblks
//
// mallinfo2 walks every arena's free lists under their locks: microseconds for a server's few
// arenas, paid per scrape, never on a request's path.
//
// Thread-safe: the callbacks may run on any thread.
#ifndef FLUXION_COMMON_MEMORY_METRICS_H_
#define FLUXION_COMMON_MEMORY_METRICS_H_

#include <cstdint>

#include "common/metrics.h"

namespace fluxion::metrics {

struct MallocUsage {
  uint64_t in_use_bytes = 0;
  uint64_t free_held_bytes = 0;
};

// glibc's current numbers (zero where mallinfo2 is missing).
MallocUsage ReadMallocUsage();
// VmRSS of this process in bytes; 0 when /proc cannot be read.
uint64_t ReadResidentBytes();

// Registers the three gauges in `registry` (again: replaces them).
void AddMemoryMetrics(Registry* registry);

}  // namespace fluxion::metrics

#endif  // FLUXION_COMMON_MEMORY_METRICS_H_

// STREAM-style host read-bandwidth probe. The benchmarks print it beside every GB/s they report,
// and the decode node calibrates Fluxion's granularity cost model with it at start-up
// (decode/sparse/granularity.h).
//
// Thread-safe.
#ifndef FLUXION_COMMON_READ_BANDWIDTH_H_
#define FLUXION_COMMON_READ_BANDWIDTH_H_

#include <cstddef>

namespace fluxion::common {

// GB/s summing a `bytes`-sized buffer with `threads` OpenMP threads (best of `repeats`, after one
// untimed pass that faults the pages in).
double MeasureReadBandwidthGbps(size_t bytes, int threads, int repeats = 5);

}  // namespace fluxion::common

#endif  // FLUXION_COMMON_READ_BANDWIDTH_H_

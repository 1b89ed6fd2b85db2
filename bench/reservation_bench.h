// `fluxion bench reservation-keys`: what per-reservation remote keys add to one request (UCX).
#ifndef FLUXION_BENCH_RESERVATION_BENCH_H_
#define FLUXION_BENCH_RESERVATION_BENCH_H_

#include <string>
#include <vector>

namespace fluxion::bench {

// `args`: the flags after `fluxion bench reservation-keys`. Returns the process exit code.
int RunReservationBench(const std::vector<std::string>& args);

}  // namespace fluxion::bench

#endif  // FLUXION_BENCH_RESERVATION_BENCH_H_

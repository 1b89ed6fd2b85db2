// Fluxion's granularity selector (docs/ALGORITHMS.md §2.4.4): per retrieval head, the
// block size of the query-aware scan, chosen by a host cost model under a coverage constraint.
//
// A Fluxion head step scores the middle region's blocks by their Quest bounds (fp32 min/max vectors
// per block), takes the top blocks holding `over` x k rows (at least `min_blocks` blocks) as
// candidates (with LFPS's history candidates), rescores those rows exactly (K only) and attends the
// top k rows. Coarser blocks shrink the metadata scan (2 x head_dim x 4 bytes per block: 12.5% of
// the K/V bytes at 16 tokens, 3.1% at 64) but hold more rows the head does not need, so their top
// blocks cover less of the head's attention. Per head and request:
//
//     T(b) = [meta_bytes(b) + score_bytes(b) + attend_bytes] / read_bandwidth + topk(n / b)
//     choose the b in {16, 32, 64} with the smallest T(b) whose coverage is within `tolerance`
//     of the finest block's,
//
// where coverage(b) is the share of the head's prefill-tail attention mass (over the middle
// region: the LFPS vertical table the prefill captured) inside the top blocks of b tokens that
// hold `over` x k rows. The budget tier itself comes from Fluxion's predictor (fluxion_policy.h);
// this picks the granularity for it. Calibrate `read_gbps` once per host with
// common::MeasureReadBandwidthGbps (one core: a head's step runs on one core).
//
// Thread-safe: pure functions.
#ifndef FLUXION_DECODE_SPARSE_GRANULARITY_H_
#define FLUXION_DECODE_SPARSE_GRANULARITY_H_

#include <cstdint>
#include <vector>

namespace fluxion::decode::sparse {

struct HostCostModel {
  // One core's read bandwidth (GB/s). Default: the devbox's one-core probe (AMD EPYC, 2026-11-29,
  // bench/results/README.md); the decode node measures its own at start-up.
  double read_gbps = 12.0;
  // Radix top-k per score (ns): bench/results/topk-cpu-devbox-20261129.json (2K-8K scores).
  double topk_ns_per_score = 2.5;
};

// The block sizes Fluxion chooses among [SEED grid].
inline constexpr int64_t kFluxionBlocks[] = {16, 32, 64};

struct StepShape {
  int64_t middle_rows = 0;  // rows of the middle region the scan covers
  int64_t attend_rows = 0;  // k: middle rows the head attends
  int64_t head_dim = 128;
  int64_t over = 2;         // candidate rows from the scan per attended row
  int64_t min_blocks = 16;  // ... but at least this many blocks
};

// Blocks the scan keeps as candidates: over x k rows, at least `min_blocks`, at most all.
int64_t ScanBlocks(const StepShape& shape, int64_t block);

// Predicted microseconds of one head's selection + middle attention at block size `block`.
double PredictStepMicros(const HostCostModel& cost, const StepShape& shape, int64_t block);

// Per-block sums of `mass` (one entry per middle-region token, in order) for blocks of `block`
// tokens aligned at token `first_position` of the sequence (blocks align to absolute positions,
// as the block metadata does).
std::vector<double> BlockMass(const std::vector<double>& mass, int64_t first_position,
                              int64_t block);

// Share of the total of `block_mass` inside its top ceil(rows / block) entries (1 when the total
// is 0: no evidence against coarse blocks).
double BlockCoverage(std::vector<double> block_mass, int64_t block, int64_t rows);

struct GranularityChoice {
  int64_t block = 16;
  double predicted_us = 0;
  double coverage = 1;  // of the chosen block
};

// The cheapest block of kFluxionBlocks whose coverage is >= the 16-token coverage - tolerance.
// `coverage` holds one value per entry of kFluxionBlocks.
GranularityChoice ChooseGranularity(const HostCostModel& cost, const StepShape& shape,
                                    const std::vector<double>& coverage, double tolerance);

}  // namespace fluxion::decode::sparse

#endif  // FLUXION_DECODE_SPARSE_GRANULARITY_H_

// Device selection (docs/SPARSE.md, "Device selection"): a policy's middle rows chosen as the k
// best by compact-key score (kernels/compact_keys.h). On the hybrid step's GPU the picks are made
// where the compact keys live (ResidentWindow::SelectRows) and reach the policy in
// SelectionInput::device_picks; everywhere else (the CPU decode path, `fluxion eval tasks
// --selector device`, the hybrid step's host stand-in) this computes the same picks from the host
// pages, quantizing each middle K row as the device does: CompactTopK's picks bit for bit.
//
// Thread-compatible: one object per concurrently selected head.
#ifndef FLUXION_DECODE_SPARSE_DEVICE_SELECTION_H_
#define FLUXION_DECODE_SPARSE_DEVICE_SELECTION_H_

#include <cstdint>
#include <vector>

#include "decode/sparse/policy.h"
#include "decode/sparse/policy_util.h"
#include "kernels/compact_keys.h"
#include "kernels/cpu/compact_topk.h"

namespace fluxion::decode::sparse {

// The device's request for a step's regions: the middle [sink_end, local_begin) and its budget
// (at most the middle's rows), among `candidates` when given (a CandidateMarks bitmap over that
// middle; the budget at most the candidates then).
DeviceAsk DeviceAskOf(const Regions& r, const std::vector<uint64_t>* candidates = nullptr);

class CompactSelection {
 public:
  // Appends the spans of `ask`'s picks to *middle, and counts them in *stats. Uses
  // in.device_picks when given (a count other than ask.pick.k is the caller's bug: CHECKed),
  // else scores the span (its candidates) here.
  void SelectMiddle(const SelectionInput& in, const DeviceAsk& ask,
                    std::vector<kernels::PageSpan>* middle, SelectionStats* stats);

 private:
  kernels::cpu::CompactQuery query_;
  std::vector<int8_t> row_;
  std::vector<float> scores_;
  std::vector<int32_t> picks_;
};

}  // namespace fluxion::decode::sparse

#endif  // FLUXION_DECODE_SPARSE_DEVICE_SELECTION_H_

// The CPU backend of the attention seam (kernels/attention_backend.h): the AVX2 / AVX-512 paged
// kernels of paged_attention_cpu.h over the batch's (request, KV head, piece) tasks on one
// CpuPool. A pair whose spans hold more than kPieceRows rows is cut into pieces of whole spans of
// at least kPieceRows rows each, attended in parallel into partial states in the workspace and
// merged by log-sum-exp (split-KV, flash-decoding), so that one long request still spreads over
// the pool. The cut depends on the spans only, never on the thread count: results are the same
// for any pool size.
#ifndef FLUXION_KERNELS_CPU_ATTENTION_BACKEND_CPU_H_
#define FLUXION_KERNELS_CPU_ATTENTION_BACKEND_CPU_H_

#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "kernels/attention_backend.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/cpu_pool.h"

namespace fluxion::kernels::cpu {

inline constexpr int64_t kPieceRows = 512;

struct CpuAttentionBackendOptions {
  // The threads tasks run on; must outlive the backend. Null: the calling thread only.
  const CpuPool* pool = nullptr;
  // The kernel family; unset: the dispatched one (ActiveCpuIsa(), FLUXION_CPU_ISA). Tests force
  // each ISA. As the dispatcher does, head dims the family's kernels lack go to the AVX2 kernel.
  std::optional<CpuIsa> isa;
};

// FailedPrecondition when options.isa is set and this build or CPU cannot run it (the message
// says which).
absl::StatusOr<std::unique_ptr<AttentionBackend>> NewCpuAttentionBackend(
    const CpuAttentionBackendOptions& options);

}  // namespace fluxion::kernels::cpu

#endif  // FLUXION_KERNELS_CPU_ATTENTION_BACKEND_CPU_H_

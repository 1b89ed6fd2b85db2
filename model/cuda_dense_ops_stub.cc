// model_cuda in a build without CUDA (FLUXION_ENABLE_CUDA off): the factory says so.
#include "model/cuda_dense_ops.h"

namespace fluxion::model {

absl::StatusOr<std::unique_ptr<DenseOps>> NewCudaDenseOps(int device) {
  return absl::FailedPreconditionError(
      "this fluxion was built without CUDA (FLUXION_ENABLE_CUDA=OFF or no nvcc at configure "
      "time): use --device cpu, or rebuild with the CUDA toolkit");
}

}  // namespace fluxion::model

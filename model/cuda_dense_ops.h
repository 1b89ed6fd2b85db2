// The CUDA DenseOps (dense_ops.h): the dense half of a decode step on one GPU. Weight matrices are
// bf16 in HBM (UploadWeight casts on the device), activations fp32 in device memory; MatMul casts
// its input rows to bf16 and runs cuBLAS's bf16 GEMM with fp32 accumulation (kernels/cuda/gemm.h),
// the rest are the kernels of kernels/cuda, all on one stream owned by the ops.
//
// It lives in model/ (library model_cuda) rather than kernels/cuda so that dependencies point one
// way: kernels/cuda knows nothing of the model's seam, and model_cuda depends on both. In a build
// without CUDA the same library holds a stub whose factory says so, so callers (the CLI) need no
// #ifdef.
//
// It offers both optional capabilities of dense_ops.h: fused operations whose GEMM input is bf16
// (RMSNorm and SiLU * up write it, one split + bias + RoPE kernel after the stacked q/k/v
// product), and CUDA graphs recorded from its stream (thread-local capture mode).
//
// Hot path: nothing is allocated once a step at a batch size has run (the bf16 input scratch grows
// to the largest m * k seen, which bumps generation(); the cuBLAS workspace is allocated at
// creation; a GEMM shape's first product tunes its algorithm, kernels/cuda/gemm.h). CopyToHost
// and a CopyFromHost of more than 64 KiB wait for their copy (the DenseOps contract: the host
// buffer may be reused on return), so each costs a stream synchronisation; a smaller
// CopyFromHost (a step's tokens and positions) is staged through 1 MiB of pinned memory and
// returns at once, waiting only when that staging is full.
//
// Weight sharing (DenseOps::CanUseWeightsOf): two CudaDenseOps on the same device may run over
// one copy of the weights (uploaded by one, borrowed by the other: layer.h BorrowParams), each on
// its own stream with its own scratch and graphs; the owner must outlive the borrower.
//
// Thread-compatible: create and drive it from one thread (Create makes `device` current there);
// a thread that drives it after another created it must make `device` current first
// (cudaSetDevice).
#ifndef FLUXION_MODEL_CUDA_DENSE_OPS_H_
#define FLUXION_MODEL_CUDA_DENSE_OPS_H_

#include <memory>

#include "absl/status/statusor.h"
#include "model/dense_ops.h"

namespace fluxion::model {

// DenseOps on CUDA device `device`. FailedPrecondition when no CUDA device is present (or this
// build has no CUDA); InvalidArgument for a device index out of range; Internal when the stream or
// the cuBLAS handle cannot be made.
absl::StatusOr<std::unique_ptr<DenseOps>> NewCudaDenseOps(int device = 0);

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_CUDA_DENSE_OPS_H_

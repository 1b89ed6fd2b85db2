// A minimal writer and reader of NumPy `.npy` files (format versions 1.0/2.0): little-endian,
// C order, float32 or int64. Enough for capture files, which Python reads with numpy.load and
// `fluxion eval attention --capture` reads back here.
//
// Thread-safe: pure functions (concurrent writes to one path are the caller's problem).
#ifndef FLUXION_BENCH_EVAL_NPY_H_
#define FLUXION_BENCH_EVAL_NPY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace fluxion::eval {

// The header of a version-1.0 `.npy` file for `descr` ("<f4", "<i8") and `shape`, padded so the
// data starts at a multiple of 64 bytes, as numpy itself writes it.
std::string NpyHeader(const std::string& descr, absl::Span<const int64_t> shape);

// Write `data` (prod(shape) elements, C order) to `path`. Internal naming the path on failure;
// InvalidArgument when data.size() != prod(shape).
absl::Status WriteNpy(const std::string& path, absl::Span<const int64_t> shape,
                      absl::Span<const float> data);
absl::Status WriteNpy(const std::string& path, absl::Span<const int64_t> shape,
                      absl::Span<const int64_t> data);

template <typename T>
struct NpyArray {
  std::vector<int64_t> shape;
  std::vector<T> data;  // C order
};

// Reads a float32 ("<f4") or int64 ("<i8") array. NotFound for a missing file; InvalidArgument
// naming the file for a bad magic, an unsupported dtype or Fortran order, or a size mismatch.
absl::StatusOr<NpyArray<float>> ReadNpyFloat(const std::string& path);
absl::StatusOr<NpyArray<int64_t>> ReadNpyInt64(const std::string& path);

}  // namespace fluxion::eval

#endif  // FLUXION_BENCH_EVAL_NPY_H_

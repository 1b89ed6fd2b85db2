// Reader and writer for the safetensors format (https://github.com/huggingface/safetensors):
//   [u64 little-endian header_len][header_len bytes of JSON][tensor data]
// The JSON maps tensor names to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative
// to the data section) plus an optional "__metadata__" string map.
//
// Files are mmapped read-only; tensors are views into the mapping. Every header field is
// validated before any byte of data is trusted, so a truncated or malicious file gives an error
// naming the tensor and the problem, never a crash.
//
// Thread-safe after Open(): all accessors are const.
#ifndef FLUXION_MODEL_SAFETENSORS_H_
#define FLUXION_MODEL_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace fluxion::model {

enum class DType { kBF16, kF16, kF32, kOther };

// "BF16" -> kBF16 etc.; anything else (I64, F64, U8, ...) -> kOther.
DType ParseDType(const std::string& name);
const char* DTypeName(DType dtype);
size_t DTypeSize(DType dtype);  // 0 for kOther

struct TensorView {
  std::string name;
  DType dtype = DType::kOther;
  std::string dtype_name;  // as written in the header, e.g. "I64"
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // points into the mapping
  size_t nbytes = 0;
  std::string file;  // path of the file holding it (for error messages)

  int64_t numel() const;
};

// Headers larger than this are rejected before being read (the format's own reader caps at 100 MB).
// model.safetensors.index.json is held to the same bound.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100ull << 20;
// Dimensions of one tensor (real checkpoints use at most 4). JSON nesting is bounded by
// kMaxJsonDepth (model/config.h). docs/FUZZING.md lists every input limit.
inline constexpr size_t kMaxTensorRank = 16;

class SafetensorsFile {
 public:
  // Maps `path` and validates the header. Errors: NotFound (no file), DataLoss (truncated file,
  // header length beyond the file, offsets outside the data section, overlapping tensors),
  // InvalidArgument (oversized header, bad JSON, bad field types, shape/byte-size mismatch).
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // NotFound naming the tensor and the file.
  absl::StatusOr<const TensorView*> Find(const std::string& name) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// What Open() does after mapping, on bytes in memory (tests and the fuzz target): validates the
// whole file image and fills `tensors` (views into `file_bytes`) and `metadata`. Same errors.
absl::Status ParseSafetensorsBytes(absl::string_view file_bytes,
                                   std::map<std::string, TensorView>* tensors,
                                   std::map<std::string, std::string>* metadata);

// A checkpoint directory: `model.safetensors`, or shards listed by `model.safetensors.index.json`
// ({"weight_map": {tensor: shard file}}). Every shard is opened and every tensor the index names
// must be present in the shard it names.
class Checkpoint {
 public:
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const std::string& dir);

  // NotFound naming the tensor when absent.
  absl::StatusOr<const TensorView*> Find(const std::string& name) const;
  const std::map<std::string, const TensorView*>& tensors() const { return tensors_; }

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*> tensors_;
};

// Converts a tensor to fp32 after checking it has exactly `expected_shape`. InvalidArgument naming
// the tensor on a shape mismatch or an unsupported dtype.
absl::StatusOr<std::vector<float>> ReadAsFloat(const TensorView& tensor,
                                               absl::Span<const int64_t> expected_shape);

// One tensor to be written by WriteSafetensors. `data` holds numel * DTypeSize(dtype) bytes.
struct TensorToWrite {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;
};

// Writes a safetensors file (header padded to 8 bytes, tensors in the given order).
absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_SAFETENSORS_H_

#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "model/json_text.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "common/half.h"
#include "common/status_macros.h"
#include "model/config.h"
#include "nlohmann/json.hpp"

// safetensors stores every value little-endian; we copy its bytes straight into host values.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors.cc assumes little-endian");

namespace fluxion::model {
namespace {

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

constexpr char kMetadataKey[] = "__metadata__";
constexpr char kIndexFile[] = "model.safetensors.index.json";
constexpr char kSingleFile[] = "model.safetensors";

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ","), "]");
}

std::string JoinPath(const std::string& dir, const std::string& name) {
  if (dir.empty() || dir.back() == '/') return dir + name;
  return absl::StrCat(dir, "/", name);
}

// Prefixes an error with where it happened, keeping its code.
absl::Status WithContext(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(context, ": ", status.message()));
}

// Sets `*bytes` to numel * element_size; false on a negative dimension or on overflow.
// Overflow matters: a hostile header could otherwise make a huge shape match a small byte range.
bool CheckedByteSize(absl::Span<const int64_t> shape, uint64_t element_size, uint64_t* bytes) {
  uint64_t total = element_size;
  for (int64_t dim : shape) {
    if (dim < 0 || __builtin_mul_overflow(total, static_cast<uint64_t>(dim), &total)) return false;
  }
  *bytes = total;
  return true;
}

// A header nests 3 deep (root, entry, shape); a top-level key given twice (a tensor named twice)
// would leave bytes nobody accounts for, so it is refused.
absl::StatusOr<Json> ParseJson(absl::string_view text, absl::string_view what) {
  FLUXION_ASSIGN_OR_RETURN(Json root, ParseJsonText(text, what, {kMaxJsonDepth, true}));
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is not a JSON object (got ", root.type_name(), ")"));
  }
  return root;
}

// A non-negative integer that fits int64 (shape dimensions and offsets).
bool ReadCount(const Json& value, uint64_t* out) {
  if (value.is_number_unsigned()) {
    *out = value.get<uint64_t>();
    return *out <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  }
  if (value.is_number_integer() && value.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(value.get<int64_t>());
    return true;
  }
  return false;
}

// Validates one header entry against the data section [data, data + data_bytes) and fills
// `view`. Every check happens before `view.data` could be dereferenced by anyone.
absl::Status ParseTensorEntry(const std::string& name, const Json& entry, const uint8_t* data,
                              uint64_t data_bytes, TensorView* view) {
  const std::string tensor = absl::StrCat("tensor '", name, "'");
  if (!entry.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(tensor, ": entry is not a JSON object"));
  }
  auto dtype = entry.find("dtype");
  if (dtype == entry.end() || !dtype->is_string()) {
    return absl::InvalidArgumentError(absl::StrCat(tensor, ": 'dtype' must be a string"));
  }
  auto shape = entry.find("shape");
  if (shape == entry.end() || !shape->is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(tensor, ": 'shape' must be a list"));
  }
  if (shape->size() > kMaxTensorRank) {
    return absl::InvalidArgumentError(absl::StrCat(tensor, ": shape has ", shape->size(),
                                                   " dimensions, above the limit of ",
                                                   kMaxTensorRank));
  }
  view->shape.clear();
  for (size_t i = 0; i < shape->size(); ++i) {
    uint64_t dim;
    if (!ReadCount((*shape)[i], &dim)) {
      // Numbers are shown; anything else only by type, so the message stays small.
      const Json& bad = (*shape)[i];
      return absl::InvalidArgumentError(absl::StrCat(
          tensor, ": shape[", i, "] is ", bad.is_number() ? bad.dump() : bad.type_name(),
          "; dimensions must be non-negative integers"));
    }
    view->shape.push_back(static_cast<int64_t>(dim));
  }
  auto offsets = entry.find("data_offsets");
  uint64_t begin, end;
  if (offsets == entry.end() || !offsets->is_array() || offsets->size() != 2 ||
      !ReadCount((*offsets)[0], &begin) || !ReadCount((*offsets)[1], &end)) {
    return absl::InvalidArgumentError(
        absl::StrCat(tensor, ": 'data_offsets' must be [begin, end] with non-negative integers"));
  }
  if (begin > end || end > data_bytes) {
    return absl::DataLossError(absl::StrCat(tensor, " has data_offsets [", begin, ",", end,
                                            "] outside the data section of ", data_bytes,
                                            " bytes (truncated file?)"));
  }
  view->name = name;
  view->dtype_name = dtype->get_ref<const std::string&>();
  view->dtype = ParseDType(view->dtype_name);
  view->data = data + begin;
  view->nbytes = end - begin;

  // Unknown dtypes have no element size to check against, but their shape must still not
  // overflow, so numel() stays meaningful for every tensor we hand out.
  const uint64_t element_size = view->dtype == DType::kOther ? 1 : DTypeSize(view->dtype);
  uint64_t expected_bytes;
  if (!CheckedByteSize(view->shape, element_size, &expected_bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat(tensor, " has shape ", ShapeString(view->shape), " whose size overflows"));
  }
  if (view->dtype != DType::kOther && expected_bytes != view->nbytes) {
    return absl::InvalidArgumentError(absl::StrCat(tensor, " has shape ", ShapeString(view->shape),
                                                   " of ", view->dtype_name, " (", expected_bytes,
                                                   " bytes) but data_offsets [", begin, ",", end,
                                                   "] span ", view->nbytes, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status ParseMetadata(const Json& value, std::map<std::string, std::string>* metadata) {
  if (value.is_null()) return absl::OkStatus();
  if (!value.is_object()) {
    return absl::InvalidArgumentError("'__metadata__' must be an object of strings");
  }
  for (const auto& item : value.items()) {
    if (!item.value().is_string()) {
      return absl::InvalidArgumentError(absl::StrCat("'__metadata__' value of '", item.key(),
                                                     "' must be a string, got ",
                                                     item.value().type_name()));
    }
    (*metadata)[item.key()] = item.value().get_ref<const std::string&>();
  }
  return absl::OkStatus();
}

// Zero-length tensors occupy no bytes and may sit anywhere, including inside another tensor.
absl::Status CheckNoOverlap(const std::map<std::string, TensorView>& tensors, const uint8_t* data) {
  std::vector<const TensorView*> by_offset;
  for (const auto& [name, view] : tensors) {
    if (view.nbytes > 0) by_offset.push_back(&view);
  }
  std::sort(by_offset.begin(), by_offset.end(),
            [](const TensorView* a, const TensorView* b) { return a->data < b->data; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const TensorView& prev = *by_offset[i - 1];
    const TensorView& next = *by_offset[i];
    if (next.data < prev.data + prev.nbytes) {
      const auto range = [data](const TensorView& t) {
        return absl::StrCat("[", t.data - data, ",", t.data + t.nbytes - data, "]");
      };
      return absl::DataLossError(absl::StrCat("tensors '", prev.name, "' ", range(prev), " and '",
                                              next.name, "' ", range(next), " overlap"));
    }
  }
  return absl::OkStatus();
}

// Parses and checks the whole header of a mapped file of `size` bytes.
absl::Status ParseHeader(const uint8_t* bytes, uint64_t size, const std::string& path,
                         std::map<std::string, TensorView>* tensors,
                         std::map<std::string, std::string>* metadata) {
  if (size < 8) {
    return absl::DataLossError(
        absl::StrCat("truncated: ", size, " bytes is too short for the 8-byte header length"));
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];
  // Compared before anything is read or allocated: the length is untrusted.
  if (header_len > kMaxSafetensorsHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("header of ", header_len,
                                                   " bytes exceeds the limit of ",
                                                   kMaxSafetensorsHeaderBytes, " bytes"));
  }
  if (header_len > size - 8) {
    return absl::DataLossError(absl::StrCat("header of ", header_len,
                                            " bytes runs past the end of the file (", size,
                                            " bytes); truncated file?"));
  }
  const absl::string_view header(reinterpret_cast<const char*>(bytes + 8), header_len);
  FLUXION_ASSIGN_OR_RETURN(Json root, ParseJson(header, "header"));
  const uint8_t* data = bytes + 8 + header_len;
  const uint64_t data_bytes = size - 8 - header_len;
  for (const auto& item : root.items()) {
    if (item.key() == kMetadataKey) {
      FLUXION_RETURN_IF_ERROR(ParseMetadata(item.value(), metadata));
      continue;
    }
    TensorView view;
    FLUXION_RETURN_IF_ERROR(ParseTensorEntry(item.key(), item.value(), data, data_bytes, &view));
    view.file = path;
    (*tensors)[item.key()] = std::move(view);
  }
  return CheckNoOverlap(*tensors, data);
}

// Closes a file descriptor on every return path.
class ScopedFd {
 public:
  explicit ScopedFd(int fd) : fd_(fd) {}
  ~ScopedFd() {
    if (fd_ >= 0) close(fd_);
  }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  int get() const { return fd_; }
  // Closes now, reporting the error close() can return after buffered writes.
  int Close() {
    const int result = close(fd_);
    fd_ = -1;
    return result;
  }

 private:
  int fd_;
};

absl::StatusOr<bool> FileExists(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) == 0) return true;
  if (errno == ENOENT || errno == ENOTDIR) return false;
  return absl::ErrnoToStatus(errno, absl::StrCat("stat ", path));
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  ScopedFd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return absl::ErrnoToStatus(errno, absl::StrCat("opening ", path));
  std::string contents;
  char buffer[1 << 16];
  while (true) {
    const ssize_t n = read(fd.get(), buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::ErrnoToStatus(errno, absl::StrCat("reading ", path));
    if (n == 0) break;
    // The index lists one short line per tensor; a header-sized bound is generous.
    if (contents.size() + static_cast<size_t>(n) > kMaxSafetensorsHeaderBytes) {
      return absl::InvalidArgumentError(absl::StrCat(path, " is larger than the limit of ",
                                                     kMaxSafetensorsHeaderBytes, " bytes"));
    }
    contents.append(buffer, static_cast<size_t>(n));
  }
  return contents;
}

absl::Status WriteAll(int fd, const void* data, size_t size, const std::string& path) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  while (size > 0) {
    // Linux writes at most ~2 GiB per call; smaller chunks keep each call bounded.
    const ssize_t n = write(fd, p, std::min<size_t>(size, size_t{1} << 30));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::ErrnoToStatus(errno, absl::StrCat("writing ", path));
    p += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// True if nlohmann can serialise `s` as-is. Its strict dump throws on invalid UTF-8; the
// `ignore` and `replace` handlers differ exactly when there is something invalid to handle.
bool IsJsonEncodable(const std::string& s) {
  const Json value = s;
  return value.dump(-1, ' ', false, Json::error_handler_t::ignore) ==
         value.dump(-1, ' ', false, Json::error_handler_t::replace);
}

absl::Status ValidateShardName(const std::string& shard) {
  // The index comes with the download; a shard name must not reach outside the checkpoint dir.
  if (shard.empty() || shard.find('/') != std::string::npos ||
      shard.find('\0') != std::string::npos || absl::StrContains(shard, "..")) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard file name '", shard, "' must be a plain file name in the directory"));
  }
  return absl::OkStatus();
}

absl::Status WriteFile(const std::string& path, const std::string& header,
                       const std::vector<TensorToWrite>& tensors) {
  ScopedFd fd(open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) return absl::ErrnoToStatus(errno, absl::StrCat("creating ", path));
  uint8_t length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(uint64_t{header.size()} >> (8 * i));
  FLUXION_RETURN_IF_ERROR(WriteAll(fd.get(), length, sizeof(length), path));
  FLUXION_RETURN_IF_ERROR(WriteAll(fd.get(), header.data(), header.size(), path));
  for (const TensorToWrite& tensor : tensors) {
    FLUXION_RETURN_IF_ERROR(WriteAll(fd.get(), tensor.data.data(), tensor.data.size(), path));
  }
  // Without fsync a crash after the rename could leave the final name pointing at missing data.
  if (fsync(fd.get()) != 0) return absl::ErrnoToStatus(errno, absl::StrCat("fsync ", path));
  if (fd.Close() != 0) return absl::ErrnoToStatus(errno, absl::StrCat("closing ", path));
  return absl::OkStatus();
}

}  // namespace

DType ParseDType(const std::string& name) {
  if (name == "BF16") return DType::kBF16;
  if (name == "F16") return DType::kF16;
  if (name == "F32") return DType::kF32;
  return DType::kOther;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "BF16";
    case DType::kF16:
      return "F16";
    case DType::kF32:
      return "F32";
    case DType::kOther:
      break;
  }
  return "other";
}

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
    case DType::kF16:
      return 2;
    case DType::kF32:
      return 4;
    case DType::kOther:
      break;
  }
  return 0;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t dim : shape) n *= dim;
  return n;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  ScopedFd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat(path, " does not exist"));
    return absl::ErrnoToStatus(errno, absl::StrCat("opening ", path));
  }
  struct stat st;
  if (fstat(fd.get(), &st) != 0) return absl::ErrnoToStatus(errno, absl::StrCat("stat ", path));
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    return absl::DataLossError(absl::StrCat(path, ": truncated: ", size,
                                            " bytes is too short for the 8-byte header length"));
  }
  void* map = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd.get(), 0);
  if (map == MAP_FAILED) return absl::ErrnoToStatus(errno, absl::StrCat("mmap ", path));
  // From here the destructor unmaps, on success and on every error return.
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  file->map_ = map;
  file->map_bytes_ = size;
  FLUXION_RETURN_IF_ERROR(WithContext(
      ParseHeader(static_cast<const uint8_t*>(map), size, path, &file->tensors_, &file->metadata_),
      path));
  return file;
}

absl::Status ParseSafetensorsBytes(absl::string_view file_bytes,
                                   std::map<std::string, TensorView>* tensors,
                                   std::map<std::string, std::string>* metadata) {
  return ParseHeader(reinterpret_cast<const uint8_t*>(file_bytes.data()), file_bytes.size(),
                     "<memory>", tensors, metadata);
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) munmap(map_, map_bytes_);
}

absl::StatusOr<const TensorView*> SafetensorsFile::Find(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat("tensor '", name, "' not found in ", path_));
  }
  return &it->second;
}

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& dir) {
  auto checkpoint = std::make_unique<Checkpoint>();
  const std::string index_path = JoinPath(dir, kIndexFile);
  FLUXION_ASSIGN_OR_RETURN(bool has_index, FileExists(index_path));
  if (!has_index) {
    const std::string single_path = JoinPath(dir, kSingleFile);
    FLUXION_ASSIGN_OR_RETURN(bool has_single, FileExists(single_path));
    if (!has_single) {
      return absl::NotFoundError(absl::StrCat("no ", kSingleFile, " or ", kIndexFile, " in ", dir));
    }
    FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file,
                             SafetensorsFile::Open(single_path));
    for (const auto& [name, view] : file->tensors()) checkpoint->tensors_[name] = &view;
    checkpoint->files_.push_back(std::move(file));
    return checkpoint;
  }

  FLUXION_ASSIGN_OR_RETURN(std::string index_text, ReadFile(index_path));
  absl::StatusOr<Json> index = ParseJson(index_text, index_path);
  if (!index.ok()) return index.status();
  auto weight_map = index->find("weight_map");
  if (weight_map == index->end() || !weight_map->is_object() || weight_map->empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(index_path, ": 'weight_map' must be a non-empty object"));
  }
  // Open each distinct shard once, in name order so errors are deterministic.
  std::map<std::string, const SafetensorsFile*> shards;
  for (const auto& item : weight_map->items()) {
    if (!item.value().is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path, ": shard of tensor '", item.key(), "' must be a string"));
    }
    const std::string& shard = item.value().get_ref<const std::string&>();
    FLUXION_RETURN_IF_ERROR(WithContext(ValidateShardName(shard), index_path));
    shards.emplace(shard, nullptr);
  }
  for (auto& [shard, file] : shards) {
    FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> opened,
                             SafetensorsFile::Open(JoinPath(dir, shard)));
    file = opened.get();
    for (const auto& [name, view] : opened->tensors()) {
      auto [it, inserted] = checkpoint->tensors_.emplace(name, &view);
      if (!inserted) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor '", name, "' is in both ", it->second->file, " and ", view.file));
      }
    }
    checkpoint->files_.push_back(std::move(opened));
  }
  for (const auto& item : weight_map->items()) {
    const std::string& shard = item.value().get_ref<const std::string&>();
    if (shards[shard]->tensors().count(item.key()) == 0) {
      return absl::NotFoundError(absl::StrCat("tensor '", item.key(), "' is mapped to shard '",
                                              shard, "' by ", index_path,
                                              " but that shard does not contain it"));
    }
  }
  return checkpoint;
}

absl::StatusOr<const TensorView*> Checkpoint::Find(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat("tensor '", name, "' not found in the checkpoint"));
  }
  return it->second;
}

absl::StatusOr<std::vector<float>> ReadAsFloat(const TensorView& tensor,
                                               absl::Span<const int64_t> expected_shape) {
  if (tensor.dtype == DType::kOther) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", tensor.name, "' has dtype ",
                     tensor.dtype_name.empty() ? DTypeName(tensor.dtype) : tensor.dtype_name,
                     "; expected BF16, F16 or F32"));
  }
  if (absl::Span<const int64_t>(tensor.shape) != expected_shape) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", tensor.name, "' has shape ",
                                                   ShapeString(tensor.shape), ", expected ",
                                                   ShapeString(expected_shape)));
  }
  // Views from SafetensorsFile are already consistent; this guards hand-built ones.
  uint64_t nbytes;
  if (!CheckedByteSize(tensor.shape, DTypeSize(tensor.dtype), &nbytes) || nbytes != tensor.nbytes ||
      (nbytes > 0 && tensor.data == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", tensor.name, "' holds ", tensor.nbytes, " bytes, which does not match shape ",
        ShapeString(tensor.shape), " of ", DTypeName(tensor.dtype)));
  }
  const size_t numel = nbytes / DTypeSize(tensor.dtype);
  std::vector<float> out(numel);
  // Tensor data in the mapping is only as aligned as the header makes it: copy, never cast.
  switch (tensor.dtype) {
    case DType::kF32:
      if (numel > 0) std::memcpy(out.data(), tensor.data, nbytes);
      break;
    case DType::kBF16:
      for (size_t i = 0; i < numel; ++i) {
        bf16 h;
        std::memcpy(&h.bits, tensor.data + 2 * i, 2);
        out[i] = Bf16ToFloat(h);
      }
      break;
    case DType::kF16:
      for (size_t i = 0; i < numel; ++i) {
        fp16 h;
        std::memcpy(&h.bits, tensor.data + 2 * i, 2);
        out[i] = Fp16ToFloat(h);
      }
      break;
    case DType::kOther:
      break;
  }
  return out;
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  OrderedJson header = OrderedJson::object();
  if (!metadata.empty()) {
    OrderedJson meta = OrderedJson::object();
    for (const auto& [key, value] : metadata) {
      if (!IsJsonEncodable(key) || !IsJsonEncodable(value)) {
        return absl::InvalidArgumentError(
            absl::StrCat("metadata key '", key, "' or its value is not valid UTF-8"));
      }
      meta[key] = value;
    }
    header[kMetadataKey] = std::move(meta);
  }
  uint64_t offset = 0;
  for (const TensorToWrite& tensor : tensors) {
    const std::string label = absl::StrCat("tensor '", tensor.name, "'");
    if (tensor.name.empty() || tensor.name == kMetadataKey || !IsJsonEncodable(tensor.name)) {
      return absl::InvalidArgumentError(absl::StrCat(label, ": invalid tensor name"));
    }
    if (header.contains(tensor.name)) {
      return absl::InvalidArgumentError(absl::StrCat(label, " is given twice"));
    }
    if (DTypeSize(tensor.dtype) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(label, ": only BF16, F16 and F32 can be written"));
    }
    uint64_t nbytes;
    if (!CheckedByteSize(tensor.shape, DTypeSize(tensor.dtype), &nbytes) ||
        nbytes != tensor.data.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(label, " has shape ", ShapeString(tensor.shape), " of ",
                       DTypeName(tensor.dtype), " but ", tensor.data.size(), " bytes of data"));
    }
    header[tensor.name] = {{"dtype", DTypeName(tensor.dtype)},
                           {"shape", tensor.shape},
                           {"data_offsets", OrderedJson::array({offset, offset + nbytes})}};
    offset += nbytes;
  }
  std::string header_text = header.dump();
  // Padding keeps the data section 8-byte aligned in the file, as the reference writer does.
  header_text.append((8 - header_text.size() % 8) % 8, ' ');

  // Readers see either the old file or the complete new one, never a partial write.
  const std::string tmp_path = path + ".tmp";
  absl::Status written = WriteFile(tmp_path, header_text, tensors);
  if (written.ok() && rename(tmp_path.c_str(), path.c_str()) != 0) {
    written = absl::ErrnoToStatus(errno, absl::StrCat("renaming ", tmp_path, " to ", path));
  }
  if (!written.ok()) unlink(tmp_path.c_str());
  return written;
}

}  // namespace fluxion::model

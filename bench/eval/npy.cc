#include "bench/eval/npy.h"

#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fluxion::eval {
namespace {

// We write host memory as is; every machine we build for (x86-64, aarch64 Linux) is
// little-endian, and this turns a port to a big-endian one into a compile error, not bad files.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "npy writer assumes little-endian");

template <typename T>
absl::Status Write(const std::string& path, const std::string& descr,
                   absl::Span<const int64_t> shape, absl::Span<const T> data) {
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  if (count != static_cast<int64_t>(data.size())) {
    return absl::InvalidArgumentError(absl::StrCat("npy shape (", absl::StrJoin(shape, ", "),
                                                   ") holds ", count, " elements, data has ",
                                                   data.size()));
  }
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  const std::string header = NpyHeader(descr, shape);
  out.write(header.data(), header.size());
  out.write(reinterpret_cast<const char*>(data.data()), data.size() * sizeof(T));
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

}  // namespace

std::string NpyHeader(const std::string& descr, absl::Span<const int64_t> shape) {
  std::string dims = absl::StrJoin(shape, ", ");
  if (shape.size() == 1) dims += ",";  // a Python 1-tuple
  std::string dict = absl::StrCat("{'descr': '", descr, "', 'fortran_order': False, 'shape': (",
                                  dims, "), }");
  // magic (6) + version (2) + header length (2) + dict + padding + '\n' = a multiple of 64.
  const size_t unpadded = 10 + dict.size() + 1;
  dict.append((64 - unpadded % 64) % 64, ' ');
  dict.push_back('\n');
  std::string header("\x93NUMPY\x01\x00", 8);
  header.push_back(static_cast<char>(dict.size() & 0xff));
  header.push_back(static_cast<char>(dict.size() >> 8));
  return header + dict;
}

absl::Status WriteNpy(const std::string& path, absl::Span<const int64_t> shape,
                      absl::Span<const float> data) {
  return Write(path, "<f4", shape, data);
}

absl::Status WriteNpy(const std::string& path, absl::Span<const int64_t> shape,
                      absl::Span<const int64_t> data) {
  return Write(path, "<i8", shape, data);
}

}  // namespace fluxion::eval

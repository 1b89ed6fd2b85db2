#include "bench/eval/npy.h"

#include <cstring>
#include <fstream>
#include <iterator>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

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

namespace {

template <typename T>
absl::StatusOr<NpyArray<T>> ReadNpy(const std::string& path, const std::string& want_descr) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", why));
  };
  if (all.size() < 10 || all.compare(0, 6, "\x93NUMPY") != 0) return bad("not a .npy file");
  const int major = static_cast<unsigned char>(all[6]);
  size_t header_len = 0, offset = 0;
  if (major == 1) {
    header_len = static_cast<unsigned char>(all[8]) | (static_cast<unsigned char>(all[9]) << 8);
    offset = 10;
  } else if (major == 2 || major == 3) {
    if (all.size() < 12) return bad("truncated header");
    for (int i = 0; i < 4; ++i) header_len |= size_t{static_cast<unsigned char>(all[8 + i])} << (8 * i);
    offset = 12;
  } else {
    return bad(absl::StrCat("unsupported .npy version ", major));
  }
  if (offset + header_len > all.size()) return bad("truncated header");
  const std::string header = all.substr(offset, header_len);
  if (header.find("'descr': '" + want_descr + "'") == std::string::npos) {
    return bad(absl::StrCat("expected dtype ", want_descr, " in header ", header));
  }
  if (header.find("'fortran_order': False") == std::string::npos) {
    return bad("Fortran-order arrays are not supported");
  }
  const size_t open = header.find("'shape': (");
  const size_t close = header.find(')', open);
  if (open == std::string::npos || close == std::string::npos) return bad("no shape in header");
  NpyArray<T> array;
  int64_t numel = 1;
  for (absl::string_view piece : absl::StrSplit(
           absl::string_view(header).substr(open + 10, close - open - 10), ',',
           absl::SkipWhitespace())) {
    int64_t dim;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(piece), &dim) || dim < 0) {
      return bad("bad shape in header");
    }
    array.shape.push_back(dim);
    numel *= dim;
  }
  const size_t data_offset = offset + header_len;
  if (all.size() - data_offset != static_cast<size_t>(numel) * sizeof(T)) {
    return bad(absl::StrCat("holds ", all.size() - data_offset, " data bytes, shape needs ",
                            numel * sizeof(T)));
  }
  array.data.resize(numel);
  std::memcpy(array.data.data(), all.data() + data_offset, numel * sizeof(T));
  return array;
}

}  // namespace

absl::StatusOr<NpyArray<float>> ReadNpyFloat(const std::string& path) {
  return ReadNpy<float>(path, "<f4");
}

absl::StatusOr<NpyArray<int64_t>> ReadNpyInt64(const std::string& path) {
  return ReadNpy<int64_t>(path, "<i8");
}

}  // namespace fluxion::eval

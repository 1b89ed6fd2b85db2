#include "transfer/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace fluxion::transfer {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    t[i] = c;
  }
  return t;
}

uint32_t ExtendTable(uint32_t crc, const uint8_t* p, size_t n) {
  static const std::array<uint32_t, 256> table = MakeTable();
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t ExtendSse42(uint32_t crc, const uint8_t* p,
                                                       size_t n) {
  uint64_t c = crc;
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n > 0) {
    c32 = _mm_crc32_u8(c32, *p++);
    --n;
  }
  return c32;
}
#endif

// GF(2) matrix (32 columns of 32 bits) times a vector.
uint32_t MatrixTimes(const uint32_t* m, uint32_t v) {
  uint32_t sum = 0;
  for (; v != 0; v >>= 1, ++m) {
    if (v & 1) sum ^= *m;
  }
  return sum;
}

void MatrixSquare(uint32_t* square, const uint32_t* m) {
  for (int n = 0; n < 32; ++n) square[n] = MatrixTimes(m, m[n]);
}

}  // namespace

uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  if (len_b == 0) return crc_a;
  uint32_t even[32], odd[32];  // operators for 2^k zero bits, alternating
  odd[0] = kPoly;  // one zero bit
  for (int n = 1; n < 32; ++n) odd[n] = 1u << (n - 1);
  MatrixSquare(even, odd);  // two zero bits
  MatrixSquare(odd, even);  // four
  // Apply len_b zero bytes to crc_a: the first squaring below gives one byte's operator.
  do {
    MatrixSquare(even, odd);
    if (len_b & 1) crc_a = MatrixTimes(even, crc_a);
    len_b >>= 1;
    if (len_b == 0) break;
    MatrixSquare(odd, even);
    if (len_b & 1) crc_a = MatrixTimes(odd, crc_a);
    len_b >>= 1;
  } while (len_b != 0);
  return crc_a ^ crc_b;
}

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  static const bool has_sse42 = __builtin_cpu_supports("sse4.2");
  if (has_sse42) return ~ExtendSse42(crc, p, n);
#endif
  return ~ExtendTable(crc, p, n);
}

}  // namespace fluxion::transfer

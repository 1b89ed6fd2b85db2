// CRC-32C (Castagnoli), the checksum PrefillResponse.layer_checksums carries
// (CHECKSUM_ALGORITHM_CRC32C). The prefill node computes it over what it sends and the decode node
// over what landed, so a torn or misplaced write is caught before decoding starts.
//
// SSE4.2's crc32 instruction when the CPU has it (every x86-64 server since 2008: ~10 GB/s on one
// core), a table otherwise. Thread-safe: pure functions.
#ifndef FLUXION_TRANSFER_CRC32C_H_
#define FLUXION_TRANSFER_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace fluxion::transfer {

// Continues the CRC-32C `crc` (0 for a fresh stream) over `n` bytes at `data`. Extending a stream
// piece by piece gives the same value as one call over the concatenation.
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n);

inline uint32_t Crc32c(const void* data, size_t n) { return Crc32cExtend(0, data, n); }

// The CRC-32C of A followed by B from crc_a = Crc32c(A), crc_b = Crc32c(B) and B's length
// (zlib's crc32_combine for the Castagnoli polynomial: O(log len_b) 32x32 GF(2) matrix squarings,
// no data read). Lets pieces of a stream be hashed as they arrive in another order (the prefill
// node hashes each KV head's pages as they complete and combines the heads at the layer's end).
uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

}  // namespace fluxion::transfer

#endif  // FLUXION_TRANSFER_CRC32C_H_

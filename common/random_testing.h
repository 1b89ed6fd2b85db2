// Test data shared by the kernel and model tests (header-only, tests only).
#ifndef FLUXION_COMMON_RANDOM_TESTING_H_
#define FLUXION_COMMON_RANDOM_TESTING_H_

#include <cstddef>
#include <random>
#include <vector>

#include "common/half.h"

namespace fluxion {

// n draws of N(0, sd^2) from an Engine seeded with `seed`. The engine is a parameter so that a
// test keeps the data it was written (and its tolerances measured) against.
template <typename Engine = std::mt19937>
std::vector<float> RandomNormal(size_t n, typename Engine::result_type seed, float sd = 1.0f) {
  Engine rng(seed);
  std::normal_distribution<float> dist(0.0f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Every value rounded to the nearest bf16 (kept as float).
inline std::vector<float> RoundedToBf16(std::vector<float> v) {
  for (float& x : v) x = RoundToBf16(x);
  return v;
}

inline std::vector<bf16> ToBf16(const std::vector<float>& v) {
  std::vector<bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = FloatToBf16(v[i]);
  return out;
}

}  // namespace fluxion

#endif  // FLUXION_COMMON_RANDOM_TESTING_H_

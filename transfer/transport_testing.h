// Test-only: what the transfer tests share. The compatibility record every test transport
// advertises (any two built from it connect), and a UCX configuration to parameterise over.
#ifndef FLUXION_TRANSFER_TRANSPORT_TESTING_H_
#define FLUXION_TRANSFER_TRANSPORT_TESTING_H_

#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "transfer/transport.h"

namespace fluxion::transfer {

inline CompatibilityRecord TestCompat() {
  CompatibilityRecord c;
  c.model_id = "sha256:test-model";
  c.kv_dtype = 2;
  c.num_layers = 4;
  c.num_kv_heads = 2;
  c.head_dim = 128;
  c.page_tokens = 16;
  c.layout_version = 1;
  return c;
}

// A UCX configuration under test: UcxOptions::config and peer error handling, named.
struct UcxTestConfig {
  std::string name;
  std::vector<std::pair<std::string, std::string>> ucx;
  bool peer_error_handling;
};

inline void PrintTo(const UcxTestConfig& c, std::ostream* os) { *os << c.name; }

}  // namespace fluxion::transfer

#endif  // FLUXION_TRANSFER_TRANSPORT_TESTING_H_

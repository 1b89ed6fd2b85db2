// Test-only: the transfer secret (--transfer-secret-file, proto/prefill_seal.h) shared by every
// decode and prefill node a test process starts. One file per test process, made on first use
// with a fresh random secret and removed when the process exits.
#ifndef FLUXION_TESTS_TRANSFER_SECRET_TESTING_H_
#define FLUXION_TESTS_TRANSFER_SECRET_TESTING_H_

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "proto/prefill_seal.h"

namespace fluxion::testing {

inline const std::string& TestTransferSecretFile() {
  static const std::string* const path = [] {
    auto* p = new std::string("/tmp/fluxion-test-transfer-secret-" + std::to_string(getpid()));
    const absl::Status made = proto::WriteNewTransferSecret(*p);
    if (!made.ok()) {  // a test machine without a writable /tmp: nothing can start
      std::fprintf(stderr, "cannot write the test transfer secret: %s\n",
                   std::string(made.message()).c_str());
      std::abort();
    }
    std::atexit([] { std::remove(TestTransferSecretFile().c_str()); });
    return p;
  }();
  return *path;
}

// `--transfer-secret-file <the test's file>` for the commands that need one (decode, prefill).
inline std::vector<std::string> TransferSecretArgs(const std::string& command) {
  if (command != "decode" && command != "prefill") return {};
  return {"--transfer-secret-file", TestTransferSecretFile()};
}

}  // namespace fluxion::testing

#endif  // FLUXION_TESTS_TRANSFER_SECRET_TESTING_H_

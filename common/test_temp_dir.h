#ifndef FLUXION_COMMON_TEST_TEMP_DIR_H_
#define FLUXION_COMMON_TEST_TEMP_DIR_H_

// Test-only: a fresh directory per running test. ctest runs every test of a binary as its own
// process, in parallel, so a fixed file name under ::testing::TempDir() is shared by tests that
// run at the same moment and one overwrites the other's input (the CI failure of stop 9). The
// directory is named after the test suite, the test and the process, and is removed, with
// everything in it, at scope exit.

#include <unistd.h>

#include <filesystem>
#include <string>
#include <system_error>

#include "gtest/gtest.h"

namespace fluxion {

class ScopedTestTempDir {
 public:
  ScopedTestTempDir() {
    const ::testing::TestInfo* test = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = "fluxion_";
    name += test ? std::string(test->test_suite_name()) + "_" + test->name() : "no_test";
    name += "_" + std::to_string(::getpid());
    for (char& c : name) {
      if (c == '/') c = '_';  // parameterised test names contain '/'
    }
    path_ = std::filesystem::path(::testing::TempDir()) / name;
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
    std::filesystem::create_directories(path_, ignored);
  }
  ~ScopedTestTempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  ScopedTestTempDir(const ScopedTestTempDir&) = delete;
  ScopedTestTempDir& operator=(const ScopedTestTempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::string dir() const { return path_.string(); }
  std::string File(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

}  // namespace fluxion

#endif  // FLUXION_COMMON_TEST_TEMP_DIR_H_

# Per-folder target helpers in the style of abseil's absl_cc_library / absl_cc_test.
#
#   fluxion_cc_library(NAME foo HDRS a.h SRCS a.cc DEPS fluxion::common absl::status)
#     -> target fluxion_foo, alias fluxion::foo. Include paths are from the repo root
#        ("model/config.h"), so every header is named by its folder.
#   fluxion_cc_test(NAME foo_test SRCS foo_test.cc DEPS fluxion::foo LABELS unit)
#     -> executable registered with ctest through gtest_discover_tests.
#   fluxion_fuzz_target(NAME foo_fuzz SRCS foo_fuzz.cc DEPS fluxion::foo)
#     -> a libFuzzer executable (LLVMFuzzerTestOneInput) when FLUXION_FUZZ is on (clang only);
#        its seed corpus is tests/fuzz/corpus/<NAME>/ and it is registered with ctest (label
#        "fuzz") to replay that corpus once. Nothing is built otherwise. docs/FUZZING.md.
#
# Sanitizers. FLUXION_SANITIZE is passed to -fsanitize= for every target made here (e.g.
# "address,undefined"); undefined behaviour then aborts (-fno-sanitize-recover) so a test fails on
# it instead of printing a warning. With FLUXION_FUZZ every library is also compiled with
# -fsanitize=fuzzer-no-link,address,undefined: without the coverage instrumentation in the code
# under test libFuzzer would only see the few lines of the target itself.

function(fluxion_set_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter -Wno-sign-compare>)
  if(FLUXION_WERROR)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Werror>)
  endif()
  if(FLUXION_SANITIZE)
    target_compile_options(${target} PRIVATE -fsanitize=${FLUXION_SANITIZE} -fno-omit-frame-pointer
                                             -fno-sanitize-recover=all)
    target_link_options(${target} PRIVATE -fsanitize=${FLUXION_SANITIZE})
  endif()
  if(FLUXION_FUZZ)
    target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CXX,C>:-fsanitize=fuzzer-no-link,address,undefined
      -fno-sanitize-recover=all -fno-omit-frame-pointer>)
    # So that other executables of a fuzz build (tests, the CLI) still link.
    target_link_options(${target} PRIVATE -fsanitize=fuzzer-no-link,address,undefined)
  endif()
endfunction()

function(fluxion_cc_library)
  cmake_parse_arguments(F "" "NAME" "HDRS;SRCS;DEPS;PRIVATE_DEPS;COPTS" ${ARGN})
  set(target fluxion_${F_NAME})
  if(F_SRCS)
    add_library(${target} STATIC ${F_SRCS} ${F_HDRS})
    target_include_directories(${target} PUBLIC ${PROJECT_SOURCE_DIR})
    target_link_libraries(${target} PUBLIC ${F_DEPS} PRIVATE ${F_PRIVATE_DEPS})
    target_compile_options(${target} PRIVATE ${F_COPTS})
    fluxion_set_warnings(${target})
  else()
    add_library(${target} INTERFACE ${F_HDRS})
    target_include_directories(${target} INTERFACE ${PROJECT_SOURCE_DIR})
    target_link_libraries(${target} INTERFACE ${F_DEPS})
  endif()
  add_library(fluxion::${F_NAME} ALIAS ${target})
endfunction()

function(fluxion_cc_test)
  if(NOT FLUXION_BUILD_TESTS)
    return()
  endif()
  cmake_parse_arguments(F "" "NAME" "SRCS;DEPS;LABELS" ${ARGN})
  add_executable(${F_NAME} ${F_SRCS})
  target_include_directories(${F_NAME} PRIVATE ${PROJECT_SOURCE_DIR})
  target_link_libraries(${F_NAME} PRIVATE ${F_DEPS} GTest::gmock GTest::gtest_main)
  fluxion_set_warnings(${F_NAME})
  if(NOT F_LABELS)
    set(F_LABELS unit)
  endif()
  # The `unit_tests` target (top CMakeLists.txt) builds every unit-labelled test executable: the
  # sanitizer stage of tools/test.sh builds exactly those.
  if("unit" IN_LIST F_LABELS)
    set_property(GLOBAL APPEND PROPERTY FLUXION_UNIT_TEST_TARGETS ${F_NAME})
  endif()
  # Tests find their data through FLUXION_SOURCE_DIR so they run from any working directory.
  gtest_discover_tests(${F_NAME}
    PROPERTIES LABELS "${F_LABELS}"
               ENVIRONMENT "FLUXION_SOURCE_DIR=${PROJECT_SOURCE_DIR}"
    DISCOVERY_TIMEOUT 60)
endfunction()

function(fluxion_fuzz_target)
  if(NOT FLUXION_FUZZ)
    return()
  endif()
  cmake_parse_arguments(F "" "NAME" "SRCS;DEPS" ${ARGN})
  add_executable(${F_NAME} ${F_SRCS})
  target_include_directories(${F_NAME} PRIVATE ${PROJECT_SOURCE_DIR})
  target_link_libraries(${F_NAME} PRIVATE ${F_DEPS})
  fluxion_set_warnings(${F_NAME})
  target_compile_options(${F_NAME} PRIVATE -fsanitize=fuzzer,address,undefined
                                           -fno-sanitize-recover=all)
  target_link_options(${F_NAME} PRIVATE -fsanitize=fuzzer,address,undefined)
  set(corpus ${PROJECT_SOURCE_DIR}/tests/fuzz/corpus/${F_NAME})
  if(NOT IS_DIRECTORY ${corpus})
    message(WARNING "fuzz target ${F_NAME} has no seed corpus in ${corpus}")
    return()
  endif()
  # One pass over the committed corpus (every seed and every past crash must pass); the timed
  # runs are tools/fuzz.sh. -runs=0 executes the given inputs and stops.
  add_test(NAME ${F_NAME}_corpus COMMAND ${F_NAME} -runs=0 ${corpus})
  set_tests_properties(${F_NAME}_corpus PROPERTIES LABELS fuzz)
endfunction()

# Per-folder target helpers in the style of abseil's absl_cc_library / absl_cc_test.
#
#   fluxion_cc_library(NAME foo HDRS a.h SRCS a.cc DEPS fluxion::common absl::status)
#     -> target fluxion_foo, alias fluxion::foo. Include paths are from the repo root
#        ("model/config.h"), so every header is named by its folder.
#   fluxion_cc_test(NAME foo_test SRCS foo_test.cc DEPS fluxion::foo LABELS unit)
#     -> executable registered with ctest through gtest_discover_tests.
#   fluxion_fuzz_target(NAME foo_fuzz SRCS foo_fuzz.cc DEPS fluxion::foo)
#     -> a libFuzzer executable (LLVMFuzzerTestOneInput) when FLUXION_FUZZ is on (clang only);
#        its seed corpus is tests/fuzz/corpus/<NAME>/. Nothing is built otherwise.

function(fluxion_set_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter -Wno-sign-compare>)
  if(FLUXION_WERROR)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Werror>)
  endif()
  if(FLUXION_SANITIZE)
    target_compile_options(${target} PRIVATE -fsanitize=${FLUXION_SANITIZE} -fno-omit-frame-pointer)
    target_link_options(${target} PRIVATE -fsanitize=${FLUXION_SANITIZE})
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
  target_compile_options(${F_NAME} PRIVATE -fsanitize=fuzzer,address,undefined)
  target_link_options(${F_NAME} PRIVATE -fsanitize=fuzzer,address,undefined)
  fluxion_set_warnings(${F_NAME})
endfunction()

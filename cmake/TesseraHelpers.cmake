# Build helpers shared by every folder.

include_guard(GLOBAL)

# tessera_add_test(NAME <name> SOURCES <files...> [LIBS <targets...>]
#                  [LABEL <label>] [TIMEOUT <seconds>])
#
# Builds a GoogleTest binary into build/tests/ and registers each of its test
# cases with ctest (gtest_discover_tests), so `ctest -R` and `ctest -L` work at
# test-case granularity. Every test gets the label "unit" unless LABEL says
# otherwise ("integration" for multi-process tests, "gpu" for CUDA-only
# tests). One label only: gtest_discover_tests flattens list-valued properties.
function(tessera_add_test)
  cmake_parse_arguments(ARG "" "NAME;TIMEOUT;LABEL" "SOURCES;LIBS" ${ARGN})
  if(NOT ARG_NAME OR NOT ARG_SOURCES)
    message(FATAL_ERROR "tessera_add_test needs NAME and SOURCES")
  endif()
  if(NOT ARG_LABEL)
    set(ARG_LABEL unit)
  endif()
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 120)
  endif()
  add_executable(${ARG_NAME} ${ARG_SOURCES})
  target_link_libraries(${ARG_NAME} PRIVATE ${ARG_LIBS} GTest::gmock GTest::gtest_main)
  # GCC 12 at -O3 warns -Wrestrict inside GoogleTest's printer of protobuf messages
  # (gtest-printers.h, std::string's operator+ inlined: GCC bug 105329), a false positive in a
  # header the project does not own; the project's own libraries keep the warning.
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    target_compile_options(${ARG_NAME} PRIVATE -Wno-restrict)
  endif()
  set_target_properties(${ARG_NAME} PROPERTIES
    RUNTIME_OUTPUT_DIRECTORY "${CMAKE_BINARY_DIR}/tests")
  gtest_discover_tests(${ARG_NAME}
    DISCOVERY_TIMEOUT 60
    PROPERTIES
      LABELS ${ARG_LABEL}
      TIMEOUT ${ARG_TIMEOUT})
endfunction()

# tessera_add_binary(<name> SOURCES <files...> LIBS <targets...>)
#
# A user-facing executable; lands in build/bin/.
function(tessera_add_binary name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_LIBS})
  set_target_properties(${name} PROPERTIES
    RUNTIME_OUTPUT_DIRECTORY "${CMAKE_BINARY_DIR}/bin")
endfunction()

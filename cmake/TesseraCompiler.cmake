# Compiler settings: C++20, warnings, and the build cache.

include_guard(GLOBAL)

set(CMAKE_CXX_STANDARD 20)
set(CMAKE_CXX_STANDARD_REQUIRED ON)
set(CMAKE_CXX_EXTENSIONS OFF)
# No CMAKE_POSITION_INDEPENDENT_CODE: every library is static, and Debian's
# compiler builds position-independent executables by default. Adding -fPIC to
# libraries but -fPIE to executables would make the LibTorch precompiled
# header unusable across them (GCC rejects a PCH built with other -fpie).
set(CMAKE_EXPORT_COMPILE_COMMANDS ON)

if(NOT CMAKE_BUILD_TYPE AND NOT CMAKE_CONFIGURATION_TYPES)
  set(CMAKE_BUILD_TYPE Release CACHE STRING "Build type" FORCE)
endif()

# -Wno-missing-field-initializers: the code builds options structs with C++20 designated
# initializers that name only the fields they set (the others keep their defaults); GCC before 14
# warns about every such omission.
add_compile_options(-Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers)
# The project's own code builds without a warning; TESSERA_WERROR (on in `make`, the README's
# commands and CI) keeps it so. Third-party headers come in as -isystem, outside its reach.
option(TESSERA_WERROR "Treat the project's compiler warnings as errors" OFF)
if(TESSERA_WERROR)
  add_compile_options($<$<COMPILE_LANGUAGE:CXX>:-Werror>)
endif()

# ccache makes rebuilds and fresh clones on the same machine cheap. The base
# dir makes cache keys relative to the source tree, so a clone at another path
# (CI's clean clone) hits the cache too; the sloppiness lets it cache
# translation units that use a precompiled header.
option(TESSERA_USE_CCACHE "Compile through ccache when it is installed" ON)
find_program(TESSERA_CCACHE ccache)
if(TESSERA_USE_CCACHE AND TESSERA_CCACHE)
  set(_tessera_launcher
    ${CMAKE_COMMAND} -E env
      "CCACHE_BASEDIR=${CMAKE_SOURCE_DIR}"
      "CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime"
      "CCACHE_NOHASHDIR=1"
      ${TESSERA_CCACHE})
  set(CMAKE_C_COMPILER_LAUNCHER ${_tessera_launcher})
  set(CMAKE_CXX_COMPILER_LAUNCHER ${_tessera_launcher})
  set(CMAKE_CUDA_COMPILER_LAUNCHER ${_tessera_launcher})
  message(STATUS "Tessera: compiling through ${TESSERA_CCACHE}")
endif()

# Finds LibTorch (from the `torch` wheel) and CUDA, and defines one target,
# tessera::torch, for the code that needs LibTorch.
#
# TESSERA_PYTHON names the interpreter that holds torch (scripts/bootstrap.sh
# prints it); CMake learns the LibTorch location from torch.utils.cmake_prefix_path.
#
# TESSERA_WITH_CUDA:
#   AUTO  CUDA paths on when the toolkit (nvcc) is found and torch was built with CUDA
#   ON    the same, but a missing toolkit is an error
#   OFF   CPU only: link libtorch_cpu and libc10 and nothing of CUDA
# With CUDA, tessera::torch is the full `torch` target of TorchConfig.cmake
# (torch_cuda, c10_cuda, NCCL through c10d) and code sees TESSERA_WITH_CUDA=1.
# The build never needs a GPU, only the toolkit.

include_guard(GLOBAL)

set(TESSERA_WITH_CUDA "AUTO" CACHE STRING "Build the CUDA code paths: AUTO, ON or OFF")
set_property(CACHE TESSERA_WITH_CUDA PROPERTY STRINGS AUTO ON OFF)

if(NOT TESSERA_PYTHON)
  find_program(TESSERA_PYTHON python3 REQUIRED)
endif()

execute_process(
  COMMAND "${TESSERA_PYTHON}" -c
    "import torch, torch.utils; print(torch.utils.cmake_prefix_path); print(torch.__version__.split('+')[0]); print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(torch.version.cuda or '')"
  OUTPUT_VARIABLE _torch_info
  RESULT_VARIABLE _torch_rc
  ERROR_VARIABLE _torch_err
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _torch_rc EQUAL 0)
  message(FATAL_ERROR
    "Tessera: ${TESSERA_PYTHON} cannot import torch (${_torch_err}). "
    "Run scripts/bootstrap.sh, or pass -DTESSERA_PYTHON=<python with torch>.")
endif()
string(REPLACE "\n" ";" _torch_info "${_torch_info}")
list(GET _torch_info 0 TESSERA_TORCH_CMAKE_PREFIX)
list(GET _torch_info 1 TESSERA_TORCH_VERSION)
list(GET _torch_info 2 TESSERA_TORCH_CXX11_ABI)
list(LENGTH _torch_info _n)
set(TESSERA_TORCH_CUDA_VERSION "")
if(_n GREATER 3)
  list(GET _torch_info 3 TESSERA_TORCH_CUDA_VERSION)
endif()
get_filename_component(TESSERA_TORCH_ROOT "${TESSERA_TORCH_CMAKE_PREFIX}/../.." ABSOLUTE)
message(STATUS "Tessera: torch ${TESSERA_TORCH_VERSION} at ${TESSERA_TORCH_ROOT} "
               "(CUDA '${TESSERA_TORCH_CUDA_VERSION}', cxx11 abi ${TESSERA_TORCH_CXX11_ABI})")
if(NOT TESSERA_TORCH_VERSION VERSION_GREATER_EQUAL 2.11 OR TESSERA_TORCH_VERSION VERSION_GREATER_EQUAL 2.12)
  message(WARNING "Tessera is pinned to torch 2.11.x; found ${TESSERA_TORCH_VERSION}")
endif()

# Decide on CUDA.
set(_want_cuda OFF)
if(NOT TESSERA_WITH_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER AND TESSERA_TORCH_CUDA_VERSION)
    set(_want_cuda ON)
  elseif(TESSERA_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "TESSERA_WITH_CUDA=ON but no CUDA toolkit (nvcc) was found "
                        "or torch ${TESSERA_TORCH_VERSION} has no CUDA")
  endif()
endif()
set(TESSERA_CUDA_ENABLED ${_want_cuda} CACHE INTERNAL "CUDA code paths are built")

add_library(tessera_torch INTERFACE)
add_library(tessera::torch ALIAS tessera_torch)
target_compile_definitions(tessera_torch INTERFACE
  _GLIBCXX_USE_CXX11_ABI=${TESSERA_TORCH_CXX11_ABI})
# The wheel's include/ also carries the headers of the protobuf it was built
# with (include/google/protobuf, an older release than Debian's). On the
# include path they would shadow Debian's and break every translation unit
# that uses both LibTorch and our generated protos. So Tessera compiles
# against a mirror of include/ made of links to every entry but google/.
set(_torch_headers "${CMAKE_BINARY_DIR}/torch-include")
file(GLOB _entries RELATIVE "${TESSERA_TORCH_ROOT}/include" "${TESSERA_TORCH_ROOT}/include/*")
file(REMOVE_RECURSE "${_torch_headers}")
file(MAKE_DIRECTORY "${_torch_headers}")
foreach(_entry IN LISTS _entries)
  if(NOT _entry STREQUAL "google")
    file(CREATE_LINK "${TESSERA_TORCH_ROOT}/include/${_entry}" "${_torch_headers}/${_entry}" SYMBOLIC)
  endif()
endforeach()
# LibTorch headers warn a lot under -Wextra; they are not ours to fix.
target_include_directories(tessera_torch SYSTEM INTERFACE
  "${_torch_headers}"
  "${_torch_headers}/torch/csrc/api/include")

if(TESSERA_CUDA_ENABLED)
  # Hopper (H100/H200) is the GPU the project targets. Naming it also keeps
  # TorchConfig from probing for installed GPUs, which fails on CPU machines.
  if(NOT TORCH_CUDA_ARCH_LIST)
    set(TORCH_CUDA_ARCH_LIST "9.0")
  endif()
  # TorchConfig takes TORCH_CUDA_ARCH_LIST and warns when this is also set.
  unset(CMAKE_CUDA_ARCHITECTURES)
  unset(CMAKE_CUDA_ARCHITECTURES CACHE)
  if(NOT CUDAToolkit_ROOT)
    get_filename_component(CUDAToolkit_ROOT "${CMAKE_CUDA_COMPILER}/../.." ABSOLUTE)
  endif()
  list(APPEND CMAKE_PREFIX_PATH "${TESSERA_TORCH_CMAKE_PREFIX}")
  find_package(Torch REQUIRED)
  # TorchConfig's targets carry the wheel's include/ itself; point them at the
  # mirror above instead.
  foreach(_target torch torch_cpu torch_cuda c10 c10_cuda torch_library)
    if(TARGET ${_target})
      get_target_property(_dirs ${_target} INTERFACE_INCLUDE_DIRECTORIES)
      if(_dirs)
        list(TRANSFORM _dirs REPLACE "^${TESSERA_TORCH_ROOT}/include" "${_torch_headers}")
        set_target_properties(${_target} PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${_dirs}")
      endif()
    endif()
  endforeach()
  # TorchConfig adds its flags to TORCH_CXX_FLAGS; the definitions above cover them.
  target_link_libraries(tessera_torch INTERFACE ${TORCH_LIBRARIES})
  target_compile_definitions(tessera_torch INTERFACE TESSERA_WITH_CUDA=1)
  message(STATUS "Tessera: CUDA code paths ON (torch CUDA ${TESSERA_TORCH_CUDA_VERSION}, "
                 "nvcc ${CMAKE_CUDA_COMPILER_VERSION})")
else()
  # TorchConfig.cmake of a CUDA wheel insists on a CUDA toolkit, so the CPU
  # build names the two libraries it needs directly.
  find_library(TESSERA_TORCH_CPU_LIB torch_cpu PATHS "${TESSERA_TORCH_ROOT}/lib" NO_DEFAULT_PATH REQUIRED)
  find_library(TESSERA_C10_LIB c10 PATHS "${TESSERA_TORCH_ROOT}/lib" NO_DEFAULT_PATH REQUIRED)
  target_link_libraries(tessera_torch INTERFACE ${TESSERA_TORCH_CPU_LIB} ${TESSERA_C10_LIB})
  target_compile_definitions(tessera_torch INTERFACE TESSERA_WITH_CUDA=0)
  message(STATUS "Tessera: CUDA code paths OFF")
endif()
# libtorch.so and libtorch_cpu.so export their own copies of std::filesystem
# (statically linked from a newer libstdc++), and some of them crash when
# called with this compiler's types (remove_all segfaults). The dynamic linker
# binds each symbol to the first library that defines it, in DT_NEEDED order,
# so every binary that links LibTorch names libstdc++ first, as Python's
# interpreter does by loading it before torch.
target_link_options(tessera_torch INTERFACE "LINKER:--push-state,--no-as-needed" "-lstdc++"
  "LINKER:--pop-state")
# Binaries find LibTorch where it was built against, without LD_LIBRARY_PATH.
set(CMAKE_BUILD_RPATH "${TESSERA_TORCH_ROOT}/lib" ${CMAKE_BUILD_RPATH})

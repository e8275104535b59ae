# model part of tessera_trainer: sources and tests (see CMakeLists.txt).
# hf_weights.cc: Hugging Face import and export of the model's weights; linear_cross_entropy.cc: the
# head and its loss in chunks, without the whole logits; fused_ops.cc: RMSNorm, rotary and SwiGLU
# as CUDA kernels (norm_kernels.cu, fused_ops_kernels.cu) with ATen's composite as the fallback, and RMSNorm,
# SwiGLU and GELU (fused_ops_cpu.cc) and rotary (fused_rotary_cpu.cc) as CPU kernels.
target_sources(tessera_trainer PRIVATE activation_checkpoint.cc model.cc tensor_parallel.cc
  hf_weights.cc linear_cross_entropy.cc fused_ops.cc fused_ops_cpu.cc fused_rotary_cpu.cc)

# The CPU kernels split their work with at::parallel_for, which runs on OpenMP threads only in a
# translation unit compiled with -fopenmp. They must share LibTorch's OpenMP runtime (the wheel
# ships its own libgomp.so.1, which its kernels use; a second runtime would start a second pool of
# threads on the same cores), so the file is built with -fopenmp only when that runtime is there
# to link. Without it the kernels run on the calling thread. -fopenmp changes the predefined
# macros, so the file cannot share the precompiled header.
find_library(TESSERA_TORCH_OPENMP_LIB NAMES libgomp.so.1
  PATHS "${TESSERA_TORCH_ROOT}/lib" NO_DEFAULT_PATH)
# fused_rotary_cpu.cc rounds every product before the add after it (-ffp-contract=off): its
# results are the composite's bit for bit.
set_source_files_properties(fused_ops_cpu.cc fused_rotary_cpu.cc
  PROPERTIES SKIP_PRECOMPILE_HEADERS ON)
set(TESSERA_ROTARY_CPU_OPTIONS -ffp-contract=off -fopenmp-simd)
if(TESSERA_TORCH_OPENMP_LIB)
  set_source_files_properties(fused_ops_cpu.cc PROPERTIES COMPILE_OPTIONS -fopenmp)
  list(APPEND TESSERA_ROTARY_CPU_OPTIONS -fopenmp)
  target_link_libraries(tessera_trainer PUBLIC "${TESSERA_TORCH_OPENMP_LIB}")
else()
  message(STATUS "LibTorch has no libgomp.so.1 of its own: the CPU kernels run single-threaded")
endif()
set_source_files_properties(fused_rotary_cpu.cc PROPERTIES
  COMPILE_OPTIONS "${TESSERA_ROTARY_CPU_OPTIONS}")

if(TESSERA_CUDA_ENABLED)
  # The kernels alone, without LibTorch's headers (slow under nvcc) or its usage requirements. The
  # architectures come from TORCH_CUDA_ARCH_LIST: TorchConfig puts its -gencode flags into
  # CMAKE_CUDA_FLAGS (cmake/TesseraTorch.cmake), so CMake adds none (CUDA_ARCHITECTURES OFF). The
  # runtime is the shared libcudart that LibTorch links: kernels and LibTorch share one runtime.
  add_library(tessera_fused_kernels OBJECT fused_ops_kernels.cu norm_kernels.cu)
  target_include_directories(tessera_fused_kernels PRIVATE "${PROJECT_SOURCE_DIR}")
  set_target_properties(tessera_fused_kernels PROPERTIES
    CUDA_STANDARD 17
    CUDA_STANDARD_REQUIRED ON
    CUDA_RUNTIME_LIBRARY Shared
    CUDA_ARCHITECTURES OFF
    # add_compile_options' -Wall -Wextra are host-compiler flags nvcc does not take directly.
    COMPILE_OPTIONS "-Xcompiler=-Wall,-Wextra,-Wno-unused-parameter")
  target_sources(tessera_trainer PRIVATE $<TARGET_OBJECTS:tessera_fused_kernels>)
endif()

if(TESSERA_BUILD_TESTS)
  tessera_add_test(NAME model_test
    SOURCES model_test.cc
    LIBS tessera::trainer)
  target_precompile_headers(model_test REUSE_FROM tessera_trainer)

  # The loss under a loss mask (prompt masking), plain and vocab-parallel on in-process Gloo.
  tessera_add_test(NAME loss_mask_test
    SOURCES loss_mask_test.cc
    LIBS tessera::trainer)
  target_precompile_headers(loss_mask_test REUSE_FROM tessera_trainer)
  target_include_directories(loss_mask_test SYSTEM PRIVATE "${TESSERA_GLOO_INCLUDE_DIR}")

  # The language-model head and its loss in chunks against linear + cross_entropy.
  tessera_add_test(NAME linear_cross_entropy_test
    SOURCES linear_cross_entropy_test.cc
    LIBS tessera::trainer)
  target_precompile_headers(linear_cross_entropy_test REUSE_FROM tessera_trainer)

  # The fused RMSNorm, rotary and SwiGLU against ATen's composite: the CPU fallback bitwise
  # (fused_ops_test), the CUDA kernels' forward and gradients on a GPU when there is one
  # (fused_ops_gpu_test; every case skips without one).
  foreach(fused_test fused_ops_test fused_ops_gpu_test)
    tessera_add_test(NAME ${fused_test}
      SOURCES ${fused_test}.cc
      LIBS tessera::trainer)
    target_precompile_headers(${fused_test} REUSE_FROM tessera_trainer)
  endforeach()

  tessera_add_test(NAME activation_checkpoint_test
    SOURCES activation_checkpoint_test.cc
    LIBS tessera::trainer)
  target_precompile_headers(activation_checkpoint_test REUSE_FROM tessera_trainer)
endif()

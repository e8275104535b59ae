# fused_ops_bench: the fused RMSNorm / rotary / SwiGLU / cross-entropy CUDA kernels
# (trainer/kernels/fused_ops.h) against ATen's composite, forward + backward in bf16 at one Qwen3-0.6B and
# one Llama-3-8B layer's shapes
# (make bench-gpu, make gpu-check). Links LibTorch through tessera::trainer.

add_executable(fused_ops_bench fused_ops_bench.cc)
target_link_libraries(fused_ops_bench PRIVATE tessera::trainer tessera_bench_env absl::flags)
tessera_use_torch_pch(fused_ops_bench)
set_target_properties(fused_ops_bench PROPERTIES
  RUNTIME_OUTPUT_DIRECTORY "${CMAKE_BINARY_DIR}/bench")

if(TESSERA_BUILD_TESTS)
  # Smoke run on the CPU (both paths are the composite there): the benchmark runs end to end and
  # writes its JSON. Nothing timed is asserted.
  add_test(NAME fused_ops_bench_smoke
    COMMAND fused_ops_bench --smoke --rounds=1 --iterations=2)
  set_tests_properties(fused_ops_bench_smoke PROPERTIES
    LABELS unit
    TIMEOUT 120
    ENVIRONMENT "TESSERA_BENCH_RESULTS=${CMAKE_CURRENT_BINARY_DIR}/smoke-results")
endif()

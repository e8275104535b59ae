# checkpoint_bench: save and load throughput of the trainer's checkpoint path
# (WriteTrainingState + PrepareStaging/CommitCheckpoint; ResumeLatest) against a
# plain sequential write and read of the same bytes.
# Links LibTorch through tessera::trainer, so it inherits the libstdc++-first
# link order of tessera::torch (docs/build.md).

add_executable(checkpoint_bench checkpoint_bench.cc checkpoint_bench_files.cc)
target_link_libraries(checkpoint_bench PRIVATE tessera::trainer tessera_bench_env absl::flags absl::time)
tessera_use_torch_pch(checkpoint_bench)
# No LibTorch in the file helpers: they skip the LibTorch precompiled header.
set_source_files_properties(checkpoint_bench_files.cc PROPERTIES SKIP_PRECOMPILE_HEADERS ON)
set_target_properties(checkpoint_bench PROPERTIES
  RUNTIME_OUTPUT_DIRECTORY "${CMAKE_BINARY_DIR}/bench")

if(TESSERA_BUILD_TESTS)
  # Smoke run on a tiny model: the benchmark runs end to end and writes its
  # JSON. Nothing timed is asserted.
  add_test(NAME checkpoint_bench_smoke
    COMMAND checkpoint_bench --layers=1 --hidden=64 --vocab=257 --runs=1)
  set_tests_properties(checkpoint_bench_smoke PROPERTIES
    LABELS unit
    TIMEOUT 120
    ENVIRONMENT "TESSERA_BENCH_RESULTS=${CMAKE_CURRENT_BINARY_DIR}/smoke-results")
endif()

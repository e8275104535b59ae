# step_metrics_bench: what step metrics cost on a long job (the coordinator's
# MetricsCompleteThrough on SQLite and PostgreSQL against ReadMetrics and the scan it replaced;
# rank 0's per-save snapshot against a model shard's write). No LibTorch: the store and the
# trainer's file formats only.

find_package(nlohmann_json REQUIRED)

add_executable(step_metrics_bench step_metrics_bench.cc)
target_link_libraries(step_metrics_bench PRIVATE
  tessera::store tessera::trainer_io tessera::postgres_cluster tessera_bench_env
  absl::flags absl::str_format absl::strings nlohmann_json::nlohmann_json)
set_target_properties(step_metrics_bench PROPERTIES
  RUNTIME_OUTPUT_DIRECTORY "${CMAKE_BINARY_DIR}/bench")

if(TESSERA_BUILD_TESTS)
  # Smoke run at a small size on SQLite (~1 s): every figure is measured and checked against
  # what was written (the mark, the scan and ReadMetrics agree); nothing timed is asserted.
  add_test(NAME step_metrics_bench_smoke
    COMMAND step_metrics_bench --points=3000 --backends=sqlite --runs=1 --shard_mb=1)
  set_tests_properties(step_metrics_bench_smoke PROPERTIES
    LABELS unit
    TIMEOUT 120
    ENVIRONMENT "TESSERA_BENCH_RESULTS=${CMAKE_CURRENT_BINARY_DIR}/smoke-results")
endif()

# control_plane_bench: the coordinator at 100 / 1,000 / 10,000 simulated
# nodes (scripts/bench.sh runs it with --coordinator). Links no LibTorch: it
# speaks the proto contract to the real tessera-coordinator binary.

find_package(nlohmann_json REQUIRED)

# The load generator's parts, compiled once for the benchmark and its tests.
add_library(tessera_control_plane_load STATIC
  control_plane_backends.cc
  control_plane_fleet.cc
  control_plane_jobs.cc
  control_plane_process.cc
  control_plane_prometheus.cc
  control_plane_queues.cc
  control_plane_report.cc
  control_plane_scale.cc
  control_plane_stats.cc)
target_link_libraries(tessera_control_plane_load PUBLIC
  tessera::daemon tessera::postgres_cluster tessera::queues tessera::proto tessera_bench_env
  absl::flags absl::str_format absl::synchronization absl::time
  nlohmann_json::nlohmann_json Threads::Threads)
add_executable(control_plane_bench control_plane_bench.cc)
target_link_libraries(control_plane_bench PRIVATE tessera_control_plane_load)
# The load generator shares the machine with the coordinator it measures, so it should take as
# little CPU as it can: jemalloc, as the coordinator links it (glibc's malloc was ~14% of the
# generator's samples at 500 jobs/s).
if(TESSERA_COORDINATOR_JEMALLOC)
  find_package(PkgConfig REQUIRED)
  pkg_check_modules(JEMALLOC IMPORTED_TARGET jemalloc)
  if(JEMALLOC_FOUND)
    target_link_libraries(control_plane_bench PRIVATE PkgConfig::JEMALLOC)
  endif()
endif()
set_target_properties(control_plane_bench PROPERTIES
  RUNTIME_OUTPUT_DIRECTORY "${CMAKE_BINARY_DIR}/bench")
# It starts the real coordinator.
add_dependencies(control_plane_bench tessera-coordinator)

if(TESSERA_BUILD_TESTS)
  # The queues scenario's file (parsed as the coordinator does) and its comparison.
  tessera_add_test(NAME control_plane_queues_test
    SOURCES control_plane_queues_test.cc LIBS tessera_control_plane_load)
  # --backends and the PostgreSQL / SQLite comparison.
  tessera_add_test(NAME control_plane_backends_test
    SOURCES control_plane_backends_test.cc LIBS tessera_control_plane_load tessera::test_util)
  # The benchmark end to end at a small size, both scenarios, on SQLite and (when its binaries
  # are there) PostgreSQL (~30 s): the real coordinator takes the queue file, jobs flow, the
  # comparisons are printed.
  add_test(NAME control_plane_bench_smoke
    COMMAND control_plane_bench --coordinator=$<TARGET_FILE:tessera-coordinator> --nodes=40
      --jobs_per_s=10 --job_gpus=1,8 --job_weights=1,1 --queues=5 --queue_cohorts=2
      --warmup_s=1 --duration_s=2 --windows=1
      --results_dir=${CMAKE_CURRENT_BINARY_DIR}/control_plane_bench_smoke)
  set_tests_properties(control_plane_bench_smoke PROPERTIES LABELS integration TIMEOUT 120
    PASS_REGULAR_EXPRESSION "40 nodes, queues against the single pool")
endif()

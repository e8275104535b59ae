# control_plane_bench: the coordinator at 100 / 1,000 / 10,000 simulated
# nodes (scripts/bench.sh runs it with --coordinator). Links no LibTorch: it
# speaks the proto contract to the real tessera-coordinator binary.

find_package(nlohmann_json REQUIRED)

add_executable(control_plane_bench
  control_plane_bench.cc
  control_plane_fleet.cc
  control_plane_jobs.cc
  control_plane_process.cc
  control_plane_prometheus.cc
  control_plane_report.cc
  control_plane_scale.cc
  control_plane_stats.cc)
target_link_libraries(control_plane_bench PRIVATE
  tessera::daemon tessera::proto tessera_bench_env
  absl::flags absl::str_format absl::synchronization absl::time
  nlohmann_json::nlohmann_json Threads::Threads)
set_target_properties(control_plane_bench PROPERTIES
  RUNTIME_OUTPUT_DIRECTORY "${CMAKE_BINARY_DIR}/bench")
# It starts the real coordinator.
add_dependencies(control_plane_bench tessera-coordinator)

# tessera_queues: queues, quotas, fair share and preemption selection for shared clusters
# (queue_config.h, queue_admission.h, fair_share.h, queue_preemption.h). Pure logic over the
# queue file (yaml-cpp) and Abseil: no gRPC, SQLite, Prometheus or LibTorch (the layering check
# enforces it). The coordinator reads the file (queue_file.h) and applies these at submission
# (JobManager) and in each scheduling pass (SchedulingPass). Included by coordinator/CMakeLists.txt,
# hence the absolute source paths.

find_package(yaml-cpp REQUIRED)
add_library(tessera_queues STATIC "${CMAKE_CURRENT_LIST_DIR}/queue_config.cc"
  "${CMAKE_CURRENT_LIST_DIR}/queue_admission.cc" "${CMAKE_CURRENT_LIST_DIR}/fair_share.cc"
  "${CMAKE_CURRENT_LIST_DIR}/queue_preemption.cc")
add_library(tessera::queues ALIAS tessera_queues)
target_link_libraries(tessera_queues PUBLIC tessera::common absl::status absl::statusor
    absl::strings absl::str_format absl::time
  PRIVATE yaml-cpp absl::flat_hash_map)

if(TESSERA_BUILD_TESTS)
  tessera_add_test(NAME queues_test SOURCES "${CMAKE_CURRENT_LIST_DIR}/queue_config_test.cc"
    "${CMAKE_CURRENT_LIST_DIR}/queue_admission_test.cc"
    "${CMAKE_CURRENT_LIST_DIR}/fair_share_test.cc"
    "${CMAKE_CURRENT_LIST_DIR}/queue_preemption_test.cc"
    LIBS tessera::queues)
endif()

# tessera_scheduler: the gang scheduler (scheduler.h), a pure function of the cluster's free
# devices and the waiting jobs' requests. Protobuf messages and Abseil only: no gRPC, SQLite,
# Prometheus or OpenSSL (the layering check enforces it). Included by coordinator/CMakeLists.txt
# and by the fuzz build (tests/fuzz), hence the absolute source paths.

add_library(tessera_scheduler STATIC "${CMAKE_CURRENT_LIST_DIR}/scheduler.cc")
add_library(tessera::scheduler ALIAS tessera_scheduler)
target_link_libraries(tessera_scheduler PUBLIC tessera::common tessera::proto
  absl::flat_hash_map absl::strings absl::str_format)

if(TESSERA_BUILD_TESTS)
  tessera_add_test(NAME scheduler_test SOURCES "${CMAKE_CURRENT_LIST_DIR}/scheduler_test.cc"
    LIBS tessera::scheduler)
endif()

# tessera_store: the coordinator's durable state in SQLite (store.h): jobs, their events, nodes
# and checkpoints; the SQLite plumbing under it in sqlite_database.h. Protobuf messages, Abseil
# and SQLite: no gRPC (the layering check enforces it).

find_package(SQLite3 REQUIRED)
add_library(tessera_store STATIC
  "${CMAKE_CURRENT_LIST_DIR}/sqlite_database.cc"
  "${CMAKE_CURRENT_LIST_DIR}/store.cc"
  "${CMAKE_CURRENT_LIST_DIR}/store_events.cc"
  "${CMAKE_CURRENT_LIST_DIR}/store_jobs.cc"
  "${CMAKE_CURRENT_LIST_DIR}/store_metrics.cc"
  "${CMAKE_CURRENT_LIST_DIR}/store_migrations.cc"
  "${CMAKE_CURRENT_LIST_DIR}/store_nodes.cc")
add_library(tessera::store ALIAS tessera_store)
target_link_libraries(tessera_store PUBLIC tessera::common tessera::proto SQLite::SQLite3
  absl::flat_hash_map absl::status absl::statusor absl::strings absl::str_format
  absl::synchronization absl::time)

if(TESSERA_BUILD_TESTS)
  tessera_add_test(NAME store_test SOURCES "${CMAKE_CURRENT_LIST_DIR}/store_test.cc"
    LIBS tessera::store tessera::test_util)
endif()

# tessera_store: the coordinator's durable state (store.h): jobs, their events, nodes,
# checkpoints and the queues' fair-share usage, in SQLite (sqlite_database.h) or PostgreSQL
# (postgres_database.h, libpq from Debian's libpq-dev) behind one seam (store_database.h), and the
# coordinators' leader election on PostgreSQL with the fence of the store's writes
# (leader_election.h), both over one PostgreSQL client layer (postgres_client.h).
# Protobuf messages, Abseil, SQLite and libpq: no gRPC (the layering check enforces it).

find_package(SQLite3 REQUIRED)
find_path(TESSERA_LIBPQ_INCLUDE_DIR libpq-fe.h PATH_SUFFIXES postgresql REQUIRED)
find_library(TESSERA_LIBPQ_LIBRARY pq REQUIRED)
add_library(tessera_store STATIC
  "${CMAKE_CURRENT_LIST_DIR}/leader_election.cc"
  "${CMAKE_CURRENT_LIST_DIR}/postgres_client.cc"
  "${CMAKE_CURRENT_LIST_DIR}/postgres_database.cc"
  "${CMAKE_CURRENT_LIST_DIR}/sqlite_database.cc"
  "${CMAKE_CURRENT_LIST_DIR}/store.cc"
  "${CMAKE_CURRENT_LIST_DIR}/store_database.cc"
  "${CMAKE_CURRENT_LIST_DIR}/store_events.cc"
  "${CMAKE_CURRENT_LIST_DIR}/store_jobs.cc"
  "${CMAKE_CURRENT_LIST_DIR}/store_metrics.cc"
  "${CMAKE_CURRENT_LIST_DIR}/store_migrations.cc"
  "${CMAKE_CURRENT_LIST_DIR}/store_nodes.cc"
  "${CMAKE_CURRENT_LIST_DIR}/store_queue_usage.cc")
add_library(tessera::store ALIAS tessera_store)
target_include_directories(tessera_store PUBLIC "${TESSERA_LIBPQ_INCLUDE_DIR}")
target_link_libraries(tessera_store PUBLIC tessera::common tessera::proto SQLite::SQLite3
  "${TESSERA_LIBPQ_LIBRARY}"
  absl::flat_hash_map absl::status absl::statusor absl::strings absl::str_format
  absl::synchronization absl::time)

if(TESSERA_BUILD_TESTS)
  # One binary per concern; store_test_util.h holds what they share.
  foreach(_store_test IN ITEMS leader_election_test postgres_client_test store_commit_test
      store_database_test
      store_events_test store_jobs_test store_metrics_test store_migration_test store_nodes_test
      store_postgres_test store_queue_usage_test)
    tessera_add_test(NAME ${_store_test} SOURCES "${CMAKE_CURRENT_LIST_DIR}/${_store_test}.cc"
      LIBS tessera::store tessera::test_util)
  endforeach()
endif()

find_package(SQLite3 REQUIRED)
target_sources(tessera_coordinator PRIVATE store.cc)
target_link_libraries(tessera_coordinator PUBLIC SQLite::SQLite3
  absl::flat_hash_map absl::status absl::statusor absl::strings absl::str_format absl::synchronization absl::time)
if(TESSERA_BUILD_TESTS)
  tessera_add_test(NAME store_test SOURCES store_test.cc LIBS tessera::coordinator tessera::test_util)
endif()

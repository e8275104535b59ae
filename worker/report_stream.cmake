# tessera_report_stream: the worker's reader of the trainers' report stream (report_stream.h), the
# one parser of bytes a trainer process writes. Protobuf messages only: the worker links it, the
# fuzz build (tests/fuzz) links this same library, hence the absolute source path.

add_library(tessera_report_stream STATIC "${CMAKE_CURRENT_LIST_DIR}/report_stream.cc")
add_library(tessera::report_stream ALIAS tessera_report_stream)
target_link_libraries(tessera_report_stream PUBLIC tessera::common tessera::proto absl::status
  absl::statusor absl::strings)

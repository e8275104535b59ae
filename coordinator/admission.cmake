# tessera_admission: what the coordinator decides about a job spec before it is stored:
# validation with clear errors (job_validation.h) and the layout plan for the devices on offer
# (layout_planning.h). Over the planner and the scheduler's requests: no gRPC, SQLite or LibTorch
# (the layering check enforces it). Included by coordinator/CMakeLists.txt and by the fuzz build.

add_library(tessera_admission STATIC "${CMAKE_CURRENT_LIST_DIR}/job_validation.cc"
  "${CMAKE_CURRENT_LIST_DIR}/layout_planning.cc")
add_library(tessera::admission ALIAS tessera_admission)
target_link_libraries(tessera_admission PUBLIC tessera::planner tessera::scheduler tessera::proto
  tessera::common absl::status absl::statusor absl::strings absl::str_format)

if(TESSERA_BUILD_TESTS)
  tessera_add_test(NAME job_validation_test
    SOURCES "${CMAKE_CURRENT_LIST_DIR}/job_validation_test.cc" LIBS tessera::admission)
endif()

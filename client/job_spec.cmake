# tessera_job_spec: job spec files (YAML or JSON) to JobSpec messages (job_spec_file.h). Plain C++
# over protobuf messages: the CLI links it through tessera_client, the fuzz build (tests/fuzz)
# links this same library, hence the absolute source path.

find_package(yaml-cpp REQUIRED)
find_package(nlohmann_json REQUIRED)
add_library(tessera_job_spec STATIC "${CMAKE_CURRENT_LIST_DIR}/job_spec_file.cc")
add_library(tessera::job_spec ALIAS tessera_job_spec)
target_link_libraries(tessera_job_spec PUBLIC tessera::common tessera::proto absl::status
  absl::statusor absl::strings PRIVATE yaml-cpp nlohmann_json::nlohmann_json)

# checkpoint part of tessera_trainer: sources and tests (see CMakeLists.txt).
# The checkpoint directory protocol (checkpoint.h), XXH3-128 of shard files
# (xxh3.h; SHA-256, sha256.h, for manifests written before it), safetensors export (safetensors.h) and the resharding tensor
# slice shard files (shard_file.h) with their box geometry (tensor_box.h).
# Plain C++: no LibTorch.

target_sources(tessera_trainer PRIVATE checkpoint.cc sha256.cc xxh3.cc safetensors.cc shard_file.cc
  tensor_box.cc)

find_package(OpenSSL REQUIRED)
find_package(nlohmann_json REQUIRED)
find_package(PkgConfig REQUIRED)
pkg_check_modules(XXHASH REQUIRED IMPORTED_TARGET libxxhash)
target_link_libraries(tessera_trainer PUBLIC
  OpenSSL::Crypto PkgConfig::XXHASH nlohmann_json::nlohmann_json absl::synchronization)

if(TESSERA_BUILD_TESTS)
  tessera_add_test(NAME checkpoint_test
    SOURCES checkpoint_test.cc safetensors_test.cc shard_file_test.cc tensor_box_test.cc
    LIBS tessera::trainer tessera::test_util)
endif()

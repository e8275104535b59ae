# data part of tessera_trainer: sources and tests (see CMakeLists.txt).
#
# Token shards, tokenizers, the batch loader and the prepare step. None of these files includes
# LibTorch, so they skip the trainer's LibTorch precompiled header and build in seconds.

find_package(PkgConfig REQUIRED)
pkg_check_modules(SENTENCEPIECE REQUIRED IMPORTED_TARGET sentencepiece)
find_package(nlohmann_json 3 REQUIRED)

# libsentencepiece exports its bundled protobuf-lite 3.14, which cannot share a link-map
# namespace with libprotobuf 3.21. Only this shim links it; tokenizer.cc loads the shim with
# dlmopen() into a namespace of its own (see sentencepiece_shim.h). It lands in build/lib, i.e.
# ../lib from the binaries in build/bin and build/tests.
add_library(tessera_sentencepiece SHARED sentencepiece_shim.cc)
target_include_directories(tessera_sentencepiece PRIVATE ${PROJECT_SOURCE_DIR})
target_link_libraries(tessera_sentencepiece PRIVATE PkgConfig::SENTENCEPIECE)
target_link_options(tessera_sentencepiece PRIVATE -Wl,--no-undefined)
set_target_properties(tessera_sentencepiece PROPERTIES
  CXX_VISIBILITY_PRESET hidden
  LIBRARY_OUTPUT_DIRECTORY "${CMAKE_BINARY_DIR}/lib")

# Hugging Face tokenizer.json files run in the `tokenizers` Python package: hf_tokenizer.cc starts
# hf_tokenizer_server.py, copied to build/lib beside the shim (found there from build/bin and
# build/tests; the source tree's copy is the fallback), with the python that holds torch.
configure_file(hf_tokenizer_server.py "${CMAKE_BINARY_DIR}/lib/hf_tokenizer_server.py" COPYONLY)

set(TESSERA_DATA_SOURCES token_shard.cc tokenizer.cc hf_tokenizer.cc data_loader.cc prepare.cc)
target_sources(tessera_trainer PRIVATE ${TESSERA_DATA_SOURCES})
set_source_files_properties(${TESSERA_DATA_SOURCES} PROPERTIES SKIP_PRECOMPILE_HEADERS ON)
set_source_files_properties(tokenizer.cc PROPERTIES COMPILE_DEFINITIONS
  "TESSERA_SENTENCEPIECE_SHIM_PATH=\"$<TARGET_FILE:tessera_sentencepiece>\"")
set(TESSERA_HF_TOKENIZER_DEFINITIONS
  "TESSERA_HF_TOKENIZER_SERVER_PATH=\"${CMAKE_CURRENT_SOURCE_DIR}/hf_tokenizer_server.py\"")
if(TESSERA_PYTHON)
  list(APPEND TESSERA_HF_TOKENIZER_DEFINITIONS "TESSERA_DEFAULT_PYTHON=\"${TESSERA_PYTHON}\"")
endif()
set_source_files_properties(hf_tokenizer.cc PROPERTIES COMPILE_DEFINITIONS
  "${TESSERA_HF_TOKENIZER_DEFINITIONS}")
add_dependencies(tessera_trainer tessera_sentencepiece)
target_link_libraries(tessera_trainer
  PUBLIC absl::status absl::statusor absl::strings absl::str_format absl::synchronization
         absl::time ${CMAKE_DL_LIBS}
  PRIVATE nlohmann_json::nlohmann_json)

if(TESSERA_BUILD_TESTS)
  tessera_add_test(NAME data_test
    SOURCES token_shard_test.cc tokenizer_test.cc hf_tokenizer_test.cc data_loader_test.cc
            prepare_test.cc
    LIBS tessera::trainer tessera::test_util nlohmann_json::nlohmann_json)
  # The bundled corpus (data/corpus), which the tests tokenize; the python whose `tokenizers`
  # builds and checks the Hugging Face tokenizers of the tests (they skip without it).
  target_compile_definitions(data_test PRIVATE
    TESSERA_CORPUS_DIR="${PROJECT_SOURCE_DIR}/data/corpus"
    TESSERA_TEST_PYTHON="${TESSERA_PYTHON}")
endif()

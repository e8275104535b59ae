# model part of tessera_trainer: sources and tests (see CMakeLists.txt).
# hf_weights.cc: Hugging Face import and export of the model's weights.
target_sources(tessera_trainer PRIVATE activation_checkpoint.cc model.cc tensor_parallel.cc
  hf_weights.cc)

if(TESSERA_BUILD_TESTS)
  tessera_add_test(NAME model_test
    SOURCES model_test.cc
    LIBS tessera::trainer)
  target_precompile_headers(model_test REUSE_FROM tessera_trainer)

  tessera_add_test(NAME activation_checkpoint_test
    SOURCES activation_checkpoint_test.cc
    LIBS tessera::trainer)
  target_precompile_headers(activation_checkpoint_test REUSE_FROM tessera_trainer)
endif()

# model part of tessera_trainer: sources and tests (see CMakeLists.txt).
# hf_weights.cc: Hugging Face import and export of the model's weights.
target_sources(tessera_trainer PRIVATE activation_checkpoint.cc model.cc tensor_parallel.cc
  hf_weights.cc)

if(TESSERA_BUILD_TESTS)
  tessera_add_test(NAME model_test
    SOURCES model_test.cc
    LIBS tessera::trainer)
  target_precompile_headers(model_test REUSE_FROM tessera_trainer)

  # The loss under a loss mask (prompt masking), plain and vocab-parallel on in-process Gloo.
  tessera_add_test(NAME loss_mask_test
    SOURCES loss_mask_test.cc
    LIBS tessera::trainer)
  target_precompile_headers(loss_mask_test REUSE_FROM tessera_trainer)
  target_include_directories(loss_mask_test SYSTEM PRIVATE "${TESSERA_GLOO_INCLUDE_DIR}")

  tessera_add_test(NAME activation_checkpoint_test
    SOURCES activation_checkpoint_test.cc
    LIBS tessera::trainer)
  target_precompile_headers(activation_checkpoint_test REUSE_FROM tessera_trainer)
endif()

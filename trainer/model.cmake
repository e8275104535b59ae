# model part of tessera_trainer: sources and tests (see CMakeLists.txt).
# hf_weights.cc: Hugging Face import and export of the model's weights; linear_cross_entropy.cc: the
# head and its loss in chunks, without the whole logits.
target_sources(tessera_trainer PRIVATE activation_checkpoint.cc model.cc tensor_parallel.cc
  hf_weights.cc linear_cross_entropy.cc)

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

  # The language-model head and its loss in chunks against linear + cross_entropy.
  tessera_add_test(NAME linear_cross_entropy_test
    SOURCES linear_cross_entropy_test.cc
    LIBS tessera::trainer)
  target_precompile_headers(linear_cross_entropy_test REUSE_FROM tessera_trainer)

  tessera_add_test(NAME activation_checkpoint_test
    SOURCES activation_checkpoint_test.cc
    LIBS tessera::trainer)
  target_precompile_headers(activation_checkpoint_test REUSE_FROM tessera_trainer)
endif()

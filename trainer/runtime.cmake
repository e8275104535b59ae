# runtime part of tessera_trainer: the training loop, process groups, the
# learning-rate schedule and the report channel (see CMakeLists.txt).

# Debian's Gloo headers: c10d's ProcessGroupGloo.hpp includes them, and the
# torch wheel does not ship them (docs/build.md).
find_path(TESSERA_GLOO_INCLUDE_DIR gloo/algorithm.h REQUIRED)

set(TESSERA_RUNTIME_PLAIN_SOURCES heartbeat.cc reporter.cc worker_lifeline.cc)
target_sources(tessera_trainer PRIVATE adamw.cc checkpointing.cc distributed.cc mesh.cc sharded_engine.cc
  pipeline.cc step_profiler.cc train.cc training_state.cc ${TESSERA_RUNTIME_PLAIN_SOURCES})
set_source_files_properties(${TESSERA_RUNTIME_PLAIN_SOURCES} PROPERTIES SKIP_PRECOMPILE_HEADERS ON)
target_include_directories(tessera_trainer SYSTEM PRIVATE "${TESSERA_GLOO_INCLUDE_DIR}")

if(TESSERA_BUILD_TESTS)
  tessera_add_test(NAME runtime_test
    SOURCES heartbeat_test.cc reporter_test.cc worker_lifeline_test.cc
    LIBS tessera::trainer)
  tessera_add_test(NAME adamw_test SOURCES adamw_test.cc LIBS tessera::trainer)
  tessera_add_test(NAME step_profiler_test SOURCES step_profiler_test.cc LIBS tessera::trainer)
  target_precompile_headers(step_profiler_test REUSE_FROM tessera_trainer)
  target_precompile_headers(adamw_test REUSE_FROM tessera_trainer)
  tessera_add_test(NAME planner_memory_test SOURCES planner_memory_test.cc LIBS tessera::trainer)
  target_precompile_headers(planner_memory_test REUSE_FROM tessera_trainer)
endif()
if(TESSERA_BUILD_TESTS)
  # The ZeRO memory test builds Gloo groups in-process.
  target_include_directories(planner_memory_test SYSTEM PRIVATE "${TESSERA_GLOO_INCLUDE_DIR}")
  # ZeRO-3 from a model built without memory: ranks as threads over Gloo, as above.
  tessera_add_test(NAME deferred_init_test SOURCES deferred_init_test.cc LIBS tessera::trainer)
  target_precompile_headers(deferred_init_test REUSE_FROM tessera_trainer)
endif()
if(TESSERA_BUILD_TESTS)
  tessera_add_test(NAME mesh_test SOURCES mesh_test.cc LIBS tessera::trainer)
  target_precompile_headers(mesh_test REUSE_FROM tessera_trainer)
endif()
if(TESSERA_BUILD_TESTS)
  # Asynchronous saves: the copy of the state overlaps the next step, which waits for it.
  tessera_add_test(NAME async_checkpoint_test SOURCES async_checkpoint_test.cc
    LIBS tessera::trainer tessera::test_util)
  target_precompile_headers(async_checkpoint_test REUSE_FROM tessera_trainer)
endif()

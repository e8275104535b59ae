target_sources(tessera_worker PRIVATE trainer_process.cc log_reader.cc orphans.cc proc_stat.cc
  failure_policy.cc)
if(TESSERA_BUILD_TESTS)
  add_executable(fake_trainer ${PROJECT_SOURCE_DIR}/tests/fake_trainer.cc)
  target_link_libraries(fake_trainer PRIVATE tessera::proto tessera::common)
  # common/trainer_env.h only (header-only): the signal the worker sends.
  target_include_directories(fake_trainer PRIVATE "${PROJECT_SOURCE_DIR}")
  set_target_properties(fake_trainer PROPERTIES RUNTIME_OUTPUT_DIRECTORY "${CMAKE_BINARY_DIR}/tests")
  tessera_add_test(NAME trainer_process_test SOURCES trainer_process_test.cc log_reader_test.cc LIBS tessera::worker tessera::test_util)
  target_compile_definitions(trainer_process_test PRIVATE TESSERA_FAKE_TRAINER="$<TARGET_FILE:fake_trainer>")
  add_dependencies(trainer_process_test fake_trainer)
  tessera_add_test(NAME worker_supervision_test
    SOURCES orphans_test.cc failure_policy_test.cc
    LIBS tessera::worker tessera::test_util)
  # The agent against an in-process fake coordinator and fake trainers.
  tessera_add_test(NAME worker_agent_test
    SOURCES worker_agent_test.cc
    LIBS tessera::worker tessera::test_util
    LABEL integration)
  target_compile_definitions(worker_agent_test PRIVATE TESSERA_FAKE_TRAINER="$<TARGET_FILE:fake_trainer>")
  add_dependencies(worker_agent_test fake_trainer)
  # The agent in-process on a simulated clock, with fake trainers behind TrainerLauncher.
  tessera_add_test(NAME worker_agent_sim_test
    SOURCES worker_agent_sim_test.cc
    LIBS tessera::worker tessera::test_util)
  # The agent and coordinators that fail over, and its coordinator grace (simulated clock).
  tessera_add_test(NAME worker_failover_test
    SOURCES worker_failover_test.cc
    LIBS tessera::worker tessera::test_util)
endif()

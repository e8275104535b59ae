# trainer benchmark: tessera-trainer against an equivalent PyTorch eager script
# (trainer_bench.py drives, pytorch_baseline.py is the baseline; scripts/bench.sh
# runs it). Nothing to build. The test times nothing: it checks that both sides
# train the same small GPT-2 and Qwen3-shaped models to the same losses at every
# step, which is what makes the benchmark's ratio a like-for-like comparison; and
# that --profile traces both sides.
if(TESSERA_BUILD_TESTS)
  add_test(NAME trainer_bench.equivalence
    COMMAND "${TESSERA_PYTHON}" "${CMAKE_CURRENT_SOURCE_DIR}/trainer_bench.py" --check --device=cpu
    WORKING_DIRECTORY "${PROJECT_SOURCE_DIR}")
  set_tests_properties(trainer_bench.equivalence PROPERTIES
    ENVIRONMENT "TESSERA_BUILD_DIR=${CMAKE_BINARY_DIR}"
    LABELS integration
    TIMEOUT 600)
  # --profile on CPU: every side writes a Chrome trace of the same 3 steps (the trainer through
  # --profile_dir, the baselines, eager and torch.compile, through torch.profiler) and
  # profile_summary.py reads them.
  add_test(NAME trainer_bench.profile
    COMMAND "${TESSERA_PYTHON}" "${CMAKE_CURRENT_SOURCE_DIR}/trainer_bench.py" --device=cpu
      --configs=tiny-gpt2-host "--profile=${CMAKE_CURRENT_BINARY_DIR}/profile"
      --baselines=eager,compile
    WORKING_DIRECTORY "${PROJECT_SOURCE_DIR}")
  set_tests_properties(trainer_bench.profile PROPERTIES
    ENVIRONMENT "TESSERA_BUILD_DIR=${CMAKE_BINARY_DIR}"
    LABELS integration
    TIMEOUT 300)
endif()

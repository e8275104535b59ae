target_sources(tessera_coordinator PRIVATE scheduler.cc)
if(TESSERA_BUILD_TESTS)
  tessera_add_test(NAME scheduler_test SOURCES scheduler_test.cc LIBS tessera::coordinator)
endif()

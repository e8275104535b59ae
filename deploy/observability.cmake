# The alert rules, checked and unit-tested with Prometheus' own promtool (Debian's prometheus
# package, which scripts/bootstrap.sh installs); the dashboards linted and run against a real
# Prometheus server scraping a live cluster (deploy/tests/prometheus_test.py).
find_program(TESSERA_PROMTOOL promtool)
find_program(TESSERA_PROMETHEUS prometheus)
set(_rules "${CMAKE_CURRENT_SOURCE_DIR}/helm/tessera/files/alerts.rules.yaml")
if(TESSERA_PROMTOOL)
  add_test(NAME alert_rules_check COMMAND ${TESSERA_PROMTOOL} check rules ${_rules})
  add_test(NAME alert_rules_unit_test COMMAND ${TESSERA_PROMTOOL} test rules alerts_test.yaml
    WORKING_DIRECTORY "${CMAKE_CURRENT_SOURCE_DIR}/prometheus")
else()
  # Reported as skipped, never as passed.
  add_test(NAME alert_rules_check COMMAND sh -c "echo 'promtool not installed'; exit 77")
  add_test(NAME alert_rules_unit_test COMMAND sh -c "echo 'promtool not installed'; exit 77")
endif()
set_tests_properties(alert_rules_check alert_rules_unit_test PROPERTIES
  LABELS unit SKIP_RETURN_CODE 77 TIMEOUT 60)

add_test(NAME dashboards_lint_test
  COMMAND ${TESSERA_TOOLS_PYTHON} "${CMAKE_CURRENT_SOURCE_DIR}/grafana/generate.py" --check)
set_tests_properties(dashboards_lint_test PROPERTIES LABELS unit TIMEOUT 60)

add_test(NAME prometheus_dashboards_test
  COMMAND ${TESSERA_TOOLS_PYTHON} "${CMAKE_CURRENT_SOURCE_DIR}/tests/prometheus_test.py"
    --bin_dir "${CMAKE_BINARY_DIR}/bin"
    --prometheus "${TESSERA_PROMETHEUS}"
    --corpus "${PROJECT_SOURCE_DIR}/data/corpus/kjv-genesis-ruth.txt")
set_tests_properties(prometheus_dashboards_test PROPERTIES
  LABELS integration SKIP_RETURN_CODE 77 TIMEOUT 300)

# The Helm chart rendered offline by a real Helm (helm-python-sdk) for several values sets, every
# object validated against Kubernetes' OpenAPI schemas (1.30 and the newest kubernetes-validate
# ships, strict), the Prometheus Operator objects against their schemas and promtool, the values
# schema's rejections, and deploy/manifests/tessera.yaml against a fresh render.
add_test(NAME helm_chart_test
  COMMAND ${TESSERA_TOOLS_PYTHON} "${CMAKE_CURRENT_SOURCE_DIR}/tests/chart_test.py"
    --promtool "${TESSERA_PROMTOOL}")
set_tests_properties(helm_chart_test PROPERTIES LABELS unit SKIP_RETURN_CODE 77 TIMEOUT 120)

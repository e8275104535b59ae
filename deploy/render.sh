#!/usr/bin/env bash
# Renders deploy/manifests/tessera.yaml from the Helm chart's defaults (with Helm itself, through
# the deploy tools that scripts/bootstrap.sh installs). Run after changing the chart.
set -euo pipefail
cd "$(dirname "$0")/.."
python=$(scripts/bootstrap.sh --print-tools-python)
[[ -n "$python" ]] || { echo "render: deploy tools unavailable" >&2; exit 1; }
"$python" deploy/tests/chart_test.py --write

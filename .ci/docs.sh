#!/usr/bin/env bash
# CI: build the documentation site with every warning an error (broken links, missing
# modules in `::: ...` blocks, bad docstrings). Called from .ci/run after the test suite.
# Uses .venv when it exists (the CI's), else the python3 on PATH; installs the docs extra.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 NO_MKDOCS_2_WARNING=1
PY=python3
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
"$PY" -m pip install -q -e ".[docs]" -e backends/sim
"$PY" -m mkdocs build --strict --site-dir "${DOCS_SITE_DIR:-site}"

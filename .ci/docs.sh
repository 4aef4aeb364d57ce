#!/usr/bin/env bash
# CI: build the documentation site with every warning an error (broken links, missing
# modules in `::: ...` blocks, bad docstrings), then open every built page in headless
# Chromium, offline, and fail on a diagram left unrendered, a code sample wider than the
# content column or a raw reStructuredText role such as :class:`X` (.ci/docs_check.py).
# Called from .ci/run after the test suite, with CI=true: there a missing Chromium fails the
# check (.ci/install-chromium.sh installs it, Debian, root); elsewhere the browser check is
# skipped without Chromium, with a message (the raw-role check runs either way).
# Uses .venv when it exists (the CI's), else the python3 on PATH; installs the docs extra.
# The build takes mermaid's script from the npm registry once (.ci/mkdocs_hooks.py).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 NO_MKDOCS_2_WARNING=1
PY=python3
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
SITE=${DOCS_SITE_DIR:-site}
"$PY" -m pip install -q -e ".[docs]" -e backends/sim
"$PY" -m mkdocs build --strict --site-dir "$SITE"
"$PY" .ci/docs_check.py "$SITE"

#!/usr/bin/env bash
# Set up and run the whole test suite:
#   creates .venv if missing, installs the package with its test extra (torch CPU included),
#   pulls the default model and the embedding model (verified; skipped when already present),
#   then runs pytest.
# Extra arguments go to pytest, e.g. `bash tools/test.sh tests/test_pull.py -q`.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
.venv/bin/turbospark pull --quiet
.venv/bin/turbospark pull --quiet all-minilm-l6-v2     # the embedding model (~90 MB)

set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
exit "$rc"

#!/usr/bin/env bash
# Install what the tests need and run them (pytest). Extra arguments go to pytest,
# e.g. `scripts/test.sh -m "not slow"` to skip the end-to-end `flwr run` tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
exec "${FEDEDGE_VENV:-.venv}/bin/python" -m pytest "$@"

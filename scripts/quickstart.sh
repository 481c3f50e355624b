#!/usr/bin/env bash
# Install fededge and run the default experiment: `flwr run .` in Flower's simulation
# runtime, 10 clients on scikit-learn's digits (Dirichlet 0.5), small CNN, local SGD.
# `fededge simulate` runs flwr run on a private local SuperLink with runtime dependency
# installation disabled, streams the log, stops the SuperLink afterwards and exits
# non-zero if the run failed. Extra arguments go to `fededge simulate`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec "${FEDEDGE_VENV:-.venv}/bin/fededge" simulate . --num-supernodes 10 "$@"

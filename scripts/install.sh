#!/usr/bin/env bash
# Install fededge into a virtual environment (default .venv; FEDEDGE_VENV to change it),
# CPU-safe: torch is installed first, pinned by constraints.txt, so that pip does not pull
# a multi-GB CUDA build on a machine without a GPU. On a CUDA machine the same pin gives
# the CUDA build from the package index. Usage: scripts/install.sh [EXTRAS], e.g. "test".
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${FEDEDGE_VENV:-.venv}"
extras="${1:-}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
torch_pin=$(grep -E '^torch==' constraints.txt)
"$py" -m pip install -q --disable-pip-version-check "$torch_pin"
spec="."
[ -n "$extras" ] && spec=".[$extras]"
"$py" -m pip install -q --disable-pip-version-check -c constraints.txt -e "$spec"
"$py" - <<'PY'
import flwr, torch, fededge
print(f"fededge {fededge.__version__}, flwr {flwr.__version__}, torch {torch.__version__}, "
      f"CUDA available: {torch.cuda.is_available()}")
PY

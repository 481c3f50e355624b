#!/usr/bin/env bash
# Install fededge into a virtual environment, CPU-safe.
#
#   scripts/install.sh [EXTRAS]     e.g. scripts/install.sh test
#
# torch is installed first, at the version pinned in constraints.txt, so that pip does not
# pull a multi-GB CUDA build on a machine without a GPU; then fededge with the same
# constraints. Environment:
#   FEDEDGE_VENV         the virtual environment (default .venv)
#   FEDEDGE_PYTHON       the interpreter that creates it (default python3)
#   FEDEDGE_TORCH_INDEX  a package index for torch alone, e.g. PyTorch's CPU index
#                        https://download.pytorch.org/whl/cpu on an x86-64 machine whose
#                        default index would give the CUDA build
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${FEDEDGE_VENV:-.venv}"
python="${FEDEDGE_PYTHON:-python3}"
extras="${1:-}"
if [ ! -x "$venv/bin/python" ]; then
  if ! "$python" -c "import venv, ensurepip" 2>/dev/null; then
    echo "install.sh: $python cannot create a virtual environment (no venv/ensurepip)." >&2
    echo "  On Debian, Ubuntu or Raspberry Pi OS: sudo apt install python3-venv" >&2
    exit 1
  fi
  "$python" -m venv "$venv"
fi
py="$venv/bin/python"
"$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' || {
  echo "install.sh: fededge needs Python >= 3.10, $venv has $("$py" -V)" >&2; exit 1; }
torch_pin=$(grep -E '^torch==' constraints.txt)
pip=("$py" -m pip install -q --disable-pip-version-check)
if [ -n "${FEDEDGE_TORCH_INDEX:-}" ]; then
  "${pip[@]}" --index-url "$FEDEDGE_TORCH_INDEX" "$torch_pin"
else
  "${pip[@]}" "$torch_pin"
fi
spec="."
[ -n "$extras" ] && spec=".[$extras]"
"${pip[@]}" -c constraints.txt -e "$spec"
"$py" - <<'PY'
import flwr, torch, fededge
print(f"fededge {fededge.__version__}, flwr {flwr.__version__}, torch {torch.__version__}, "
      f"CUDA available: {torch.cuda.is_available()}")
PY

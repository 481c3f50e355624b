#!/usr/bin/env bash
# The numeric tests under other CPU code paths: results that depend on the CPU's
# instruction set, on torch's vectorised kernels or on the thread count fail here, on any
# machine, instead of on the one CI machine that happens to have AVX-512.
#
#   scripts/test_portable.sh            four runs that cover every setting below once
#   scripts/test_portable.sh --full     every combination (18 runs)
#   scripts/test_portable.sh -- ARGS    extra pytest arguments (after --)
#
# Settings:
#   MKL_ENABLE_INSTRUCTIONS  SSE4_2 | AVX2 | the machine's own   (MKL's matmul/QR kernels)
#   ATEN_CPU_CAPABILITY      default | avx2 | the machine's own  (torch's own vector kernels)
#   OMP_NUM_THREADS          1 | 2 | 16                            (torch intra-op threads;
#                                                                  16 as on a GPU machine's
#                                                                  16 cores, oversubscribed here)
# A forced setting above what the CPU has falls back to the CPU's own. The main suite
# (scripts/test.sh) runs with the machine's own settings and its default thread count.
# Tests: the codecs, the algorithms, the topologies and the client's local SGD, whose
# results are compared bit for bit or to a stated tolerance (docs/wire-format.md, "What
# is exact").
set -euo pipefail
cd "$(dirname "$0")/.."
py="${FEDEDGE_VENV:-.venv}/bin/python"
full=0
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --full) full=1 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "test_portable.sh: unknown argument $1 (use --full, or -- PYTEST-ARGS)" >&2; exit 2 ;;
  esac
  shift
done
# test_fuzz.py is left out: it checks that malformed bytes are refused, and compares no
# float result across code paths (it takes a third of the time).
tests=(tests/compress tests/algorithms tests/topology tests/clients/test_train.py tests/clients/test_cohort.py
       --ignore=tests/compress/test_fuzz.py)
own=""  # empty: the variable is unset and the library picks the CPU's best path
if [ $full = 1 ]; then
  combos=()
  for mkl in SSE4_2 AVX2 "$own"; do
    for aten in default avx2; do
      for th in 1 2 16; do combos+=("$mkl|$aten|$th"); done
    done
  done
else
  combos=("SSE4_2|default|1" "AVX2|avx2|2" "$own|$own|1" "$own|$own|16")
fi
failed=0
for c in "${combos[@]}"; do
  IFS='|' read -r mkl aten th <<<"$c"
  envs=(OMP_NUM_THREADS="$th")
  [ -n "$mkl" ] && envs+=(MKL_ENABLE_INSTRUCTIONS="$mkl")
  [ -n "$aten" ] && envs+=(ATEN_CPU_CAPABILITY="$aten")
  label="MKL=${mkl:-own} ATEN=${aten:-own} threads=$th"
  if out=$(env "${envs[@]}" "$py" -m pytest -q -p no:cacheprovider -m "not slow" "${tests[@]}" "${extra[@]}" 2>&1); then
    echo "portable: $label: $(tail -n 1 <<<"$out")"
  else
    echo "portable: $label: FAILED"
    echo "$out" | tail -n 40
    failed=1
  fi
done
exit $failed
